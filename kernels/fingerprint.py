"""Device-side real-KV fingerprint of a block of slots.

Per source, over the slot's first ``read_words`` int64 words ``w_i``:
``source_hash = sum_i mix(w_i ^ mix(i + 1))`` (wrapping uint64). Per slot, over the sources in
order: ``acc = 0; acc = mix(acc ^ source_hash)``. With no sources the fingerprint is 0.

Each source is passed as ``(words, row_stride, page_size, words_per_token)`` plus constexpr
``READ_WORDS`` and ``CHUNK`` (a power of two); slot ``s`` reads
``words[(s // page_size) * row_stride + (s % page_size) * words_per_token + i]``. A program walks
its slots' words in ``[BLOCK, CHUNK]`` tiles (coalesced 16-byte loads along each slot's row, one
tile ahead of the hashing, streamed past L2 so records stay cached), adds the hashed words into a
tile accumulator and reduces it once at the end.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .hashing import as_u64, mix


@triton.jit
def source_hash(words, row_stride, page_size, words_per_token, slots, mask,
                READ_WORDS: tl.constexpr, CHUNK: tl.constexpr):
    """uint64 hash of one source's words for each lane's slot (lanes off ``mask``: meaningless)."""
    # Every source offset is a multiple of 16 bytes (validated on the host).
    base = tl.multiple_of((slots // page_size) * row_stride + (slots % page_size) * words_per_token, 2)
    cols = tl.arange(0, CHUNK)
    ptrs = words + base[:, None] + cols[None, :]
    tile = tl.load(ptrs, mask=mask[:, None] & (cols < READ_WORDS)[None, :], other=0,
                   eviction_policy="evict_first")
    acc = tl.zeros([slots.shape[0], CHUNK], tl.uint64)
    for start in range(0, READ_WORDS, CHUNK):
        # Load the next chunk before hashing this one, so loads stay in flight while hashing.
        current = tile
        ahead = start + CHUNK + cols
        tile = tl.load(ptrs + start + CHUNK, mask=mask[:, None] & (ahead < READ_WORDS)[None, :], other=0,
                       eviction_policy="evict_first")
        hashed = mix(as_u64(current) ^ mix((start + cols + 1).to(tl.uint64))[None, :])
        if READ_WORDS % CHUNK != 0:
            hashed = tl.where((start + cols < READ_WORDS)[None, :], hashed, 0)
        acc += hashed
    return tl.sum(acc, axis=1)


@triton.jit
def slot_fingerprint(slots, mask,
                     src0, stride0, page0, wpt0,
                     src1, stride1, page1, wpt1,
                     src2, stride2, page2, wpt2,
                     src3, stride3, page3, wpt3,
                     NUM_SOURCES: tl.constexpr,
                     RW0: tl.constexpr, CHUNK0: tl.constexpr, RW1: tl.constexpr, CHUNK1: tl.constexpr,
                     RW2: tl.constexpr, CHUNK2: tl.constexpr, RW3: tl.constexpr, CHUNK3: tl.constexpr):
    """uint64 fingerprint of each lane's slot over the first NUM_SOURCES sources."""
    acc = tl.zeros(slots.shape, tl.uint64)
    if NUM_SOURCES > 0:
        acc = mix(acc ^ source_hash(src0, stride0, page0, wpt0, slots, mask, RW0, CHUNK0))
    if NUM_SOURCES > 1:
        acc = mix(acc ^ source_hash(src1, stride1, page1, wpt1, slots, mask, RW1, CHUNK1))
    if NUM_SOURCES > 2:
        acc = mix(acc ^ source_hash(src2, stride2, page2, wpt2, slots, mask, RW2, CHUNK2))
    if NUM_SOURCES > 3:
        acc = mix(acc ^ source_hash(src3, stride3, page3, wpt3, slots, mask, RW3, CHUNK3))
    return acc
