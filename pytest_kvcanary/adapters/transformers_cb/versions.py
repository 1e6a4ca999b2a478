"""What differs between the transformers releases the adapter supports (the version shim), and every
private part of transformers the engine reaches: read here, or patched through here.

The continuous-batching config names its page size ``page_size`` (5.18+) or ``block_size`` (5.17),
and the paged cache changed shape between them, so a layout answers the same questions about
each: ``SectorLayout`` (5.18+, layout_sectors.py) and ``BlockManagerLayout`` (5.17,
layout_block_manager.py). Both report a block id per (request, block index) through
``block_ids``, the hashed FULL blocks and those a live request holds through ``hashed_blocks``
(``hashed_ids``: membership only), every block returning to the free pool through the ``on_free``
callback (before it is released, with a cause; ``causes.cause(...)`` names the cause of what an
outer call releases) and every request whose completed blocks were just hashed through
``on_marked`` (not called for a request that completed none). Their ``install`` patches the cache
through the engine's ``Patches`` (../patches.py), which the engine undoes when it is closed.

The processor's private parts: its IO buffers (one set, or two IO pairs under async batching:
``IOPairs``), ``_generation_step`` (`generation_step`), and the functions that wrap its model
runner's ``compute_batch`` and ``_forward_process_and_sample``, the paged cache's ``update`` and
the offloading manager's ``offload_requests`` and the paged cache's ``search_prefix_match`` (the
prefix hits the soak's liveness gate counts), each through the engine's ``Patches``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch

from .cache_groups import (
    CAUSE_DEDUPLICATED, CAUSE_EVICTED, CAUSE_OFFLOADED, CAUSE_RELEASED, CAUSE_RESET, FULL_ATTENTION,
    SLIDING_ATTENTION, GroupCache, UnsupportedModel,
)
from .layout_block_manager import DEFECT_CACHED_BLOCK_REWRITE, DEFECT_SHARED_DECODE_BLOCK, BlockManagerLayout
from .layout_sectors import SectorLayout
from ..patches import Patches

__all__ = ["CAUSE_DEDUPLICATED", "CAUSE_EVICTED", "CAUSE_OFFLOADED", "CAUSE_RELEASED", "CAUSE_RESET",
           "DEFECT_CACHED_BLOCK_REWRITE", "DEFECT_SHARED_DECODE_BLOCK", "FULL_ATTENTION", "SLIDING_ATTENTION",
           "BlockManagerLayout", "GroupCache", "IOPairs", "SectorLayout", "UnsupportedModel", "cache_layout",
           "config_options", "count_prefix_hits", "generation_step", "guard_compute", "has_cpu_swap_pool", "hold_offload_frees",
           "record_sampled", "report_cache_stores", "sdpa_attention", "start_batching", "StoreReport"]

StoreReport = Callable[[int, torch.Tensor, torch.Tensor], None]  # (model layer, K rows, V rows)


def _config_fields() -> set[str]:
    from transformers import ContinuousBatchingConfig

    return set(inspect.signature(ContinuousBatchingConfig).parameters)


def config_options(page_size: int, **options: Any) -> dict[str, Any]:
    """ContinuousBatchingConfig keyword arguments for this version: the page size under its name,
    and flash attention never switched on behind the model's back (5.18+ asks; 5.17 does not
    switch a model whose attention is already paged, see `sdpa_attention`)."""
    fields = _config_fields()
    options["page_size" if "page_size" in fields else "block_size"] = page_size
    options["auto_switch_to_flash"] = False
    return {name: value for name, value in options.items() if name in fields}


def sdpa_attention() -> str:
    """The attention implementation name under which continuous batching runs SDPA."""
    return "sdpa" if "auto_switch_to_flash" in _config_fields() else "paged|sdpa"


def start_batching(model: Any, eos_token_id: int, page_size: int, **options: Any) -> Any:
    """The model on continuous batching's SDPA, and its ContinuousBatchingManager (greedy, with
    these config options) warmed up: its processor created, CUDA graphs captured when they are on."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(sdpa_attention())
    generation = GenerationConfig(do_sample=False, eos_token_id=eos_token_id, pad_token_id=model.config.pad_token_id)
    config = ContinuousBatchingConfig(**config_options(page_size, **options))
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.warmup()
    return manager


def cache_layout(processor: Any) -> SectorLayout | BlockManagerLayout:
    """The layout of this ContinuousBatchProcessor's paged cache, by transformers version."""
    cache = processor.cache
    if hasattr(cache, "cache_allocators"):
        return SectorLayout(processor)
    if hasattr(cache, "_block_manager"):
        return BlockManagerLayout(processor)
    raise UnsupportedModel(f"unknown transformers paged-cache layout ({type(cache).__module__}); the adapter "
                           "supports the versions pytest-kvcanary[transformers] installs")


class IOPairs:
    """The processor's input and output buffers: one set, or under async batching two IO pairs
    (each a host and a device set) used in turn. ``pairs``: the IO pairs (empty without async
    batching); ``device_ios``: the device sets a forward may consume, by pair."""

    def __init__(self, processor: Any, use_async_batching: bool) -> None:
        self._io = io = processor.inputs_and_outputs
        self.pairs: list[Any] = list(io.io_pairs) if use_async_batching else []
        self.device_ios: list[Any] = [pair.device_io for pair in self.pairs] or [io]

    def pair(self) -> int:
        """The IO pair the batch prepared last is in (always 0 without async batching)."""
        return self._io.current_pair if self.pairs else 0

    def batch_io(self) -> Any:
        """The host-side inputs of the batch prepared last: ``requests_in_batch`` (its
        FutureRequestStates), ``req_id_to_new_token_position``, ``total_seqlen_q``."""
        return self.pairs[self._io.current_pair].host_io if self.pairs else self._io

    def compute_stream(self) -> torch.cuda.Stream | None:
        """The stream transformers computes on (None: no stream of its own, or no CUDA)."""
        return getattr(self._io, "compute_stream", None)

    def drop_graphs(self) -> None:
        """Forget every CUDA graph captured of the forward: each is captured again on first use."""
        for io in self.device_ios:
            io.graphs = type(io.graphs)()

    def update_other_pair(self, processor: Any) -> None:
        """Async batching: update the batch on the other IO pair (the one launched before the last
        one); the current pair stays where transformers prepares the next batch."""
        io = self._io
        io.current_pair = 1 - io.current_pair
        processor.update_batch()
        io.current_pair = 1 - io.current_pair


def generation_step(processor: Any, model: Any) -> None:
    """Compute the batch prepare_next_batch prepared (under async batching: launch it)."""
    processor._generation_step(model)


def guard_compute(patches: Patches, processor: Any, guarded: Callable[[Any, dict[str, Any]], None]
                  ) -> Callable[[Any, dict[str, Any]], None]:
    """guarded(model, batch_data) instead of the model runner's compute_batch (the forward of a
    prepared batch: it runs, or captures and replays, the model and its sampling); returns
    transformers' own compute_batch."""
    runner = processor.model_runner
    compute = runner.compute_batch
    patches.replace(runner, "compute_batch", guarded)
    return compute


def record_sampled(patches: Patches, processor: Any, record: Callable[[dict[str, Any], torch.Tensor], None]) -> None:
    """record(batch_data, output_ids) right after transformers sampled a forward's tokens, inside
    compute_batch (captured with it in a CUDA graph)."""
    def make(sample: Callable[..., None]) -> Callable[..., None]:
        def sample_and_record(model: Any, batch_data: dict[str, Any], *ids: torch.Tensor) -> None:
            sample(model, batch_data, *ids)
            record(batch_data, ids[-1])  # (carry_over_ids, prev_output_ids, output_ids)
        return sample_and_record

    patches.wrap(processor.model_runner, "_forward_process_and_sample", make)


def report_cache_stores(patches: Patches, processor: Any, reporter: Callable[[], StoreReport | None]) -> None:
    """Before the paged cache stores a layer's computed K/V: reporter() says where to hand it
    (model layer, K rows, V rows: [T, H, D], the forward's token order), None for nowhere."""
    cache = processor.cache
    signature = inspect.signature(cache.update)

    def make(update: Callable[..., Any]) -> Callable[..., Any]:
        def reporting_update(*args: Any, **kwargs: Any) -> Any:
            report = reporter()
            if report is not None:
                bound = signature.bind(*args, **kwargs).arguments
                k, v = (bound[name][0].transpose(0, 1) for name in ("key_states", "value_states"))
                report(bound["layer_idx"], k, v)
            return update(*args, **kwargs)
        return reporting_update

    patches.wrap(cache, "update", make)


def waiting_requests(processor: Any) -> Iterable[Any]:
    """The RequestStates the scheduler holds but has not scheduled yet, in the order they came."""
    return processor.scheduler.waiting_requests.values()


def has_cpu_swap_pool(processor: Any) -> bool:
    """Whether the offloading manager keeps a CPU swap pool (5.18+, cpu_offload_space > 0)."""
    return getattr(processor.offloading_manager, "_cpu_pool", None) is not None


def hold_offload_frees(patches: Patches, processor: Any, around: Callable[[Callable[[], bool]], bool]) -> None:
    """around(offload) runs each offload_requests of the offloading manager (which frees the
    offloaded requests' blocks after copying them to the CPU swap pool)."""
    manager = processor.offloading_manager
    patches.wrap(manager, "offload_requests", lambda offload: lambda: around(offload))


def count_prefix_hits(patches: Patches, processor: Any, hit: Callable[[], None]) -> bool:
    """hit() for every request the scheduler admits with a cached prefix: the paged cache's
    ``search_prefix_match`` returned matched tokens. False (nothing patched) where the cache has no
    such method."""
    cache = processor.cache
    if not callable(getattr(cache, "search_prefix_match", None)):
        return False

    def make(search: Callable[..., int]) -> Callable[..., int]:
        def searching(*args: Any, **kwargs: Any) -> int:
            matched = search(*args, **kwargs)
            if matched:
                hit()
            return matched
        return searching

    patches.wrap(cache, "search_prefix_match", make)
    return True
