"""The seeded random checkpoints the adapters run by default: a model built from a config and the
byte-level tokenizer, written once per process and (name, seed) into a temporary directory and
loaded from there like any checkpoint (nothing is downloaded)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from .byte_tokenizer import byte_tokenizer

_written: dict[tuple[str, int], tempfile.TemporaryDirectory] = {}


def write_random_checkpoint(config: Any, name: str, seed: int, dtype: Any = None) -> Path:
    """The directory holding a model built from ``config`` under ``torch.manual_seed(seed)`` (the
    caller's random state untouched), cast to ``dtype`` when given, and the byte tokenizer.
    ``name`` says which config it is: the first call for a (name, seed) writes it, later ones
    return it."""
    key = (name, seed)
    if key not in _written:
        import torch
        from transformers import AutoModelForCausalLM

        directory = tempfile.TemporaryDirectory(prefix=f"{name}-{seed}-")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        if dtype is not None:
            model = model.to(dtype)
        model.save_pretrained(directory.name)
        byte_tokenizer().save_pretrained(directory.name)
        _written[key] = directory
    return Path(_written[key].name)
