"""A small seeded KV world for kernel tests: a pool with sources and records, an engine-style
mapping table (per-token, block, ring, or through full_to_group), requests that grow forward by
forward, views of those forwards, and a runner that checks every kernel launch against its torch
reference bit for bit.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set by
the repository's top-level conftest before triton is imported); with one, on CUDA tensors.
Random values come from a CPU generator and move to DEVICE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

import kvcanary_kernels as K
from kvcanary_kernels.records import FIELD_REAL_KV_HASH, UNKNOWN

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DEVICE = torch.device(
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
Row = tuple[int, ...]


class SourceSpec(NamedTuple):
    """One KV layer: dtype, slots per page, elements per slot, read mode, extra elements per row,
    KV heads per slot, the layer's share of the sampled layers (``layer_source``'s share),
    whether a page is feature-major (element f of every slot together; one head), and for such a
    page, slots per tile (0: one tile; vLLM's AMX K packs 16, its V 2) and features per packed run
    (AMX K keeps dimension pairs together)."""

    dtype: torch.dtype
    page_size: int
    elems: int
    mode: str = "all"
    row_pad: int = 0
    heads: int = 1
    share: tuple[int, int] = (0, 1)
    feature_major: bool = False
    tile: int = 0
    run: int = 1


class MappingKind(NamedTuple):
    """How the engine maps (row, position) to a slot: page size (> 1: a block table whose block 0
    is reserved), ring (> 0: columns reused modulo ring), full_to_group (the table holds slots of
    a larger FULL space, mapped into this pool), and the table's dtype."""

    page_size: int = 1
    ring: int = 0
    full_to_group: bool = False
    int32: bool = False


MAPPINGS = {
    "token": MappingKind(),
    "block4": MappingKind(page_size=4, int32=True),
    "block16": MappingKind(page_size=16),
    "ring": MappingKind(ring=16, int32=True),
    "ring-block4": MappingKind(page_size=4, ring=16),
    "full_to_group": MappingKind(full_to_group=True),
}


@dataclass
class Request:
    """A request row: its tokens (the first ``cached`` are stamped) and context key."""

    row: int
    tokens: list[int]
    context_key: int = 0
    cached: int = 0


class Forward(NamedTuple):
    """One forward: the kernels' view and, per batch entry, (request, prefix, extend)."""

    view: K.ForwardView
    batch: list[tuple[Request, int, int]]


def random_bits(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns viewed as ``dtype`` (NaNs included: the fingerprint hashes bits)."""
    size = torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(-(2**62), 2**62, shape, generator=gen, dtype=torch.int64)
    return bits.to(_INT_VIEW[size]).view(dtype)


def clone_ring(ring: K.ViolationRing) -> K.ViolationRing:
    copy = K.ViolationRing(ring.capacity, ring.device)
    for name in ("rows", "count", "step", "kernel_runs", "slot_runs"):
        getattr(copy, name).copy_(getattr(ring, name))
    return copy


def new_rows(ring: K.ViolationRing, start: int) -> list[Row]:
    """The rows claimed since count was ``start`` (all still in the ring), sorted."""
    claimed = int(ring.count) - start
    assert claimed <= ring.capacity, "the launch claimed more rows than the ring holds"
    index = (start + torch.arange(claimed)) % ring.capacity
    return sorted(tuple(r) for r in ring.rows.cpu()[index].tolist())


def i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


@dataclass
class World:
    gen: torch.Generator
    kind: MappingKind
    records: torch.Tensor
    sources: list[K.RealKvSource]
    ring: K.ViolationRing
    table: torch.Tensor  # [max_rows, cols]
    full_to_group: torch.Tensor | None
    token_table: torch.Tensor  # [max_rows, max_context], UNKNOWN where not written
    free: list[int]  # free blocks (slots when page_size is 1) of the pool
    free_full: list[int]  # free slots of the FULL space (full_to_group only)
    max_context: int
    requests: list[Request] = field(default_factory=list)
    tiling: K.Tiling | None = None  # kernel launches only; None: the default
    read_hashes: torch.Tensor | None = None  # verify launches' read-hash buffer (None: not used)

    @property
    def device(self) -> torch.device:
        return self.records.device

    @property
    def mapping(self) -> K.SlotMapping:
        return K.SlotMapping(self.table, self.kind.page_size, self.kind.ring, self.full_to_group)

    def randint(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=self.gen))

    def random_tokens(self, n: int) -> list[int]:
        return torch.randint(0, 50_000, (n,), generator=self.gen).tolist()

    # ---- requests and their mapping --------------------------------------------------------

    def add_request(self, length: int, prefix: Request | None = None, shared: int = 0,
                    context_key: int = 0) -> Request:
        """A new row of ``length`` tokens whose first ``shared`` positions reuse ``prefix``'s
        slots (prefix caching: a whole number of blocks)."""
        row = len(self.requests)
        assert row < self.table.shape[0], "no free request row"
        tokens = (prefix.tokens[:shared] if prefix else []) + self.random_tokens(length - shared)
        req = Request(row, tokens, context_key, cached=shared)
        if shared:
            assert prefix is not None and shared <= prefix.cached and shared % self.kind.page_size == 0
            cols = shared // self.kind.page_size
            self.table[row, :cols] = self.table[prefix.row, :cols]
            self.token_table[row, :shared] = self.token_table[prefix.row, :shared]
        self.requests.append(req)
        return req

    def slot(self, req: Request, pos: int) -> int:
        """The slot the mapping gives (req, pos), as the kernels compute it."""
        page, ring = self.kind.page_size, self.kind.ring
        lp = pos % ring if ring else pos
        slot = int(self.table[req.row, lp // page]) * page + lp % page
        return int(self.full_to_group[slot]) if self.full_to_group is not None else slot

    def slots(self, req: Request, start: int = 0, stop: int | None = None) -> list[int]:
        return [self.slot(req, p) for p in range(start, len(req.tokens) if stop is None else stop)]

    def map_positions(self, req: Request, start: int, stop: int) -> None:
        """Gives positions [start, stop) a slot (a ring reuses its columns' slots)."""
        page, ring = self.kind.page_size, self.kind.ring
        for pos in range(start, stop):
            lp = pos % ring if ring else pos
            col = lp // page
            if int(self.table[req.row, col]) != 0:
                continue
            if self.full_to_group is None:
                self.table[req.row, col] = self._take(self.free)
            else:
                full = self._take(self.free_full)
                self.table[req.row, col] = full
                self.full_to_group[full] = self._take(self.free)

    @staticmethod
    def _take(free: list[int]) -> int:
        assert free, "pool exhausted"
        return free.pop()

    # ---- KV bytes --------------------------------------------------------------------------

    def kv_bytes(self, source: int, slot: int) -> torch.Tensor:
        """A uint8 view of ``slot``'s bytes in sources[source] (writes go to the layer): ``[bytes]``,
        or ``[features, element bytes]`` for a feature-major page."""
        src = self.sources[source]
        page, off = divmod(slot, src.page_size)
        if src.elementwise:  # every sample of the slot's features, a row each
            row = src.row_bytes()[page]
            return row.as_strided((src.num_bytes_per_token // src.sample_bytes, src.sample_bytes),
                                  (src.sample_stride, 1), row.storage_offset() + src.slot_offset(off))
        return src.tensor[page].reshape(-1).view(torch.uint8)[off * src.num_bytes_per_token :][: src.num_bytes_per_token]

    def flip_kv_bit(self, source: int, slot: int) -> None:
        """Flip a random bit of a random byte of ``slot`` in sources[source]."""
        kv = self.kv_bytes(source, slot)
        byte = self.randint(0, kv.numel())
        kv[divmod(byte, kv.shape[1]) if kv.dim() == 2 else byte] ^= 1 << self.randint(0, 8)

    def fill_kv(self, slots: list[int]) -> None:
        """The forward writes fresh KV bytes into ``slots`` (every source, whole slot)."""
        for i in range(len(self.sources)):
            for s in slots:
                kv = self.kv_bytes(i, s)
                kv.copy_(torch.randint(0, 256, kv.shape, generator=self.gen, dtype=torch.uint8))

    def fingerprints(self, slots: list[int]) -> torch.Tensor:
        return K.fingerprint_ref(self.sources, i64(slots))

    def source_hashes(self, slots: list[int]) -> torch.Tensor:
        """``[sources, len(slots)]``: each source's hash of each slot (what source_hash_rows
        computes for rows holding those slots' bytes)."""
        return torch.stack([K.source_hash_ref(s, i64(slots)) for s in self.sources])

    # ---- forwards --------------------------------------------------------------------------

    def forward(self, batch: list[tuple[Request, int]], pad_rows: int = 0, pad_tokens: int = 0,
                known_tokens: bool = True, context: bool = True) -> Forward:
        """A forward extending each (request, extend) from its cached length: maps the new
        positions (the engine does this before the forward), appends padding batch rows
        (prefix 0, extend 0) and padding tokens. The token table is the engine's belief."""
        entries = []
        input_ids: list[int] = []
        positions: list[int] = []
        for req, extend in batch:
            prefix = req.cached
            assert prefix + extend <= len(req.tokens)
            self.map_positions(req, prefix, prefix + extend)
            entries.append((req, prefix, extend))
            input_ids += req.tokens[prefix : prefix + extend]
            positions += range(prefix, prefix + extend)
        pad_row_ids = [self.randint(0, self.table.shape[0]) for _ in range(pad_rows)]
        view = K.ForwardView(
            rows=i64([r.row for r, _, _ in entries] + pad_row_ids),
            prefix_lens=i64([p for _, p, _ in entries] + [0] * pad_rows),
            extend_lens=i64([e for _, _, e in entries] + [0] * pad_rows),
            input_ids=i64(input_ids + self.random_tokens(pad_tokens)),
            positions=i64(positions + [self.randint(0, 100) for _ in range(pad_tokens)]),
            token_table=self.token_table if known_tokens else None,
            context_keys=i64([r.context_key for r, _, _ in entries] + [0] * pad_rows) if context else None,
        )
        return Forward(view, entries)

    def write(self, fwd: Forward) -> list[int]:
        """The forward writes its new positions' KV and the engine records their tokens; returns
        the written slots in token order."""
        written = []
        for req, prefix, extend in fwd.batch:
            written += self.slots(req, prefix, prefix + extend)
            self.token_table[req.row, prefix : prefix + extend] = i64(req.tokens[prefix : prefix + extend])
        self.fill_kv(written)
        return written

    def commit(self, fwd: Forward) -> None:
        for req, prefix, extend in fwd.batch:
            req.cached = prefix + extend

    def step(self, batch: list[tuple[Request, int]], window: int = 0, **kw) -> list[Row]:
        """HEAD, write, TAIL, RECHECK and commit of one forward; returns every new ring row."""
        fwd = self.forward(batch, **kw)
        rows = self.verify(fwd.view, window=window)
        self.write(fwd)
        rows += self.stamp(fwd.view)
        rows += self.verify(fwd.view, window=window, after_forward=True)
        self.commit(fwd)
        self.ring.advance_step()
        return rows

    def head_view(self, reqs: list[Request], **kw) -> K.ForwardView:
        """The view of a forward that reads every cached position of ``reqs`` and writes none."""
        return self.forward([(r, 0) for r in reqs], **kw).view

    # ---- launches --------------------------------------------------------------------------

    def use_read_hashes(self) -> None:
        """Verify launches from now on keep the last source's hashes before a forward and
        compare with them after it (verify_view's read_hashes)."""
        self.read_hashes = torch.randint(-(2**62), 2**62, (self.records.shape[0],), generator=self.gen,
                                         dtype=torch.int64).to(self.device)

    def verify(self, view: K.ForwardView, tag: int = 0, window: int = 0, check_tokens: bool = True,
               sentinel: bool = False, after_forward: bool = False, missing_at_zero: bool = True) -> list[Row]:
        return self.launch(K.verify_view, K.verify_view_ref, self.sources, self.mapping, view, self.ring, tag,
                           window=window, max_context=self.max_context, check_tokens=check_tokens,
                           sentinel=sentinel, after_forward=after_forward, read_hashes=self.read_hashes,
                           missing_at_zero=missing_at_zero)

    def stamp(self, view: K.ForwardView, tag: int = 1, check_tokens: bool = True, check_write_inputs: bool = True,
              written_source_hashes: torch.Tensor | None = None) -> list[Row]:
        return self.launch(K.stamp_view, K.stamp_view_ref, self.sources, self.mapping, view, self.ring, tag,
                           check_tokens=check_tokens, check_write_inputs=check_write_inputs,
                           written_source_hashes=written_source_hashes)

    def sweep(self, entries: K.VerifyEntries, tag: int = 4, check_tokens: bool = True) -> list[Row]:
        return self.launch(K.verify_records, K.verify_records_ref, entries, self.sources, self.ring, tag,
                           check_tokens=check_tokens)

    def launch(self, kernel: Callable, reference: Callable, *args, **kw) -> list[Row]:
        """Runs the kernel and its reference on copies of the state (records, ring, read_hashes),
        asserts they agree bit for bit, keeps the kernel's state and
        returns the launch's new ring rows (sorted)."""
        start = int(self.ring.count)
        ref_records, ref_ring = self.records.clone(), clone_ring(self.ring)
        ref_args = [ref_ring if a is self.ring else a for a in args]
        ref_kw = {k: v.clone() if k == "read_hashes" and v is not None else v for k, v in kw.items()}
        reference(ref_records, *ref_args, **ref_kw)
        kernel(self.records, *args, tiling=self.tiling, **kw)
        assert torch.equal(self.records, ref_records)
        if kw.get("read_hashes") is not None:
            assert torch.equal(kw["read_hashes"], ref_kw["read_hashes"]), "read_hashes differ"
        for name in ("count", "step", "kernel_runs", "slot_runs"):
            assert torch.equal(getattr(self.ring, name), getattr(ref_ring, name)), name
        rows = new_rows(self.ring, start)
        assert rows == new_rows(ref_ring, start)
        return rows


def make_world(seed: int, mapping: str | MappingKind = "token",
               specs: tuple[tuple, ...] = ((torch.bfloat16, 1, 64),), num_slots: int = 256,
               max_rows: int = 8, max_context: int = 64, ring_capacity: int = 256) -> World:
    """A pool of num_slots slots (slot 0 reserved; with pages, block 0) with one layer per
    SourceSpec-shaped tuple; records start as noise, except slot 0's fingerprint, which the
    runtime records when it attaches."""
    kind = MAPPINGS[mapping] if isinstance(mapping, str) else mapping
    gen = torch.Generator().manual_seed(seed)
    sources = []
    for spec in (SourceSpec(*s) for s in specs):
        assert num_slots % spec.page_size == 0
        width = spec.page_size * spec.elems
        backing = random_bits(gen, (num_slots // spec.page_size, width + spec.row_pad), spec.dtype).to(DEVICE)
        if spec.feature_major and spec.tile:  # [tiles][features / run][tile][run] per page
            t, r = spec.tile, spec.run
            layer = backing[:, :width].view(backing.shape[0], spec.page_size // t, spec.elems // r, t, r)
            layer = layer.permute(0, 1, 3, 2, 4)
        elif spec.feature_major:
            layer = backing[:, :width].view(backing.shape[0], spec.elems, spec.page_size).transpose(1, 2)
        else:
            layer = backing[:, :width].view(backing.shape[0], spec.page_size, spec.heads, -1)
        src = K.layer_source(layer, spec.page_size, spec.mode, share=spec.share)
        if src is not None:
            sources.append(src)
    records = torch.randint(-(2**62), 2**62, (num_slots, 4), generator=gen, dtype=torch.int64).to(DEVICE)
    records[0, FIELD_REAL_KV_HASH] = K.fingerprint_ref(sources, i64([0]))[0]
    cols = (kind.ring or max_context) // kind.page_size
    table = torch.zeros(max_rows, cols, dtype=torch.int32 if kind.int32 else torch.int64, device=DEVICE)
    free = (torch.randperm(num_slots // kind.page_size - 1, generator=gen) + 1).tolist()
    full_to_group, free_full = None, []
    if kind.full_to_group:
        n_full = 2 * num_slots
        full_to_group = torch.zeros(n_full, dtype=torch.int64, device=DEVICE)
        free_full = (torch.randperm(n_full - 1, generator=gen) + 1).tolist()
    token_table = torch.full((max_rows, max_context), UNKNOWN, dtype=torch.int64, device=DEVICE)
    return World(gen, kind, records, sources, K.ViolationRing(ring_capacity, DEVICE), table, full_to_group,
                 token_table, free, free_full, max_context)
