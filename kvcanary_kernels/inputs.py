"""What the kernels take, declared once: the seam (canary/seam_data.py) hands these very types to
an engine author, and the kernels read them as they are.

``SlotMapping`` and ``ForwardView`` describe a forward the way the engine holds it (its mapping
table and its batch); the view kernels walk the positions themselves. ``VerifyEntries`` is an
explicit list of slots, for the sweep over what a prefix cache holds. ``RealDataMode`` says how
much of a slot's bytes the fingerprint reads.

Importing this module imports neither torch nor triton (the tensor types are annotations), so a
conftest can import the seam at module level. Each type checks what it holds by itself when it is
made; a launch checks only how its inputs fit one another (devices, lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Mapping, NamedTuple

from .checks import check_int
from .records import GroupKind

if TYPE_CHECKING:
    import torch


class RealDataMode(str, Enum):
    """How much of a slot's real KV bytes the fingerprint covers (the configuration's real_data)."""

    NONE = "none"
    PARTIAL = "partial"
    ALL = "all"


@dataclass(frozen=True)
class SlotMapping:
    """Where a group finds the slot of (row, position).

    ``lp = position % ring if ring else position``;
    ``slot = table[row, lp // page_size] * page_size + lp % page_size``; then, when full_to_group is
    given, ``slot = full_to_group[slot]`` (a pool indexed through FULL-pool slots; 0 = not resident).
    A table entry 0 means not resident: block 0 of a block table is the null block, as slot 0 of a
    per-token table is the reserved slot. A table column or full_to_group index out of range reads
    as slot 0 too. The formula is written twice, once per side of the device boundary, and the two
    mirror each other: ``lookup.map_slot`` (Triton) and ``reference.map_slot_ref`` (torch).

    page_size 1: a per-token table (``req_to_token``, SGLang's layout); > 1: a block table of
    block ids (vLLM, transformers). ring > 0: a ring-buffer window allocator whose table indexes
    positions modulo ring. table: int32 or int64 ``[rows, cols]`` on the engine's device;
    full_to_group: int64 ``[n_full_slots]``. The kernels read them at every forward: refill them in
    place, the object stays the same for the engine's life.
    """

    table: torch.Tensor
    page_size: int = 1
    ring: int = 0
    full_to_group: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return "token_table" if self.page_size == 1 else "block_table"

    def __post_init__(self) -> None:
        import torch  # a SlotMapping holds tensors: torch is loaded by now

        table = self.table
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            raise ValueError(f"SlotMapping.table must be a 2-D tensor [rows, cols]; got {_desc(table)}")
        if table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"SlotMapping.table must be int32 or int64; got {table.dtype}")
        check_int("SlotMapping.page_size", self.page_size, 1)
        check_int("SlotMapping.ring", self.ring, 0)
        f2g = self.full_to_group
        if f2g is not None:
            if not isinstance(f2g, torch.Tensor) or f2g.dtype != torch.int64:
                raise ValueError(f"SlotMapping.full_to_group must be int64; got {_desc(f2g)}")
            if f2g.dim() != 1 or not f2g.is_contiguous():
                raise ValueError(f"SlotMapping.full_to_group must be 1-D and contiguous; got {_desc(f2g)}")


class GroupInputs(NamedTuple):
    """What the model that writes one pool group consumed, when that is not the model the view's
    own input_ids / positions fed (a draft model filling its pool in the same forward as the
    target): per token, in view order, the token ids it embedded and the positions its RoPE used.
    int64 [T] on the engine's device, like the view's."""

    input_ids: torch.Tensor
    positions: torch.Tensor


class StateInputs(NamedTuple):
    """A forward's recurrent-state slots (a hybrid model's STATE group), per batch row: int64 [B]
    on the engine's device, the very tensors the forward's state layers consume for their reads and
    writes. slots: the slot whose state the row's forward starts from (the state after the row's
    prefix_len tokens) and writes back (after prefix_len + extend_len); 0 in a padded row.
    checkpoint_slots: slots the forward also writes with the row's state after checkpoint_lens
    tokens (prefix_len < checkpoint_len <= prefix_len + extend_len; 0: none): [B], one a row (a
    prefill's checkpoint, which the prefix cache then owns), or [B, m], m a row (a speculative
    decode's state after each proposal, to roll back to); checkpoint_lens has their shape."""

    slots: torch.Tensor
    checkpoint_slots: torch.Tensor
    checkpoint_lens: torch.Tensor


class ScaleInputs(NamedTuple):
    """The dequantization scales a forward over a quantized KV pool uses (the SCALES group): float32
    ``[num_layers, W]`` on the engine's device, row i the scales layer i's attention multiplies its
    stored K (k) and V (v) by, per KV head (W = num_kv_heads) or per tensor (W = 1); v is None for
    a latent pool (one half). The very tensors the forward's attention reads: HEAD checks each
    row against the layer's guarded scales before the forward reads KV."""

    k: torch.Tensor
    v: torch.Tensor | None


class SelectedInputs(NamedTuple):
    """The tokens a sparse attention layer's indexer selected for each query token: int64 ``[T,
    topk]`` on the engine's device, row t for view token t (its batch row and position as the view
    gives them), refilled in place by each sparse layer of the forward. positions: the selected
    positions of the query's sequence (-1: unused, where the query sees fewer than topk tokens);
    slots: the FULL slots the attention reads for them, the very tensor it gathers its KV through.
    The SELECT check (after each layer's selection, before its attention reads) requires of every
    used entry ``0 <= position <= the query's position`` and ``slot == mapping(row, position)``."""

    positions: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class ForwardView:
    """One forward as the canary sees it: int64 tensors on the engine's device, fixed shapes.

    Per batch row (length B <= max_batch): rows (the mapping row of the request), prefix_lens
    (positions already cached, which the forward reads), extend_lens (positions it writes:
    [prefix_len, prefix_len + extend_len); 1 in decode). A padded row has prefix_len 0 and
    extend_len 0 (its row value is ignored).
    Per token (length T <= max_tokens; row-major in batch order: batch row b's tokens are
    [start_b, start_b + extend_lens[b]), start_b = sum(extend_lens[:b]); entries past
    sum(extend_lens) are padding): input_ids, positions: the very tensors the forward consumed (its
    embedding's token ids, its RoPE positions; or device copies made from them), never a second
    copy rebuilt from the engine's bookkeeping, so that TAIL's write-input checks compare what the
    forward used with what the bookkeeping says: write_position compares positions[t] with
    prefix_len + j, the position whose slot the forward wrote; write_token compares input_ids[t]
    with token_table.
    Optional: token_table ``[rows, max_context]``, the token the engine believes each (row,
    position) holds (-1 unknown; enables verify_token at HEAD and write_token at TAIL);
    context_keys [B], a per-request context (LoRA adapter, cache salt, image hash; 0 = none) that
    seeds each chain's anchor, so KV reused across contexts fails at position 0; group_inputs: for
    a pool group written by another model than the one input_ids / positions fed (a draft model's
    pool), what that model consumed: TAIL stamps and checks that group from it (the kernels read
    input_ids / positions only: the runtime hands them the group's view, ``for_group``); state: a
    hybrid model's state slots (`StateInputs`); scales: the dequantization scales of a quantized
    pool the forward reads its KV through (`ScaleInputs`; an engine with a SCALES group); selected:
    the tokens a sparse attention's indexer selected for each query token (`SelectedInputs`; an
    engine with an INDEXER group), filled inside the forward.

    The slots a forward writes are mapping(row, prefix_len + j): they must be in the mapping
    before before_forward.
    """

    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    token_table: torch.Tensor | None = None
    context_keys: torch.Tensor | None = None
    group_inputs: Mapping[GroupKind, GroupInputs] | None = None
    state: StateInputs | None = None
    scales: ScaleInputs | None = None
    selected: SelectedInputs | None = None

    def for_group(self, kind: GroupKind) -> ForwardView:
        """The view as the kernels read it for one group: fed by what that group's writer consumed
        where group_inputs names it, else this view."""
        own = None if self.group_inputs is None else self.group_inputs.get(kind)
        if own is None:
            return self
        return ForwardView(self.rows, self.prefix_lens, self.extend_lens, own.input_ids, own.positions,
                           self.token_table, self.context_keys, state=self.state,
                           scales=self.scales, selected=self.selected)


class VerifyEntries(NamedTuple):
    """SWEEP: slots to check (length M), int64 [M] each. Entries whose slot is 0 are skipped (slot
    0 is reserved), so a caller may pad them to a fixed length.

    prev_slots: the slot holding the previous position (its record gives the expected prev_hash),
    PREV_CHAIN_HEAD = -1 for position 0, PREV_SKIP = -2 to skip the chain check.
    tokens: the expected token, or UNKNOWN = -1. rows: request row, or -1 (sweep).
    context_keys: the context key that seeds a chain head's expected prev_hash (0 = none).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    prev_slots: torch.Tensor
    tokens: torch.Tensor
    rows: torch.Tensor
    context_keys: torch.Tensor


def _desc(t: object) -> str:
    shape = getattr(t, "shape", None)
    if shape is not None and hasattr(t, "dtype"):
        return f"{t.dtype} tensor of shape {tuple(shape)}"
    return type(t).__name__
