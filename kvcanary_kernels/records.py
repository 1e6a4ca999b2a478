"""Record layout, reason bits, launch tags and the violation-row layout shared by kernels and host.

A record is 4 x int64 per slot: token, position, prev_hash, real_kv_hash. Hashes are stored as the
int64 bit pattern of a uint64 splitmix64 value.
"""

from __future__ import annotations

from enum import IntEnum

RECORD_WIDTH = 4
FIELD_TOKEN = 0
FIELD_POSITION = 1
FIELD_PREV_HASH = 2
FIELD_REAL_KV_HASH = 3

# "KVCANARY" in ASCII: the value a chain head (position 0) hashes as its predecessor. A request
# with a context key c (LoRA adapter, cache salt; 0 = none) anchors its chain at mix(ANCHOR ^ c).
ANCHOR = 0x4B5643414E415259

# prev_slots entries in a verify plan that are not slots.
PREV_CHAIN_HEAD = -1  # position 0: expect prev_hash == mix(ANCHOR)
PREV_SKIP = -2  # window start whose predecessor is outside the window: chain not checked
# tokens / expected values that are not known.
UNKNOWN = -1


class Reason(IntEnum):
    """Fail-reason bits of a violation row; the name is the label users assert on."""

    VERIFY_CHAIN_HASH = 1
    VERIFY_POSITION = 2
    VERIFY_REAL_KV_HASH = 4
    VERIFY_TOKEN = 8
    WRITE_TOKEN = 16
    WRITE_POSITION = 32
    VERIFY_MISSING_SLOT = 64  # a position inside a read window maps to no resident slot (slot 0)
    RESERVED_SLOT_WRITTEN = 128  # slot 0's bytes changed since the canary attached
    WRITE_REAL_KV_HASH = 256  # a written slot does not hold what the forward computed for it
    # Malformed input from the engine (the canary reports it and skips what it cannot check):
    WALK_DUPLICATE_SLOT = 512  # a prefix-cache walk lists a slot more than once
    WALK_SLOT_OUT_OF_RANGE = 1024  # a walk names a slot (or predecessor) outside the FULL slot space
    WALK_TOO_LARGE = 2048  # a walk holds more entries than the FULL slot space has slots
    WALK_POSITION_GAP = 4096  # a walk entry's predecessor does not hold the previous position
    VIEW_OUT_OF_RANGE = 8192  # a view's length is outside what the canary can check; clamped
    # Ranks of a parallel engine disagree: what a forward stamped (slot, token, position, chain) or
    # what a sweep's walk holds differs from the reference rank's (the row column holds that rank).
    RANK_DIVERGENCE = 16384
    # A scale a forward dequantizes with (or one a pool holds) is not the layer's guarded scale
    # (the slot column holds the layer, the position column the head; stored/expected: float32 bits).
    VERIFY_SCALE = 32768
    # A sparse attention's selected index does not point at its own row's slot of that position, or
    # at a position the query sees (the slot column holds the selected slot, the position column
    # the selected position; stored/expected: the selected slot and the row's slot there).
    VERIFY_INDEX = 65536

    @property
    def label(self) -> str:
        return self.name.lower()


# Order in which a row's stored/expected pair is chosen when several reasons fail.
PRIMARY_REASON_ORDER = (
    Reason.RANK_DIVERGENCE,
    Reason.VIEW_OUT_OF_RANGE,
    Reason.WALK_TOO_LARGE,
    Reason.WALK_SLOT_OUT_OF_RANGE,
    Reason.WALK_DUPLICATE_SLOT,
    Reason.WALK_POSITION_GAP,
    Reason.RESERVED_SLOT_WRITTEN,
    Reason.VERIFY_SCALE,
    Reason.VERIFY_INDEX,
    Reason.VERIFY_MISSING_SLOT,
    Reason.VERIFY_POSITION,
    Reason.VERIFY_TOKEN,
    Reason.VERIFY_CHAIN_HASH,
    Reason.VERIFY_REAL_KV_HASH,
    Reason.WRITE_POSITION,
    Reason.WRITE_TOKEN,
    Reason.WRITE_REAL_KV_HASH,
)


def reasons_from_bits(bits: int) -> tuple[Reason, ...]:
    return tuple(r for r in Reason if bits & r)


class Phase(IntEnum):
    """HEAD: before a forward, its read set. TAIL: after it, the slots it wrote. SWEEP: what the
    prefix cache holds. RECHECK: after a forward, its read set again (damage done inside it).
    SELECT: inside a forward, after a sparse layer's indexer selected the tokens each query attends
    to and before its attention reads them."""

    HEAD = 0
    TAIL = 1
    SWEEP = 2
    RECHECK = 3
    SELECT = 4


class Half(IntEnum):
    K = 0
    V = 1


class GroupKind(IntEnum):
    FULL = 0
    SWA = 1
    DRAFT = 2  # a speculative-decoding draft model's own KV pool
    STATE = 3  # a hybrid model's recurrent state: one slot per running request or cached checkpoint
    SCALES = 4  # a quantized pool's dequantization scales: one slot per layer
    INDEXER = 5  # a sparse attention's indexer keys: one row per FULL slot, the same slots

    @property
    def label(self) -> str:
        """The name reports, markers and the terminal use ("full", "swa", "draft", "state", "scales",
        "indexer")."""
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> GroupKind:
        """The kind a label names (the inverse of `label`)."""
        return cls[label.upper()]


NUM_TAGS = len(Phase) * len(Half) * len(GroupKind)


def launch_tag(phase: Phase, half: Half, group: GroupKind) -> int:
    return (int(phase) * len(Half) + int(half)) * len(GroupKind) + int(group)


def split_tag(tag: int) -> tuple[Phase, Half, GroupKind]:
    if not 0 <= tag < NUM_TAGS:
        raise ValueError(f"launch tag must be in [0, {NUM_TAGS}), got {tag}")
    phase, rest = divmod(tag, len(Half) * len(GroupKind))
    half, group = divmod(rest, len(GroupKind))
    return Phase(phase), Half(half), GroupKind(group)


def tag_name(tag: int) -> str:
    phase, half, group = split_tag(tag)
    return f"{phase.name}/{half.name}/{group.name}"


# Violation ring row: 8 x int64.
ROW_WIDTH = 8
COL_REASONS = 0  # Reason bitmask
COL_TAG = 1  # launch tag
COL_STEP = 2  # ring.step at the time of the launch (forward index)
COL_SLOT = 3  # slot in the group's pool
COL_POSITION = 4  # expected position
COL_ROW = 5  # request row (req_to_token row), -1 for sweep entries
COL_STORED = 6  # stored value of the primary reason's field
COL_EXPECTED = 7  # expected value of the primary reason's field
