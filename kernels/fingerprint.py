"""Device-side real-KV fingerprint of a block of slots.

Per source, over the slot's first ``read_words`` int64 words ``w_i``:
``source_hash = sum_i mix(w_i ^ mix(i + 1))`` (wrapping uint64). Per slot, over the sources in
order: ``acc = 0; acc = mix(acc ^ source_hash)``. With no sources the fingerprint is 0.

The sources travel as two tuples, ``launch.source_args(sources, chunk)``: per source
``(words, row_stride, words_per_token)`` and the constexpr ``(READ_WORDS, CHUNK, PAGE_SIZE)``
(CHUNK a power of two); slot ``s`` reads
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
def source_hash(words, row_stride, words_per_token, slots, mask, READ_WORDS: tl.constexpr, CHUNK: tl.constexpr,
                PAGE_SIZE: tl.constexpr):
    """uint64 hash of one source's words for each lane's slot (lanes off ``mask``: meaningless)."""
    # Every source offset is a multiple of 16 bytes (validated on the host).
    base = tl.multiple_of((slots // PAGE_SIZE) * row_stride + (slots % PAGE_SIZE) * words_per_token, 2)
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
def slot_fingerprint(sources, READS: tl.constexpr, slots, mask):
    """uint64 fingerprint of each lane's slot over the sources (0 with none)."""
    acc = tl.zeros(slots.shape, tl.uint64)
    for k in tl.static_range(len(READS)):
        words, row_stride, words_per_token = sources[k]
        # Indexed, not unpacked: unpacking a constexpr tuple loses constexpr-ness when compiled.
        acc = mix(acc ^ source_hash(words, row_stride, words_per_token, slots, mask,
                                    READS[k][0], READS[k][1], READS[k][2]))
    return acc
