"""What the canary needs of vLLM's FP8 KV cache (fp8.py: the setting): the default model's
calibrated scales, and the bytes vLLM's own cache write stores (its conversion to FP8 is its own,
not torch's rounding: values a rounding error off an FP8 value were seen stored as the one below).

- `scaled_checkpoint`: the random checkpoint with a compressed-tensors KV-cache scheme and static
  per-tensor K/V scales calibrated as llm-compressor does, so the layers' scales differ.
- `probe_write`: layout.probe's coded tokens written at unit scales (exact FP8 values).
- `stored_rows`: what a forward's cache write stores, for write-through.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from pytest_kvcanary.canary.seam import Half

from .layout import Order, cpu_attn_half, per_token

E4M3_MAX = 448.0  # a calibrated scale maps a layer's largest |K| or |V| there
CALIBRATION_TOKENS = 256

_written: dict[tuple[str, int], tempfile.TemporaryDirectory] = {}


# The default model's scales ----------------------------------------------------------------------

def calibrated_scales(checkpoint: Path, seed: int) -> dict[str, torch.Tensor]:
    """Per attention layer, its static K and V scales as checkpoint weights
    (``model.layers.i.self_attn.k_scale`` / ``v_scale``, float32 ``[1]``): the layer's largest |K|
    (after RoPE) and |V| of a cacheless forward over seeded random tokens, over E4M3_MAX."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokens = torch.randint(0, 256, (1, CALIBRATION_TOKENS), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=tokens, past_key_values=cache, use_cache=True)
    out = {}
    for i, layer in enumerate(cache.layers):
        for name, kv in (("k_scale", layer.keys), ("v_scale", layer.values)):
            out[f"model.layers.{i}.self_attn.{name}"] = (kv.abs().max() / E4M3_MAX).reshape(1)
    return out


def scaled_checkpoint(checkpoint: Path, name: str, seed: int) -> Path:
    """A copy of `checkpoint` (a Llama) with a compressed-tensors KV-cache scheme (8-bit float, per
    tensor, static) and `calibrated_scales`, written once per process and (name, seed)."""
    from safetensors.torch import save_file

    key = (name, seed)
    if key not in _written:
        directory = tempfile.TemporaryDirectory(prefix=f"{name}-fp8-{seed}-")
        target = Path(directory.name)
        shutil.copytree(checkpoint, target, dirs_exist_ok=True)
        config = json.loads((target / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                "symmetric": True}}
        (target / "config.json").write_text(json.dumps(config, indent=2))
        save_file(calibrated_scales(checkpoint, seed), str(target / "kv_scales.safetensors"))
        _written[key] = directory
    return Path(_written[key].name)


# The quantized cache ----------------------------------------------------------------------------

def _normal_bytes(dtype: torch.dtype) -> torch.Tensor:
    """The bytes of `dtype`'s finite normal values, positive then negative (uint8)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    exponent = {torch.float8_e4m3fn: 0x78, torch.float8_e5m2: 0x7C}[dtype]
    codes = torch.arange(256)
    ok = values.isfinite() & ((codes & exponent) != 0)
    return codes[ok].to(torch.uint8)


def probe_write(layer: Any, cache_write: Callable[..., None], kv_cache_dtype: str
                ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """layout.probe's cache write for an FP8 layer: code c (1, 2, ..., a ``uint8`` tensor ``[tokens,
    heads, head_size]``) is written as the c-th finite normal FP8 value, in the model's dtype (exact
    there), through vLLM's `cache_write` at unit scales (so vLLM stores exactly its byte), and each
    stored byte is read back as its code. Raises NotImplementedError for codes past the format's
    normal values (238 in e4m3, 240 in e5m2: a head or block larger than that)."""
    fp8 = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn  # "fp8" is e4m3
    table = _normal_bytes(fp8)
    values = torch.cat([torch.zeros(1), table.view(fp8).float()])  # code -> value (code 0: 0)
    back = torch.zeros(256, dtype=torch.uint8)
    back[table.long()] = torch.arange(1, table.numel() + 1, dtype=torch.uint8)  # byte -> code
    unit = SimpleNamespace(isa=layer.isa, _k_scale_float=1.0, _v_scale_float=1.0)  # what CPU_ATTN's write reads

    def write(tokens: torch.Tensor, scratch: torch.Tensor, slots: torch.Tensor) -> None:
        if int(tokens.max()) > table.numel():
            raise NotImplementedError(f"the FP8 layout probe codes up to {table.numel()} values; a head or block of "
                                      f"{int(tokens.max())} needs more")
        given = values[tokens.long()].to(layer.dtype)
        stored = torch.zeros_like(scratch)
        cache_write(unit, given, given, stored, slots)
        scratch.copy_(back[stored.long()])

    return write


def stored_rows(layer: Any, cache_write: Callable[..., None], orders: dict[Half, Order], block_size: int
                ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """What `layer`'s FP8 cache stores for K/V rows ``[tokens, heads, head_size]`` (in the model's
    dtype), as ``uint8`` rows of the same shape: written by vLLM's own `cache_write` (with the
    scales the layer holds now, the ones the forward's write gets) into a scratch cache, read back
    in the layout's `orders`."""

    def rows(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, heads, head_size = key.shape
        scratch = torch.zeros(-(-tokens // block_size), heads, block_size, 2 * head_size, dtype=torch.uint8)
        cache_write(layer, key, value, scratch, torch.arange(tokens, dtype=torch.int64))
        k, v = (per_token(cpu_attn_half(scratch, half, orders[half]), orders[half]).flatten(0, 1)[:tokens]
                for half in (Half.K, Half.V))
        return k, v

    return rows
