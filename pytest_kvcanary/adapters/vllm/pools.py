"""The canary's pool groups over the KV caches vLLM registered: a FULL group over the full-attention
layers and, for a model with sliding-window layers, an SWA group over those (mapped through the
WindowMap, window_map.py), one buffer per (layer, KV head), each half's byte order found at start-up
(layout.py); slot = ``block * block_size + offset``. Each layer's cache write is wrapped for
write-through on the way (write_through.py)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from pytest_kvcanary.canary.seam import GroupKind, Half, PoolGroup, SlotMapping

from .fp8 import quantized
from .fp8_cache import probe_write, stored_rows
from .layout import PagedLayout, half_views, probe, probe_latent, probe_paged
from .platform import CUDA_BACKENDS
from .versions import layer_isa
from .window_map import WindowMap
from .write_through import WriteThrough


class Pools(NamedTuple):
    groups: list[PoolGroup]
    window: WindowMap  # the SWA group's slot map (the identity without vLLM's hybrid manager)
    layout: PagedLayout | None  # the CUDA cache layout found, None on CPU


def pool_groups(layers: dict[str, Any], kv_caches: dict[str, torch.Tensor], table: torch.Tensor, block_size: int,
                num_blocks: int, hybrid: bool, write_through: WriteThrough) -> Pools:
    """The pool groups of these KV caches (`layers`: vLLM's static forward context; `table`: the
    block table the adapter refills per forward; num_blocks: vLLM's KV cache manager's; hybrid:
    vLLM keeps the sliding-window layers' blocks in a KV cache group of their own)."""
    names = list(kv_caches)
    if not names:
        raise RuntimeError("vLLM registered no KV caches with the canary's connector")
    first, cache = layers[names[0]], kv_caches[names[0]]
    bs, device = block_size, table.device
    backend = first.attn_backend.get_name()
    if backend == "CPU_MLA":  # one latent row per token: a pool with a single half
        latent = [kv_caches[n].view(cache.shape[0], bs, cache.shape[-1]) for n in names]
        fingerprintable = probe_latent(first, latent[0])
        for i, name in enumerate(names):
            write_through.wrap_latent(layers[name], GroupKind.FULL, i)
        num_slots = cache.shape[0] * bs
        group = PoolGroup(GroupKind.FULL, latent, [], num_slots, SlotMapping(table, page_size=bs), page_size=bs,
                          fingerprintable=fingerprintable)
        return Pools([group], WindowMap(num_slots, bs, device, hybrid), None)
    if backend in CUDA_BACKENDS:
        return _paged_groups(layers, kv_caches, table, bs, num_blocks, hybrid, write_through)
    if backend != "CPU_ATTN":
        raise NotImplementedError(f"the vLLM adapter knows the KV layouts of vLLM's CPU_ATTN and CPU_MLA (CPU "
                                  f"build), {' and '.join(CUDA_BACKENDS)} (CUDA build) attention backends; "
                                  f"got {backend}")
    fp8 = quantized(first.kv_cache_dtype)  # one byte a value, in vLLM's own conversion (fp8_cache.py)
    orders = probe(first, cache, probe_write(first, first.impl.do_kv_cache_update, first.kv_cache_dtype) if fp8
                   else None)
    if None in orders.values():
        raise NotImplementedError(
            f"vLLM's CPU attention runs its {layer_isa(first)!r} path here, whose KV layout the adapter does not know "
            f"(orders found: {orders}); attention_isa='readable' (the default) runs a path it knows")
    num_slots = cache.shape[0] * bs
    window_map = WindowMap(num_slots, bs, device, hybrid)
    groups = []
    for kind, window in _kinds(layers, names):
        views = half_views([kv_caches[n] for n in names if layers[n].sliding_window == window], orders)
        opaque = frozenset(h for h, v in views.items() if not v.readable)
        groups.append(PoolGroup(
            kind, views[Half.K].views, views[Half.V].views, num_slots, _mapping(table, bs, window, window_map),
            page_size=bs, window=None if window is None else window - 1, fingerprintable=len(opaque) < len(views),
            opaque_halves=opaque))
        heads = cache.shape[1]
        named = [n for n in names if layers[n].sliding_window == window]
        parts = {half: len(v.views) // (len(named) * heads) for half, v in views.items()}  # views per head
        for i, name in enumerate(named):
            impl = layers[name].impl
            stored = stored_rows(layers[name], impl.do_kv_cache_update, orders, bs) if fp8 else None
            write_through.wrap(layers[name], kind, i * heads, parts, stored)
    return Pools(groups, window_map, None)


def _kinds(layers: dict[str, Any], names: list[str]) -> list[tuple[GroupKind, int | None]]:
    """(group kind, sliding window or None) of each pool group these layers make: FULL, then SWA
    for a model with a sliding window (one at most)."""
    windows = {layers[n].sliding_window for n in names} - {None}
    if len(windows) > 1:
        raise NotImplementedError(f"one sliding window per model; got {sorted(windows)}")
    return [(GroupKind.FULL, None)] + [(GroupKind.SWA, w) for w in windows]


def _mapping(table: torch.Tensor, block_size: int, window: int | None, window_map: WindowMap) -> SlotMapping:
    """The slot mapping of the FULL group (window None) or of the sliding-window one."""
    return SlotMapping(table, page_size=block_size, full_to_group=None if window is None else window_map.slots)


def _paged_groups(layers: dict[str, Any], kv_caches: dict[str, torch.Tensor], table: torch.Tensor, bs: int,
                  num_blocks: int, hybrid: bool, write_through: WriteThrough) -> Pools:
    """The pool groups of FLASH_ATTN / FLASHINFER layers (vLLM's CUDA build): the layout found
    through the first layer's cache write (layout.probe_paged), each layer's halves split into
    the views the fingerprint reads, write-through wrapped alike."""
    names = list(kv_caches)
    first = layers[names[0]]
    heads, head_size = first.num_kv_heads, first.head_size
    layout = probe_paged(first, kv_caches[names[0]], heads, head_size)
    sample = layout.features(kv_caches[names[0]], heads, head_size)[Half.K]
    if tuple(sample.shape[:2]) != (num_blocks, bs):
        raise NotImplementedError(f"vLLM's {first.attn_backend.get_name()} cache holds {sample.shape[0]} blocks of "
                                  f"{sample.shape[1]} slots; its KV cache manager {num_blocks} of {bs} (kernel "
                                  "blocks other than the manager's are not supported)")
    num_slots = num_blocks * bs
    window_map = WindowMap(num_slots, bs, table.device, hybrid)
    groups = []
    for kind, window in _kinds(layers, names):
        halves: dict[Half, list[torch.Tensor]] = {}
        unread: set[Half] = set()
        for name in (n for n in names if layers[n].sliding_window == window):
            views = layout.views(kv_caches[name], heads, head_size)
            write_through.wrap_paged(layers[name], kind, layout, {h: [p for p, _, _ in v] for h, v in views.items()},
                                     {h: len(halves.get(h, [])) for h in views})
            for half, split in views.items():
                halves.setdefault(half, []).extend(v for _, v, _ in split)
                unread |= {half} if not all(ok for _, _, ok in split) else set()
        groups.append(PoolGroup(
            kind, halves[Half.K], halves.get(Half.V, []), num_slots, _mapping(table, bs, window, window_map),
            page_size=bs, window=None if window is None else window - 1, fingerprintable=len(unread) < len(halves),
            opaque_halves=frozenset(unread)))
    return Pools(groups, window_map, layout)
