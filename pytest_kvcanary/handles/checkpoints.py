"""What a `--kv-canary-model` directory must hold for each built-in engine, checked at start-up
(before any test runs) from config.json and the safetensors headers: no weight is read. The
reference and transformers checks build the model on torch's meta device (no memory) to compare
the tensors' shapes with the model's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def _config(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(config.json as a dict, None), or (None, why it cannot serve)."""
    config = path / "config.json"
    if config.is_dir():
        return None, "has a config.json that is a directory, not a file"
    if not config.is_file():
        return None, "has no config.json"
    try:
        text = config.read_bytes()
    except OSError as e:
        return None, f"has a config.json that cannot be read ({e.strerror or e})"
    try:
        hf = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"has a config.json that is not valid JSON ({e})"
    if not isinstance(hf, dict):
        return None, "has a config.json that is not a JSON object"
    return hf, None


def _checkpoint_problem(path: Path, model_types: Callable[[], tuple[str, ...] | None]) -> str | None:
    """Why `path` is not a checkpoint of a model type in model_types() (None: any), or None."""
    hf, why = _config(path)
    if hf is None:
        return why
    allowed = model_types()
    if allowed is not None and hf.get("model_type") not in allowed:
        shown = ", ".join(allowed) if len(allowed) <= 8 else "the types it knows"
        return f"has model_type {hf.get('model_type')!r}, which the engine does not support ({shown})"
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        return f"has no weights ({' or '.join(WEIGHT_PATTERNS)})"
    return None


def _reference_types() -> tuple[str, ...]:
    from ..reference_engine.weights import MODEL_TYPES

    return MODEL_TYPES


def _transformers_types() -> tuple[str, ...]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(CONFIG_MAPPING_NAMES)


def _safetensors_problem(path: Path) -> str | None:
    """Why the directory's *.safetensors files cannot be read (None also without any)."""
    from ..reference_engine.weights import tensor_shapes

    if next(path.glob("*.safetensors"), None) is None:
        return None
    try:
        tensor_shapes(path)
    except ValueError as e:
        return str(e)
    return None


def _transformers_fit(path: Path) -> str | None:
    """Why transformers would refuse the checkpoint's tensors: a tensor whose shape is not the one
    the model its config.json describes has under that name (transformers raises for those;
    names it converts or leaves out it handles itself)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..reference_engine.weights import misfit, tensor_shapes

    if next(path.glob("*.safetensors"), None) is None:
        return None
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # what loading it would raise, in every test
        first = (str(e).strip().splitlines() or [""])[0]
        return f"describes no causal language model transformers can build ({type(e).__name__}: {first})"
    why = misfit(model, tensor_shapes(path), strict=False)
    return None if why is None else f"has tensors that do not fit the model its config.json describes: {why}"


def reference_problem(path: Path) -> str | None:
    """The reference engine reads Llama / Qwen2 checkpoints in safetensors."""
    from ..reference_engine.weights import checkpoint_problem

    return _checkpoint_problem(path, _reference_types) or checkpoint_problem(path)


def transformers_problem(path: Path) -> str | None:
    return _checkpoint_problem(path, _transformers_types) or _safetensors_problem(path) or _transformers_fit(path)


def any_checkpoint_problem(path: Path) -> str | None:
    """A Hugging Face checkpoint of any model type (the engine judges the type itself)."""
    return _checkpoint_problem(path, lambda: None) or _safetensors_problem(path)


# Each built-in engine's check, by engine name: (path) -> why the directory cannot serve it, or None.
PROBLEMS: dict[str, Callable[[Path], str | None]] = {
    "reference": reference_problem, "transformers": transformers_problem, "vllm": any_checkpoint_problem}
