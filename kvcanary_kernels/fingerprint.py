"""Device-side real-KV fingerprint of a block of slots.

Per source, over the ``read_words`` int64 words ``w_i`` of the slot it samples, each split into 32-bit
halves ``lo_i``, ``hi_i`` and keyed by ``k_i = mix(i + 1)`` (halves ``klo_i``, ``khi_i``):
``a = (lo_i + klo_i) mod 2**32``, ``b = (hi_i + khi_i) mod 2**32``, and
``source_hash = sum_i (a * b + a + b)`` (wrapping uint64). ``a * b + a + b = (a + 1)(b + 1) - 1``
with both factors in ``[1, 2**32]``, so changing one half of one word changes its term by a
nonzero amount below 2**64 in magnitude: every single flipped bit changes the hash, whatever the
other bytes hold; a swap of two words changes it unless their differences cancel against the
keys' (about 2**-64 for unrelated words). Per slot, over the sources in order:
``acc = 0; acc = mix(acc ^ source_hash)``. With no sources the fingerprint is 0.

A term costs one 32 x 32 -> 64-bit multiply and a few adds; a splitmix64 per word (the first
form) cost two 64-bit multiplies and six shifts, and measurably less bandwidth
(benchmarks/RESULTS.md).

The sources travel as two tuples, ``launch.source_args(sources, chunk)``: per source
``(words, row_stride, words_per_token, per_tile)`` and the constexpr ``launch.SourceRead``
(READ_WORDS, CHUNK, PAGE_SIZE, STRIDE_WORDS, SAMPLE_BYTES, TILE; CHUNK a power of two, words
starting at the source's first sample); with 16-byte samples and one tile per page, slot ``s``'s
i-th read word is ``words[(s // page_size) * row_stride + (s % page_size) * words_per_token +
(i // 2) * STRIDE_WORDS + i % 2]`` (a 16-byte sample every STRIDE_WORDS words; STRIDE_WORDS = 2:
one run); ``slot_start`` adds the tile level. A source read
element by element (``element_source_hash``) packs its elements into the same words. A program walks
its slots' words in ``[BLOCK, CHUNK]`` tiles (coalesced 16-byte loads along each slot's row, one
tile ahead of the hashing, streamed past L2 so records stay cached), adds the hashed words into a
tile accumulator and reduces it once at the end.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .hashing import as_u64, mix


@triton.jit
def word_terms(words, keys):
    """uint64 ``a * b + a + b`` of each uint64 word against the uint64 key of its column."""
    a = (words.to(tl.uint32) + keys.to(tl.uint32)).to(tl.uint64)
    b = ((words >> 32).to(tl.uint32) + (keys >> 32).to(tl.uint32)).to(tl.uint64)
    return a * b + a + b


@triton.jit
def slot_start(slots, row_stride, per_slot, per_tile, PAGE_SIZE: tl.constexpr, TILE: tl.constexpr):
    """Each slot's first loaded unit: its page's row, then its tile's, then its own place."""
    within = slots % PAGE_SIZE
    base = (slots // PAGE_SIZE) * row_stride
    if TILE < PAGE_SIZE:
        base += (within // TILE) * per_tile
        within = within % TILE
    return base + within * per_slot


@triton.jit
def source_hash(words, row_stride, words_per_token, per_tile, slots, mask, READ_WORDS: tl.constexpr,
                CHUNK: tl.constexpr, PAGE_SIZE: tl.constexpr, STRIDE_WORDS: tl.constexpr, TILE: tl.constexpr):
    """uint64 hash of one source's words for each lane's slot (lanes off ``mask``: meaningless)."""
    # Every source offset is a multiple of 16 bytes (validated on the host).
    base = tl.multiple_of(slot_start(slots, row_stride, words_per_token, per_tile, PAGE_SIZE, TILE), 2)
    cols = tl.arange(0, CHUNK)
    # Word i of the read lies at (i // 2) * STRIDE_WORDS + i % 2; CHUNK is even, so a chunk
    # starting at read word `start` starts at (start // 2) * STRIDE_WORDS.
    ptrs = words + base[:, None] + ((cols // 2) * STRIDE_WORDS + cols % 2)[None, :]
    tile = tl.load(ptrs, mask=mask[:, None] & (cols < READ_WORDS)[None, :], other=0,
                   eviction_policy="evict_first")
    acc = tl.zeros([slots.shape[0], CHUNK], tl.uint64)
    for start in range(0, READ_WORDS, CHUNK):
        # Load the next chunk before hashing this one, so loads stay in flight while hashing.
        current = tile
        ahead = start + CHUNK + cols
        tile = tl.load(ptrs + (start + CHUNK) // 2 * STRIDE_WORDS, mask=mask[:, None] & (ahead < READ_WORDS)[None, :], other=0,
                       eviction_policy="evict_first")
        hashed = word_terms(as_u64(current), mix((start + cols + 1).to(tl.uint64))[None, :])
        if READ_WORDS % CHUNK != 0:
            hashed = tl.where((start + cols < READ_WORDS)[None, :], hashed, 0)
        acc += hashed
    return tl.sum(acc, axis=1)


@triton.jit
def element_source_hash(elements, row_stride, per_slot, per_tile, slots, mask, READ_WORDS: tl.constexpr,
                        CHUNK: tl.constexpr, PAGE_SIZE: tl.constexpr, STRIDE: tl.constexpr, SAMPLE_BYTES: tl.constexpr,
                        TILE: tl.constexpr):
    """``source_hash`` of a source read element by element (a feature-major page): word i packs
    samples ``i * P .. i * P + P - 1`` (P = 8 // SAMPLE_BYTES, little-endian), sample k being
    element ``k * STRIDE`` from the slot's first, so a slot's features hash as they would as one
    contiguous run."""
    PER_WORD: tl.constexpr = 8 // SAMPLE_BYTES
    base = slot_start(slots, row_stride, per_slot, per_tile, PAGE_SIZE, TILE)
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros([slots.shape[0], CHUNK], tl.uint64)
    for start in range(0, READ_WORDS, CHUNK):
        on = (start + cols) < READ_WORDS
        word = tl.zeros([slots.shape[0], CHUNK], tl.uint64)
        for j in tl.static_range(PER_WORD):
            at = ((start + cols) * PER_WORD + j) * STRIDE
            e = tl.load(elements + base[:, None] + at[None, :], mask=mask[:, None] & on[None, :], other=0)
            if SAMPLE_BYTES == 1:
                u = e.to(tl.uint8, bitcast=True).to(tl.uint64)
            elif SAMPLE_BYTES == 2:
                u = e.to(tl.uint16, bitcast=True).to(tl.uint64)
            elif SAMPLE_BYTES == 4:
                u = e.to(tl.uint32, bitcast=True).to(tl.uint64)
            else:
                u = e.to(tl.uint64, bitcast=True)
            word |= u << (j * 8 * SAMPLE_BYTES)
        hashed = word_terms(word, mix((start + cols + 1).to(tl.uint64))[None, :])
        acc += tl.where(on[None, :], hashed, 0)
    return tl.sum(acc, axis=1)


@triton.jit
def slot_fingerprint(sources, READS: tl.constexpr, slots, mask):
    """uint64 fingerprint of each lane's slot over the sources, and the last source's hash alone
    (both 0 with none)."""
    acc = tl.zeros(slots.shape, tl.uint64)
    last = acc
    for k in tl.static_range(len(READS)):
        words, row_stride, per_slot, per_tile = sources[k]
        # READS[k] is a launch.SourceRead, read by position: compiled Triton hands a constexpr tuple's
        # elements over as plain tuples, and unpacking one loses constexpr-ness.
        if READS[k][4] == 16:
            last = source_hash(words, row_stride, per_slot, per_tile, slots, mask, READS[k][0], READS[k][1],
                               READS[k][2], READS[k][3], READS[k][5])
        else:
            last = element_source_hash(words, row_stride, per_slot, per_tile, slots, mask, READS[k][0], READS[k][1],
                                       READS[k][2], READS[k][3], READS[k][4], READS[k][5])
        acc = mix(acc ^ last)
    return acc, last
