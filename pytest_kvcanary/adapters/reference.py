"""The embedded default: the reference engine, sized for tests."""

from __future__ import annotations

from typing import Any

from ..reference_engine.config import EngineConfig, ModelConfig
from ..reference_engine.engine import Engine
from ..reference_engine.parallel.shard import ReferenceShards
from ..reference_engine.weights import read_config


def reference_config(attention: str, device: str, seed: int, model: str | None = None, *,
                     speculative_k: int = 0, page_size: int = 1, host_num_slots: int = 0,
                     num_slots: int = 1024, swa_num_slots: int = 512, max_running: int = 8,
                     disk_dir: str | None = None, disk_num_pages: int = 1024, kv_dtype: str = "auto",
                     kv_scale: str = "tensor", async_scheduling: bool = False,
                     jitter_seed: int | None = None) -> EngineConfig:
    """A small Llama-style model on random weights: mha, swa with a window short enough that test
    prompts slide past it, or mla (latent KV pools). model: a local checkpoint directory whose
    weights replace the random ones (mha and swa). speculative_k > 0: speculative decoding with
    that many draft tokens per step (mha, mla and hybrid; a hybrid draft takes the first two layers,
    one of them attention). page_size: tokens per KV page; host_num_slots >
    0: a host-memory tier of that many slots behind the radix cache (mha and mla); num_slots,
    swa_num_slots (multiples of page_size), max_running: the pools and rows (smaller ones put the
    engine under memory pressure: eviction, write-back, retraction); disk_dir: a directory where a
    storage tier under the host tier keeps pages host memory evicts, at most disk_num_pages of them
    (mha and mla); kv_dtype, kv_scale: what the KV pools store, and FP8's scales (ModelConfig);
    async_scheduling, jitter_seed: each step launched before the one before it is processed, and
    seeded timing jitter. EngineConfig says more."""
    shape = dict(attention=attention, window=16, full_every=2, kv_dtype=kv_dtype, kv_scale=kv_scale)
    config = (ModelConfig(seed=seed, max_context=256, **shape) if model is None
              else read_config(model, **shape))
    return EngineConfig(model=config, num_slots=num_slots, swa_num_slots=swa_num_slots, max_running=max_running,
                        max_batch_tokens=max(512, config.max_context), device=device, checkpoint=model,
                        speculative_k=speculative_k, draft_layers=2 if attention == "hybrid" else 1,
                        page_size=page_size, host_num_slots=host_num_slots, disk_dir=disk_dir,
                        disk_num_pages=disk_num_pages, async_scheduling=async_scheduling, jitter_seed=jitter_seed)


def make_reference_engine(attention: str, device: str, seed: int, model: str | None = None, **options: Any
                          ) -> Engine:
    """The engine of `reference_config` (the same options)."""
    return Engine(reference_config(attention, device, seed, model, **options))


def reference_shards(attention: str, seed: int, model: str | None = None) -> ReferenceShards:
    """The engine of `reference_config` split over a parallel engine's ranks (each rank's device
    replaces the config's)."""
    return ReferenceShards(reference_config(attention, "cpu", seed, model))
