"""Quantized KV: the dtype a pool stores K and V in, and the scales a layer's rows are stored with.

``ModelConfig.kv_dtype`` "auto" stores the model's dtype; "float32", "float16" and "bfloat16" store
that float type (a plain cast each way); "fp8_e4m3" and "fp8_e5m2" store FP8 (torch.float8_e4m3fn,
torch.float8_e5m2): a row x is stored as ``x / scale`` clamped to the format's largest finite value,
and read back as ``stored * scale`` in the model's dtype. "fp4_e2m1" stores FP4 as NVFP4 lays it
out: ``x / scale`` in blocks of 16 values, each block with an FP8 (e4m3) block scale of its amax / 6
and its values as e2m1 codes, two a byte (`NVFP4Codec`); "mxfp4" as the OCP MX spec does: blocks of
32 values, each with an E8M0 block scale (a power of two, one byte; `MXFP4Codec`). Scales are
static, as a checkpoint's k_scale / v_scale are: per layer and half, one per KV head
(``kv_scale="head"``) or one for the layer (``"tensor"``; a latent layer has one head), seeded, in
[0.01, 0.02) (K and V rows of a few units use the formats' upper range; for FP4 the scale is
NVFP4's per-tensor global scale, under which MXFP4's block scales apply as well). A model keeps
them as a `ScaleInputs` of float32 ``[num_layers, W]`` buffers (`CausalLM.kv_scales`; rows of
recurrent layers unused); attention dequantizes through the scales each forward is handed
(attention.py).
"""

from __future__ import annotations

import torch

from kvcanary_kernels.inputs import ScaleInputs

KV_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp4_e2m1": torch.uint8,
             "mxfp4": torch.uint8}
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "mxfp4")
FP4_BLOCKS = {"fp4_e2m1": 16, "mxfp4": 32}  # values per block scale: NVFP4's, MX's
E8M0_BIAS = 127  # an E8M0 byte b is 2 ** (b - 127)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0-7 (bit 3: the sign)
KV_SCALES = ("tensor", "head")
SCALE_LOW, SCALE_SPAN = 0.01, 0.01


def seeded_scales(num_layers: int, heads: int, latent: bool, seed: int) -> ScaleInputs:
    """Per-layer scales ``[num_layers, heads]`` (float32, CPU) for K and, but for a latent pool, V."""
    gen = torch.Generator().manual_seed(seed)

    def draw() -> torch.Tensor:
        return SCALE_LOW + SCALE_SPAN * torch.rand(num_layers, heads, generator=gen)

    k = draw()
    return ScaleInputs(k, None if latent else draw())


def fp4_row_bytes(dim: int, block: int) -> int:
    """Bytes of one head's FP4 row of ``dim`` values in blocks of ``block``: its block scales (a byte
    each), its codes (dim / 2), zeros up to a multiple of 16."""
    used = dim // 2 + dim // block
    return -(-used // 16) * 16


def stored_head_dim(kv_dtype: str, dim: int) -> int:
    """Elements of a pool's row for one head of ``dim`` values (FP4: the packed row's bytes)."""
    return fp4_row_bytes(dim, FP4_BLOCKS[kv_dtype]) if kv_dtype in FP4_BLOCKS else dim


class KVCodec:
    """How one model's K/V rows ``[..., heads, dim]`` go into a pool and come back out. storage: the
    pools' dtype; compute: the model's; scaled: FP8 or FP4 (rows divided by a scale on the way in).
    This class casts (float types) or scales and casts (FP8); `FP4Codec` packs FP4."""

    def __init__(self, storage: torch.dtype, compute: torch.dtype, scaled: bool) -> None:
        self.storage, self.compute, self.scaled = storage, compute, scaled
        self._max = torch.finfo(storage).max if scaled and storage.is_floating_point else None

    def store(self, rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Rows as the pool stores them; scale: the layer's half's scales ``[W]`` (FP8, FP4 only)."""
        if not self.scaled:
            return rows.to(self.storage)
        return (rows.float() / scale[:, None]).clamp(-self._max, self._max).to(self.storage)

    def load(self, stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Stored rows read back in the model's dtype, through the scales ``[W]`` handed in (FP8, FP4)."""
        if not self.scaled:
            return stored.to(self.compute)
        return (stored.float() * scale[:, None]).to(self.compute)

    def round_trip(self, rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """What a row reads back as once stored: the no-cache recomputation's K/V."""
        return self.load(self.store(rows, scale), scale)


class FP4Codec(KVCodec):
    """FP4 (e2m1) rows of ``dim`` values a head, stored as uint8 ``[..., heads, fp4_row_bytes(dim,
    block)]``: one block scale byte per ``block`` values, then the codes of values 2i and 2i + 1 in
    code byte i (low nibble first), then zeros. The block scales lead, so the 16 bytes a partial
    fingerprint reads of a head hold its first block scales (all of them up to 16 blocks) with the
    first values. A block's values are ``x / scale`` divided by its block scale, rounded to the
    nearest e2m1 magnitude (ties to the smaller, past 6 to 6) with their sign (none on a zero).
    Subclasses say how a block scale is chosen and stored (`NVFP4Codec`, `MXFP4Codec`)."""

    block: int  # values per block scale

    def __init__(self, compute: torch.dtype, dim: int) -> None:
        super().__init__(torch.uint8, compute, scaled=True)
        self.dim = dim
        self.row_bytes = fp4_row_bytes(dim, self.block)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def block_scales(self, amax: torch.Tensor) -> torch.Tensor:
        """The block scales' bytes (uint8) of blocks whose largest magnitude is ``amax``."""
        raise NotImplementedError

    def block_units(self, stored: torch.Tensor) -> torch.Tensor:
        """The float32 values of block scale bytes ``stored``."""
        raise NotImplementedError

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The e2m1 magnitudes and the midpoints between them, on ``device``: made at the first
        (eager) call there, so a CUDA graph that captures a later one copies nothing from the host."""
        if device not in self._tables:
            magnitudes = torch.tensor(E2M1, device=device)
            self._tables[device] = magnitudes, (magnitudes[1:] + magnitudes[:-1]) / 2
        return self._tables[device]

    def store(self, rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        x = (rows.float() / scale[:, None]).unflatten(-1, (-1, self.block))  # [..., heads, blocks, block]
        block = self.block_scales(x.abs().amax(-1))
        unit = self.block_units(block)
        q = x / torch.where(unit > 0, unit, 1.0)[..., None]
        codes = torch.bucketize(q.abs().clamp(max=E2M1[-1]), self._table(x.device)[1])
        signs = torch.where((q < 0) & (codes > 0), 8, 0)
        codes = (codes | signs).to(torch.uint8).flatten(-2)  # [..., heads, dim]
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        pad = rows.new_zeros((*packed.shape[:-1], self.row_bytes - packed.shape[-1] - block.shape[-1]),
                             dtype=torch.uint8)
        return torch.cat([block, packed, pad], dim=-1)

    def load(self, stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        blocks = self.dim // self.block
        block, packed = stored[..., :blocks], stored[..., blocks:blocks + self.dim // 2]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()  # [..., heads, dim]
        values = self._table(stored.device)[0][codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        unit = self.block_units(block).repeat_interleave(self.block, dim=-1)
        return (values * unit * scale[:, None]).to(self.compute)


class NVFP4Codec(FP4Codec):
    """NVFP4 ("fp4_e2m1"): 16 values a block, an e4m3 block scale of the block's amax / 6."""

    block = FP4_BLOCKS["fp4_e2m1"]

    def block_scales(self, amax: torch.Tensor) -> torch.Tensor:
        return (amax / E2M1[-1]).to(torch.float8_e4m3fn).view(torch.uint8)

    def block_units(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.contiguous().view(torch.float8_e4m3fn).float()


class MXFP4Codec(FP4Codec):
    """MXFP4 ("mxfp4", OCP MX): 32 values a block, an E8M0 block scale 2 ** e with e the exponent of
    the block's amax less e2m1's largest (2), as the spec computes it (so amax / 2 ** e is in [4, 8)
    and values past 6 saturate), clamped to [-127, 127]; an all-zero block's e is -127."""

    block = FP4_BLOCKS["mxfp4"]

    def block_scales(self, amax: torch.Tensor) -> torch.Tensor:
        exponent = torch.frexp(amax).exponent - 3  # frexp's exponent is floor(log2(amax)) + 1
        exponent = torch.where(amax > 0, exponent, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
        return (exponent + E8M0_BIAS).to(torch.uint8)

    def block_units(self, stored: torch.Tensor) -> torch.Tensor:
        return torch.exp2(stored.float() - E8M0_BIAS)


def make_codec(kv_dtype: str, compute: torch.dtype, dim: int) -> KVCodec:
    """The codec of a pool storing ``kv_dtype`` for a model computing in ``compute``, ``dim`` values
    a head (a latent row's for mla)."""
    if kv_dtype in FP4_BLOCKS:
        return {"fp4_e2m1": NVFP4Codec, "mxfp4": MXFP4Codec}[kv_dtype](compute, dim)
    return KVCodec(KV_DTYPES[kv_dtype] or compute, compute, kv_dtype in QUANTIZED)
