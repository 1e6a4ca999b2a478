"""Which instruction-set path vLLM's CPU attention (CPU_ATTN) runs, and so which KV layout it keeps.

vLLM picks the path by the CPU it runs on (``_get_attn_isa`` in
``vllm/v1/attention/backends/cpu_attn.py``), so the machine would decide the layout the canary
guards; the ``attention_isa`` setting decides instead:

- ``readable`` (default): vLLM's choice, except that ``amx`` becomes ``vec``;
- ``vllm``: vLLM's choice, whatever it is;
- ``amx``, ``vec``, ``vec16``: that path (``amx`` needs a CPU with AMX and bfloat16).

``readable``, ``vec`` and ``vec16`` also set vLLM's attention backend to ``CPU_MLA``
(``latent_backend``), so latent attention never runs the ``AMX_MLA`` backend the adapter does not
know. The environment variable ``KVCANARY_VLLM_ATTENTION_ISA`` sets the default. Under pytest,
``--kv-canary-vllm-attention-isa`` (or its ini key, else that variable) is resolved at start-up
by the adapter's plugin (``adapters/vllm_hooks.py``), which hands it to ``VllmSettings``; nothing
is written to the environment. The paths and their layouts: docs/vllm.md.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

ENV = "KVCANARY_VLLM_ATTENTION_ISA"
CHOICES = ("readable", "vllm", "amx", "vec", "vec16")
DEFAULT = "readable"


def environment_attention_isa() -> str | None:
    """The value of the environment variable, unchecked; None when it is unset."""
    return os.environ.get(ENV)


def default_attention_isa() -> str:
    """The setting's default: the environment variable, else ``readable``."""
    value = environment_attention_isa()
    return DEFAULT if value is None else value


def check_attention_isa(value: str) -> None:
    if value not in CHOICES:
        raise ValueError(f"attention_isa (VllmSettings.attention_isa, or {ENV}) must be one of "
                         f"{', '.join(CHOICES)}; got {value!r}")


def chosen(setting: str, vllm_choice: str) -> str:
    """The path CPU_ATTN runs under this setting, where vLLM itself would run `vllm_choice`."""
    if setting == "vllm":
        return vllm_choice
    if setting == "readable":
        return "vec" if vllm_choice == "amx" else vllm_choice
    if setting == "amx":
        import torch

        if not torch.cpu._is_amx_tile_supported():
            raise RuntimeError("attention_isa='amx' needs a CPU with AMX tiles; this one has none")
    return setting


@contextmanager
def attention_isa(setting: str) -> Iterator[None]:
    """While vLLM builds its attention metadata builders (LLM start-up), CPU_ATTN runs `setting`'s
    path."""
    check_attention_isa(setting)
    from vllm.v1.attention.backends import cpu_attn

    vllm_chooser = cpu_attn._get_attn_isa

    def choose(*args: Any, **kwargs: Any) -> str:
        return chosen(setting, vllm_chooser(*args, **kwargs))

    cpu_attn._get_attn_isa = choose
    try:
        yield
    finally:
        cpu_attn._get_attn_isa = vllm_chooser


def latent_backend(setting: str) -> dict[str, str]:
    """vLLM ``LLM(...)`` keyword arguments for the latent-attention backend under `setting` (none
    where vLLM has no AMX_MLA backend to avoid)."""
    from .versions import amx_latent_backend

    return {} if setting in ("vllm", "amx") or not amx_latent_backend() else {"attention_backend": "CPU_MLA"}
