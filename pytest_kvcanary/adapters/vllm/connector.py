"""CanaryConnector: the canary's way into vLLM, through vLLM's KV-connector interface.

vLLM builds one connector per scheduler and one per worker process, from the module path and
class name in ``kv_transfer_config``. The canary's engine adapter (engine.py) registers itself
under a key it puts in ``kv_connector_extra_config`` (and drops that entry when it is closed); the
connectors reach it through `registry`.
vLLM calls, per step, in this order:

    scheduler side                          worker side
    on_new_request(request)   -> book.admit
    build_connector_meta(out) -> StepPlan   bind_connector_metadata(plan)  -> adapter.bind
    (book.plan: rows, frees of reused       the model is called            -> the adapter's pre-hook
    blocks and preempted requests)          forward (attention writes K/V)    reads its inputs: HEAD
                                            wait_for_save()                -> adapter.after_forward
    request_finished_all_groups(request)
                              -> book.finished (before vLLM frees its blocks, every KV cache group)
    reset_cache()             -> book.reset  (LLM.reset_prefix_cache(reset_connector=True))

At start-up the worker side's register_kv_caches hands over the KV tensors. vLLM keeps one worker
connector per process (its first engine's): with several engines in one process, worker calls
dispatch on the plan's key, and register_kv_caches goes to the adapter whose LLM is being built.
The adapter needs scheduler and worker in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0).

It declares hybrid support (`SupportsHMA`), so vLLM keeps its hybrid KV cache manager for models
with sliding-window layers (a KV cache group per attention kind, each with its own block table)
instead of turning it off; bind_kv_cache_manager hands the book vLLM's KV cache manager, whose
sliding-window managers' drops the book hooks (blocks.py). vLLM before 0.30 does not call it: the
engine adapter binds the manager itself once the LLM is built (versions.py).

The connector loads nothing and saves nothing; it never changes what vLLM schedules or computes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA,
)

from .blocks import BlockBook, RowPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CONFIG_KEY = "kvcanary_engine"  # in kv_connector_extra_config: the adapter's registry key


class Guarded(Protocol):
    """What the connector needs from the engine adapter."""

    book: BlockBook

    def attach_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None: ...

    def bind(self, rows: list[RowPlan]) -> None: ...

    def after_forward(self) -> None: ...


class Registry:
    """Adapters by key, and the one whose LLM is being built (register_kv_caches goes there)."""

    def __init__(self) -> None:
        self._adapters: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self.building: Guarded | None = None

    def add(self, key: str, adapter: Guarded) -> None:
        self._adapters[key] = adapter

    def discard(self, key: str) -> None:
        """Drop the adapter under `key` (it was closed), if it is still there."""
        self._adapters.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._adapters

    def __getitem__(self, key: str) -> Guarded:
        return self._adapters[key]


registry = Registry()


@dataclass
class StepPlan(KVConnectorMetadata):
    """What the scheduler side hands the worker side for one step."""

    engine: str
    rows: list[RowPlan]


class CanaryConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._key = vllm_config.kv_transfer_config.kv_connector_extra_config[CONFIG_KEY]

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: preemption stays as without a connector

    # Worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert registry.building is not None, "KV caches registered outside the canary adapter's LLM start-up"
        registry.building.attach_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        plan = connector_metadata
        assert isinstance(plan, StepPlan)
        if plan.rows:
            registry[plan.engine].bind(plan.rows)

    def wait_for_save(self) -> None:
        plan = self._connector_metadata
        if isinstance(plan, StepPlan) and plan.rows:
            registry[plan.engine].after_forward()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    # Scheduler side --------------------------------------------------------------------------

    @property
    def _book(self) -> BlockBook:
        return registry[self._key].book

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._book.bind(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self._book.admit(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self._book.matched(num_computed_tokens)  # the local prefix cache's hit: the soak's liveness count
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        return StepPlan(self._key, self._book.plan(scheduler_output))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._book.finished(request, block_ids)
        return False, None

    def reset_cache(self) -> bool:
        self._book.reset()
        return True
