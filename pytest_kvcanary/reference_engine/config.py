"""Model and engine configuration of the reference engine. Bad values raise ValueError at
construction, naming the field, the value and what is allowed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcanary_kernels.checks import check_int
from kvcanary_kernels.records import GroupKind

from .kv_quant import FP4_BLOCKS, KV_DTYPES, KV_SCALES, QUANTIZED, stored_head_dim

ATTENTION_KINDS = ("mha", "swa", "mla", "hybrid", "sparse")
LATENT = ("mla", "sparse")  # one latent row a token
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_SCALE_BYTES = 4  # a sparse model's index key: a float32 scale, then FP8 codes (sparse.py)


def index_row_bytes(dim: int) -> int:
    """Bytes of one token's stored index key: its scale, its dim codes, zeros to a multiple of 16."""
    return -(-(INDEX_SCALE_BYTES + dim) // 16) * 16


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        check_int(name, getattr(obj, name), 1)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama/Qwen-style decoder. attention: "mha" (every layer full; GQA when num_kv_heads <
    num_heads), "swa" (every `full_every`-th layer full, the rest windowed) or "mla" (every layer
    full, DeepSeek-V2-style latent attention: a token's KV is one latent row of kv_lora_rank
    compressed KV plus qk_rope_head_dim rotary key, from which each head's K and V of head_dim are
    up-projected; num_kv_heads is unused) or "hybrid" (every `full_every`-th layer full attention,
    the rest a recurrent mixer, Mamba2/SSD-style: a causal convolution of conv_width over the
    mixer's inputs and a matrix state of state_dim x state_dim per each of state_heads heads,
    decayed per head and token; its state lives in a state pool, model.py's RecurrentMixer) or
    "sparse" (mla's latent KV, each layer's attention over only the index_topk tokens its indexer
    selects, DeepSeek-V3.2-style: index_n_heads heads of index_head_dim, keys kept in FP8 beside the
    latent KV; sparse.py; kv_dtype "auto" only). A windowed layer's query at position p sees positions
    [p - window, p], so it reads the last `window` tokens of the cached prefix (SGLang's
    convention; HF's sliding_window is window + 1). qkv_bias: Qwen2-style q/k/v biases (mha, swa).
    seed: the random weights' seed. kv_dtype: what the KV pools store ("auto": dtype; "float32",
    "float16", "bfloat16"; or FP8, "fp8_e4m3" / "fp8_e5m2", or FP4, "fp4_e2m1" in NVFP4 blocks or
    "mxfp4" in MX blocks, with
    static per-layer K and V scales, one per KV head when kv_scale is "head", one per layer when
    "tensor"; kv_quant.py)."""

    vocab_size: int = 512
    hidden: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_context: int = 256
    attention: str = "mha"
    window: int = 32
    full_every: int = 2
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    tie_embeddings: bool = True
    qkv_bias: bool = False
    dtype: torch.dtype = torch.float32
    seed: int = 0
    state_heads: int = 4
    state_dim: int = 16
    conv_width: int = 4
    kv_dtype: str = "auto"
    kv_scale: str = "tensor"
    index_head_dim: int = 32
    index_n_heads: int = 4
    index_topk: int = 16

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate", "max_context", "window", "full_every", "kv_lora_rank", "qk_rope_head_dim",
                  "state_heads", "state_dim", "index_head_dim", "index_n_heads", "index_topk")
        check_int("conv_width", self.conv_width, 2)
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}; got {self.attention!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads; got {self.num_kv_heads}")
        if self.attention == "sparse" and self.kv_dtype != "auto":
            raise ValueError(f"attention 'sparse' needs kv_dtype 'auto' (its latent KV in the model's dtype; the "
                             f"indexer keys are FP8 of their own); got kv_dtype={self.kv_dtype!r}")
        if self.rope_dim % 2:
            name = "qk_rope_head_dim" if self.attention in LATENT else "head_dim"
            raise ValueError(f"{name} must be even (RoPE rotates pairs); got {self.rope_dim}")
        if self.attention in ("swa", "hybrid") and not 2 <= self.full_every <= self.num_layers:
            raise ValueError(f"full_every must be in [2, num_layers={self.num_layers}] for {self.attention} so both "
                             f"full-attention and {'windowed' if self.attention == 'swa' else 'recurrent'} layers "
                             f"exist; got {self.full_every}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, DTYPES))}; got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {self.kv_dtype!r}")
        if self.kv_scale not in KV_SCALES:
            raise ValueError(f"kv_scale must be one of {', '.join(KV_SCALES)}; got {self.kv_scale!r}")
        dims = "kv_lora_rank + qk_rope_head_dim" if self.attention in LATENT else "head_dim"
        if (block := FP4_BLOCKS.get(self.kv_dtype)) and self.kv_head_dim % block:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} needs {dims} a multiple of {block} (a block scale per "
                             f"{block} values); got {self.kv_head_dim}")
        row_bytes = math.prod(self.kv_row) * torch.empty(0, dtype=self.kv_storage).element_size()
        if self.attention in LATENT and row_bytes % 16:
            raise ValueError(f"kv_lora_rank + qk_rope_head_dim ({self.latent_dim}) must make a latent row of a "
                             f"multiple of 16 bytes in {self.kv_storage}; got {row_bytes} bytes")
        if self.kv_quantized and row_bytes % 16:
            raise ValueError(f"num_kv_heads x head_dim ({self.num_kv_heads} x {self.head_dim}) must make a KV row of "
                             f"a multiple of 16 bytes in {self.kv_storage}; got {row_bytes}")
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ValueError(f"rope_theta and rms_eps must be > 0; got {self.rope_theta!r}, {self.rms_eps!r}")

    @property
    def kv_storage(self) -> torch.dtype:
        """The dtype the KV pools store."""
        return KV_DTYPES[self.kv_dtype] or self.dtype

    @property
    def kv_quantized(self) -> bool:
        """KV stored in FP8 or FP4, through per-layer scales."""
        return self.kv_dtype in QUANTIZED

    @property
    def scale_width(self) -> int:
        """Scales per layer and half: one per KV head ("head"; a latent layer has one) or one."""
        return self.num_kv_heads if self.kv_scale == "head" and self.attention not in LATENT else 1

    @property
    def latent_dim(self) -> int:
        """An mla layer's latent row per token: compressed KV, then the rotary key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates per head."""
        return self.qk_rope_head_dim if self.attention in LATENT else self.head_dim

    @property
    def kv_head_dim(self) -> int:
        """Values a KV head holds per token (mla: its one latent row's)."""
        return self.latent_dim if self.attention in LATENT else self.head_dim

    @property
    def kv_row(self) -> tuple[int, ...]:
        """One token's row in one layer's K (or V) buffer, in kv_storage elements (fp4: the bytes of
        its packed values and block scales); mla keeps one latent row and no V."""
        dim = stored_head_dim(self.kv_dtype, self.kv_head_dim)
        return (dim,) if self.attention in LATENT else (self.num_kv_heads, dim)

    @property
    def layer_groups(self) -> tuple[GroupKind, ...]:
        """The pool group each layer's KV lives in."""
        if self.attention not in ("swa", "hybrid"):
            return (GroupKind.FULL,) * self.num_layers
        other = GroupKind.SWA if self.attention == "swa" else GroupKind.STATE
        return tuple(GroupKind.FULL if i % self.full_every == self.full_every - 1 else other
                     for i in range(self.num_layers))

    @property
    def conv_channels(self) -> int:
        """A recurrent mixer's convolved channels: its keys, queries and values, state_heads x state_dim each."""
        return 3 * self.state_heads * self.state_dim

    def layer_window(self, layer: int) -> int | None:
        return self.window if self.layer_groups[layer] is GroupKind.SWA else None


DECODE_MODES = ("eager", "padded", "graph")


@dataclass(frozen=True)
class EngineConfig:
    """num_slots / swa_num_slots: rows of the FULL / SWA pools, slot 0 included (reserved);
    swa_num_slots is used by swa models only. max_running: requests holding a req_to_token row at
    once. max_batch_tokens: prefill tokens per forward (>= max_context, so any request fits).
    checkpoint: a directory with config.json + model.safetensors whose weights replace the random
    ones (`weights.read_config` builds a matching `model`). decode_mode: "eager" (one attention per
    request), "padded" (decode batches padded to fixed sizes, as a graph replays them) or "graph"
    (those padded steps captured in CUDA graphs and replayed; CUDA only). speculative_k: draft
    tokens proposed per decode step (0: no speculative decoding; mha, mla and hybrid, eager decode, KV in
    the model's dtype), by a
    draft model made of the target's first draft_layers layers (speculative.py). page_size: tokens
    per KV page (1: SGLang's per-token slots); the pools allocate, and the radix cache matches,
    inserts and evicts, whole pages, and num_slots / swa_num_slots / host_num_slots are multiples
    of it (page 0, slot 0's page, is reserved). host_num_slots: slots of a host-memory tier that
    pages the radix cache evicts are written back to and loaded back from on a later hit (0: none;
    mha, mla and hybrid; host_tier.py). num_state_slots: slots of a hybrid model's state pool, slot
    0 included (reserved: the initial state): one per running request, the rest for the prefix
    cache's checkpoints (state_pool.py); with a host tier, as many host state slots hold the
    checkpoints of pages written back. disk_dir: a directory where a storage tier under the host
    tier keeps the pages host memory evicts, as files (None: none; needs a host tier, mha or mla;
    disk_tier.py), at most disk_num_pages of them. jitter_seed: seeded timing jitter at the
    engine's asynchronous points, the host tier's acknowledgements and a pair's transfers (None:
    off; jitter.py). async_scheduling: schedule and launch each step before the previous one's
    results are processed, its decode inputs taken from that step's outputs on the device (vLLM's
    async scheduling, SGLang's overlap scheduler; async_steps.py; with speculative_k > 0, each
    decode placed as if the one in flight kept every position, moved back on the device)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    num_slots: int = 1024
    swa_num_slots: int = 512
    max_running: int = 8
    max_batch_tokens: int = 512
    device: str = "cpu"
    checkpoint: str | None = None
    decode_mode: str = "eager"
    speculative_k: int = 0
    draft_layers: int = 1
    page_size: int = 1
    host_num_slots: int = 0
    num_state_slots: int = 64
    disk_dir: str | None = None
    disk_num_pages: int = 1024
    jitter_seed: int | None = None
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"model must be a ModelConfig; got {type(self.model).__name__}")
        _positive(self, "max_running", "max_batch_tokens")
        for name in ("num_slots", "swa_num_slots"):
            check_int(name, getattr(self, name), 2, " (slot 0 is reserved)")
        if self.max_batch_tokens < self.model.max_context:
            raise ValueError(f"max_batch_tokens must be >= model.max_context ({self.model.max_context}); "
                             f"got {self.max_batch_tokens}")
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {', '.join(DECODE_MODES)}; got {self.decode_mode!r}")
        k = self.speculative_k
        check_int("speculative_k", k, 0)
        if k and (self.model.attention == "swa" or self.decode_mode != "eager"):
            raise ValueError(f"speculative_k > 0 needs attention mha, mla or hybrid and decode_mode eager; got "
                             f"attention={self.model.attention!r}, decode_mode={self.decode_mode!r}")
        if k and self.model.kv_dtype != "auto":
            raise ValueError(f"speculative_k > 0 needs model.kv_dtype 'auto' (the draft pool stores the model's "
                             f"dtype); got {self.model.kv_dtype!r}")
        if not isinstance(self.draft_layers, int) or not 1 <= self.draft_layers <= self.model.num_layers:
            raise ValueError(f"draft_layers must be an integer in [1, model.num_layers={self.model.num_layers}]; "
                             f"got {self.draft_layers!r}")
        check_int("page_size", self.page_size, 1)
        for name in ("num_slots",) + (("swa_num_slots",) if self.model.attention == "swa" else ()):
            if getattr(self, name) % self.page_size or getattr(self, name) < 2 * self.page_size:
                raise ValueError(f"{name} must be a multiple of page_size ({self.page_size}) holding at least two "
                                 f"pages (page 0 is reserved); got {getattr(self, name)}")
        check_int("host_num_slots", self.host_num_slots, 0)
        if self.host_num_slots % self.page_size:
            raise ValueError(f"host_num_slots must be a multiple of page_size ({self.page_size}); "
                             f"got {self.host_num_slots}")
        if self.host_num_slots and self.model.attention == "swa":  # hybrid: checkpoints go to host state slots
            raise ValueError(f"host_num_slots > 0 needs attention mha, mla or hybrid (the host tier keeps no SWA "
                             f"pool); got attention={self.model.attention!r}")
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, str) or not self.disk_dir:
                raise ValueError(f"disk_dir must be a directory path (a non-empty string) or None; "
                                 f"got {self.disk_dir!r}")
            if not self.host_num_slots or self.model.attention not in ("mha", "mla"):
                raise ValueError(f"disk_dir needs a host tier (host_num_slots > 0) and attention mha or mla (the disk "
                                 f"tier keeps no SWA pool nor checkpoints); got host_num_slots={self.host_num_slots}, "
                                 f"attention={self.model.attention!r}")
        check_int("disk_num_pages", self.disk_num_pages, 1)
        if self.jitter_seed is not None:
            check_int("jitter_seed", self.jitter_seed, 0)
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool; got {self.async_scheduling!r}")
        if self.model.attention == "hybrid":
            check_int("num_state_slots", self.num_state_slots, 2 * self.max_running + 1,
                      f" (slot 0 is reserved; each of max_running={self.max_running} requests holds a running state "
                      f"and may write a checkpoint)")
            if self.speculative_k and self.draft_layers < self.model.full_every:
                raise ValueError(f"speculative_k > 0 on attention='hybrid' needs draft_layers >= model.full_every "
                                 f"({self.model.full_every}), so the draft has an attention layer; got "
                                 f"draft_layers={self.draft_layers!r}")
        if self.model.attention == "sparse":
            _sparse_supported(self)
        if self.decode_mode == "graph" and torch.device(self.device).type != "cuda":
            raise ValueError(f"decode_mode='graph' needs a CUDA device; got device={self.device!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be a torch device string such as 'cpu' or 'cuda:0'; "
                             f"got {self.device!r}") from None


def _sparse_supported(config: EngineConfig) -> None:
    """attention 'sparse' runs eager decode, pages and the radix cache; what else it is refused with."""
    unsupported = {"speculative_k": config.speculative_k != 0, "host_num_slots": config.host_num_slots != 0,
                   "decode_mode": config.decode_mode != "eager", "async_scheduling": config.async_scheduling}
    for name, value in unsupported.items():
        if value:
            raise ValueError(f"attention 'sparse' does not work with {name}={getattr(config, name)!r} (its indexer "
                             f"selects inside an eager forward, over the pools alone); use {name}="
                             f"{EngineConfig.__dataclass_fields__[name].default!r}")
