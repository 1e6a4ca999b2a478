"""A small seeded KV world for kernel tests: pool, sources, requests, entry plans, and a runner that
checks every kernel launch against its torch reference bit for bit.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set by
the repository's top-level conftest before triton is imported); with one, on CUDA tensors.
Random values come from a CPU generator and move to DEVICE.
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import pytest
import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import PREV_CHAIN_HEAD, PREV_SKIP, UNKNOWN

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DEVICE = torch.device(
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)


class SourceSpec(NamedTuple):
    """One KV layer: dtype, slots per page, elements per slot, read mode, extra elements per row."""

    dtype: torch.dtype
    page_size: int
    elems: int
    mode: str = "all"
    row_pad: int = 0


@dataclass
class Request:
    """A request row: its tokens and req_to_token slots (slots[p] holds position p)."""

    row: int
    tokens: list[int]
    slots: list[int]


def clone_ring(ring: K.ViolationRing) -> K.ViolationRing:
    copy = K.ViolationRing(ring.capacity, ring.device)
    for name in ("rows", "count", "step", "kernel_runs", "slot_runs"):
        getattr(copy, name).copy_(getattr(ring, name))
    return copy


def sorted_rows(ring: K.ViolationRing, start: int = 0) -> list[tuple[int, ...]]:
    return sorted(tuple(r) for r in ring.read(start, ring.total()).tolist())


def random_bits(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns viewed as ``dtype`` (NaNs included: the fingerprint hashes bits)."""
    size = torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(-(2**62), 2**62, shape, generator=gen, dtype=torch.int64)
    return bits.to(_INT_VIEW[size]).view(dtype)


@dataclass
class World:
    gen: torch.Generator
    records: torch.Tensor
    sources: list[K.RealKvSource]
    ring: K.ViolationRing
    free: list[int]
    requests: list[Request] = field(default_factory=list)
    tiling: K.Tiling | None = None  # kernel launches only; None: the default

    @property
    def num_slots(self) -> int:
        return self.records.shape[0]

    @property
    def device(self) -> torch.device:
        return self.records.device

    def randint(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=self.gen))

    def alloc(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "pool exhausted"
        return taken

    def add_request(self, length: int, prefix: Request | None = None, prefix_len: int = 0) -> Request:
        """A new request row whose first prefix_len positions share ``prefix``'s slots and tokens."""
        shared_tokens = prefix.tokens[:prefix_len] if prefix else []
        shared_slots = prefix.slots[:prefix_len] if prefix else []
        new = length - len(shared_tokens)
        tokens = shared_tokens + torch.randint(0, 50_000, (new,), generator=self.gen).tolist()
        req = Request(len(self.requests), tokens, shared_slots + self.alloc(new))
        self.requests.append(req)
        return req

    def kv_bytes(self, source: int, slot: int) -> torch.Tensor:
        """A uint8 view of ``slot``'s bytes in sources[source] (writes go to the layer)."""
        src = self.sources[source]
        page, off = divmod(slot, src.page_size)
        return src.words()[page].view(torch.uint8)[off * src.num_bytes_per_token :][: src.num_bytes_per_token]

    def fill_kv(self, slots: list[int]) -> None:
        """The forward writes fresh KV bytes into ``slots`` (every source, whole slot)."""
        for i in range(len(self.sources)):
            for s in slots:
                kv = self.kv_bytes(i, s)
                kv.copy_(torch.randint(0, 256, kv.shape, generator=self.gen, dtype=torch.uint8))

    def write_entries(self, spans: list[tuple[Request, int, int]], pad: int = 0) -> K.WriteEntries:
        """TAIL entries stamping positions [start, stop) of each request, then ``pad`` slot-0 entries."""
        cols: dict[str, list[int]] = {k: [] for k in ("slots", "tokens", "positions", "rows")}
        seg_starts, seg_lens, seeds = [], [], []
        for req, start, stop in spans:
            seg_starts.append(len(cols["slots"]))
            seg_lens.append(stop - start)
            seeds.append(PREV_CHAIN_HEAD if start == 0 else req.slots[start - 1])
            for p in range(start, stop):
                cols["slots"].append(req.slots[p])
                cols["tokens"].append(req.tokens[p])
                cols["positions"].append(p)
                cols["rows"].append(req.row)
        for values in cols.values():
            values.extend([0] * pad)
        t = {k: _i64(v) for k, v in cols.items()}
        return K.WriteEntries(
            slots=t["slots"], tokens=t["tokens"], positions=t["positions"],
            expected_positions=t["positions"].clone(), expected_tokens=t["tokens"].clone(), rows=t["rows"],
            seg_starts=_i64(seg_starts), seg_lens=_i64(seg_lens), seed_slots=_i64(seeds),
        )

    def verify_entries(self, spans: list[tuple[Request, int, int]], known_tokens: bool = True,
                       pad: int = 0) -> K.VerifyEntries:
        """HEAD entries for positions [start, stop) of each request (start > 0: a window start)."""
        slots, positions, prevs, tokens, rows = [], [], [], [], []
        for req, start, stop in spans:
            for p in range(start, stop):
                slots.append(req.slots[p])
                positions.append(p)
                prevs.append(PREV_CHAIN_HEAD if p == 0 else PREV_SKIP if p == start else req.slots[p - 1])
                tokens.append(req.tokens[p] if known_tokens else UNKNOWN)
                rows.append(req.row)
        for values in (slots, positions, prevs, tokens, rows):
            values.extend([0] * pad)
        return K.VerifyEntries(_i64(slots), _i64(positions), _i64(prevs), _i64(tokens), _i64(rows))

    def stamp(self, entries: K.WriteEntries, tag: int = 0, **kw) -> list[tuple[int, ...]]:
        return self.launch(K.stamp_records, K.stamp_records_ref, entries, tag, **kw)

    def verify(self, entries: K.VerifyEntries, tag: int = 0, **kw) -> list[tuple[int, ...]]:
        return self.launch(K.verify_records, K.verify_records_ref, entries, tag, **kw)

    def launch(self, kernel: Callable, reference: Callable, entries, tag: int, **kw) -> list[tuple[int, ...]]:
        """Runs the kernel and its reference on copies of the state, asserts they agree bit for bit,
        keeps the kernel's state and returns the launch's new ring rows (sorted)."""
        start = self.ring.total()
        ref_records, ref_ring = self.records.clone(), clone_ring(self.ring)
        reference(ref_records, entries, self.sources, ref_ring, tag, **kw)
        kernel(self.records, entries, self.sources, self.ring, tag, tiling=self.tiling, **kw)
        assert torch.equal(self.records, ref_records)
        for name in ("count", "step", "kernel_runs", "slot_runs"):
            assert torch.equal(getattr(self.ring, name), getattr(ref_ring, name)), name
        assert sorted_rows(self.ring, start) == sorted_rows(ref_ring, start)
        return sorted_rows(self.ring, start)


def _i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def make_world(seed: int, specs: tuple[tuple, ...] = ((torch.bfloat16, 1, 64),),
               num_slots: int = 256, ring_capacity: int = 256) -> World:
    """A pool of num_slots slots (slot 0 reserved) with one layer per SourceSpec-shaped tuple;
    records start as noise."""
    gen = torch.Generator().manual_seed(seed)
    sources = []
    for spec in (SourceSpec(*s) for s in specs):
        assert num_slots % spec.page_size == 0
        width = spec.page_size * spec.elems
        backing = random_bits(gen, (num_slots // spec.page_size, width + spec.row_pad), spec.dtype).to(DEVICE)
        src = K.layer_source(backing[:, :width], spec.page_size, spec.mode)
        if src is not None:
            sources.append(src)
    records = torch.randint(-(2**62), 2**62, (num_slots, 4), generator=gen, dtype=torch.int64).to(DEVICE)
    free = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    return World(gen, records, sources, K.ViolationRing(ring_capacity, DEVICE), free)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def world_factory() -> Callable[..., World]:
    return make_world


@pytest.fixture
def world() -> World:
    return make_world(seed=1234)
