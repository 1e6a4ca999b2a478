"""splitmix64 and the record chain hash, three ways: Triton (uint64), torch (int64), Python int.

``mix`` is the splitmix64 finalizer. A record passes ``link(prev_hash, token, position) =
prev_hash * LINK + mix(mix(token ^ LINK_KEY) ^ position)`` (wrapping) to its successor; a chain head
(position 0) of a request with context key c holds ``head_hash(c) = mix(ANCHOR ^ c)`` (c = 0: no
context, ``mix(ANCHOR)``). The link is affine in prev_hash with an odd multiplier, so a run of links
composes into one affine map (``compose``) and a row's chain is a prefix scan, not a serial loop;
the term of each entry is a full mix of its token and position, and ``LINK_INVERSE`` undoes the
multiplier.

Hashes are uint64 values; tensors hold their int64 bit pattern. ``to_signed`` converts a Python
uint64 to that pattern.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .records import ANCHOR

_U64 = (1 << 64) - 1
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
LINK = 0x5851F42D4C957F2D  # odd: x -> x * LINK is a bijection modulo 2**64
LINK_INVERSE = pow(LINK, -1, 1 << 64)
LINK_KEY = 0x6B76636861696E21


def to_signed(value: int) -> int:
    """The int64 bit pattern of a uint64 value (any int is taken modulo 2**64)."""
    value &= _U64
    return value - (1 << 64) if value >> 63 else value


# ---- Python ints (tests, host) ------------------------------------------------------------


def mix_int(x: int) -> int:
    """splitmix64 of ``x`` taken modulo 2**64; returns a uint64 in [0, 2**64)."""
    x &= _U64
    x ^= x >> 30
    x = (x * _M1) & _U64
    x ^= x >> 27
    x = (x * _M2) & _U64
    x ^= x >> 31
    return x


def link_int(prev_hash: int, token: int, position: int) -> int:
    """The prev_hash a record (prev_hash, token, position) passes to its successor (uint64)."""
    term = mix_int(mix_int((token & _U64) ^ LINK_KEY) ^ (position & _U64))
    return ((prev_hash & _U64) * LINK + term) & _U64


def head_hash_int(context_key: int = 0) -> int:
    """The prev_hash a chain head with this context key holds (uint64)."""
    return mix_int(ANCHOR ^ (context_key & _U64))


# The prev_hash a chain head without a context key holds, as uint64 and as its int64 bit pattern.
CHAIN_HEAD_HASH_U64 = head_hash_int(0)
CHAIN_HEAD_HASH = to_signed(CHAIN_HEAD_HASH_U64)


# ---- torch int64 tensors (references) -----------------------------------------------------

_M1_I64 = to_signed(_M1)
_M2_I64 = to_signed(_M2)
_LINK_I64 = to_signed(LINK)
_LINK_KEY_I64 = to_signed(LINK_KEY)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix_torch(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 on int64 tensors (bit patterns of uint64; multiplies wrap)."""
    x = x ^ _shr(x, 30)
    x = x * _M1_I64
    x = x ^ _shr(x, 27)
    x = x * _M2_I64
    return x ^ _shr(x, 31)


def link_torch(prev_hash: torch.Tensor, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``link`` on int64 tensors."""
    return prev_hash * _LINK_I64 + mix_torch(mix_torch(token ^ _LINK_KEY_I64) ^ position)


def head_hash_torch(context_keys: torch.Tensor) -> torch.Tensor:
    """``head_hash`` of each int64 context key."""
    return mix_torch(context_keys ^ ANCHOR)


# ---- Triton (uint64 inside kernels) -------------------------------------------------------

ANCHOR_JIT = tl.constexpr(ANCHOR)
LINK_JIT = tl.constexpr(LINK)
LINK_INVERSE_JIT = tl.constexpr(LINK_INVERSE)
LINK_KEY_JIT = tl.constexpr(LINK_KEY)


@triton.jit
def as_u64(x):
    return x.to(tl.uint64, bitcast=True)


@triton.jit
def as_i64(x):
    return x.to(tl.int64, bitcast=True)


@triton.jit
def mix(x):
    """splitmix64 on uint64 (wrapping)."""
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9
    x ^= x >> 27
    x *= 0x94D049BB133111EB
    x ^= x >> 31
    return x


@triton.jit
def link_term(token, position):
    """uint64 term an entry (token, position) adds to the chain: ``link(h, t, p) = h * LINK + term``."""
    return mix(mix(token ^ LINK_KEY_JIT) ^ position)


@triton.jit
def link(prev_hash, token, position):
    """``link`` on uint64 values."""
    return prev_hash * LINK_JIT + link_term(token, position)


@triton.jit
def compose(m1, a1, m2, a2):
    """Two affine maps of the chain in order, ``h -> (h * m1 + a1) * m2 + a2``, as one (m, a):
    associative, the combine of a chain's prefix scan."""
    return m1 * m2, a1 * m2 + a2


@triton.jit
def head_hash(context_keys):
    """uint64 prev_hash of a chain head for each int64 context key."""
    return mix(as_u64(context_keys) ^ ANCHOR_JIT)
