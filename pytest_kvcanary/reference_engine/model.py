"""A Llama/Qwen2-style decoder: RMSNorm, RoPE, GQA or latent (MLA) attention or, in a hybrid
model, a recurrent mixer (Mamba2/SSD-style) in some layers, SwiGLU MLP, tied or untied head.

Module names follow Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ...), so the
state dict is an HF checkpoint. A request's context key (an adapter id; 0 = none) adds a fixed
offset to its token embeddings, a stand-in for a LoRA adapter: the same tokens under another context
have other KV. Attention goes through a `KVAccess` (see attention.py), a recurrent mixer's state
through a `StateAccess` (see state_access.py): paged pools and a state pool in the engine, none for
the reference recomputation.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn
import torch.nn.functional as F

from kvcanary_kernels.inputs import ScaleInputs
from kvcanary_kernels.records import GroupKind

from .attention import DenseKV, KVAccess
from .config import LATENT, ModelConfig
from .kv_quant import make_codec, seeded_scales
from .sparse import DenseSparseKV, Indexer

# A recurrent mixer's states: called as ``states(mixer, u)`` with the mixer's in_proj rows u [T, ...]
# of the forward's tokens, it runs the mixer over each sequence's tokens from that sequence's state,
# keeps what a cache keeps, and returns their gated outputs [T, heads * state_dim] (state_access.py).
StateAccess = Callable[["RecurrentMixer", torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, head_dim] (float32) for HF's rotate-half RoPE."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.window = layer, cfg.layer_window(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAccess) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(kv(self.layer, q, k, v, self.window).reshape(t, -1))


class LatentAttention(nn.Module):
    """DeepSeek-V2-style multi-head latent attention, simplified (no query compression). A token's
    KV is one latent row ``[c, k_rope]``: c = its compressed KV (kv_lora_rank, RMS-normed), k_rope =
    its rotary key (qk_rope_head_dim, RoPE applied, shared by all heads). Head h's key is
    ``[W_UK[h] c, k_rope]`` and its value ``W_UV[h] c`` (kv_b_proj). Attention runs over the latent
    rows themselves, W_UK applied to the query and W_UV to the output (weight absorption, as MLA
    decode kernels do; the same attention): the KV access sees one KV head whose values are its keys,
    and the rotary part of the output is dropped."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.num_heads, self.head_dim = layer, cfg.num_heads, cfg.head_dim
        self.rank, self.rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.num_heads * (cfg.head_dim + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_eps)
        self.kv_b_proj = nn.Linear(self.rank, cfg.num_heads * 2 * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden, bias=False)
        # Attention scales scores by latent_dim ** -0.5; a head's true key dimension is head_dim + rope.
        self.q_scale = (cfg.latent_dim / (cfg.head_dim + self.rope)) ** 0.5

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The latent rows [T, latent_dim] the tokens store."""
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), apply_rope(k_rope[:, None, :], cos, sin)[:, 0]], dim=-1)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK, W_UV: [heads, head_dim, kv_lora_rank] each."""
        return self.kv_b_proj.weight.view(self.num_heads, 2 * self.head_dim, self.rank).split(self.head_dim, dim=1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAccess) -> torch.Tensor:
        t = x.shape[0]
        q_nope, q_rope = self.q_proj(x).view(t, self.num_heads, -1).split([self.head_dim, self.rope], dim=-1)
        w_uk, w_uv = self.up_projections()
        q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), apply_rope(q_rope, cos, sin)], dim=-1)
        out = kv(self.layer, q * self.q_scale, self.latent(x, cos, sin)[:, None, :], None, None)
        return self.o_proj(torch.einsum("thr,hdr->thd", out[..., :self.rank], w_uv).reshape(t, -1))


class SparseAttention(LatentAttention):
    """Latent attention over only the tokens its indexer selects (sparse.py): the KV access is a
    sparse one, called as ``kv(layer, q, latent, index)`` with the indexer's keys and queries of the
    tokens' input embeddings."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.indexer = Indexer(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAccess,
                embeddings: torch.Tensor | None = None) -> torch.Tensor:
        if embeddings is None:
            raise ValueError("a sparse layer needs the tokens' input embeddings (Decoder.run_layers' embeddings)")
        t = x.shape[0]
        q_nope, q_rope = self.q_proj(x).view(t, self.num_heads, -1).split([self.head_dim, self.rope], dim=-1)
        w_uk, w_uv = self.up_projections()
        q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), apply_rope(q_rope, cos, sin)], dim=-1)
        out = kv(self.layer, q * self.q_scale, self.latent(x, cos, sin), self.indexer(embeddings))
        return self.o_proj(torch.einsum("thr,hdr->thd", out[..., :self.rank], w_uv).reshape(t, -1))


class RecurrentMixer(nn.Module):
    """A Mamba2/SSD-style token mixer, simplified: in_proj gives each token's convolved channels
    (key, query and value, state_heads x state_dim each), a step size per head and an output gate;
    a causal depthwise convolution of conv_width (conv1d) runs over the channels, then per head
    ``S_t = a_t S_{t-1} + k_t^T v_t`` and ``y_t = q_t S_t`` with a decay ``a_t = exp(-0.1 *
    softplus(dt_t + dt_bias) * exp(A_log))`` (keys L2-normalized). A request's state after t
    tokens is the convolution's last conv_width - 1 inputs ``[conv_width - 1, channels]`` and S
    ``[heads, state_dim, state_dim]`` (float32); `scan` runs a segment of tokens from a state, in
    the closed (quadratic) form, and gives the state after it; `step` runs one token of each of a
    batch of sequences (a decode step)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.dim, self.width = layer, cfg.state_heads, cfg.state_dim, cfg.conv_width
        self.channels = cfg.conv_channels
        self.in_proj = nn.Linear(cfg.hidden, self.channels + self.heads + self.heads * self.dim, bias=False)
        self.conv1d = nn.Parameter(torch.empty(self.channels, cfg.conv_width))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.out_proj = nn.Linear(self.heads * self.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, states: StateAccess) -> torch.Tensor:
        return self.out_proj(states(self, self.in_proj(x)).to(x.dtype))

    def _mix(self, windows: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per token, from its convolution window [..., channels, conv_width] and step sizes [...,
        heads]: its key (L2-normalized), query (scaled) and value, [..., heads, state_dim] each, and
        its log decay [..., heads]."""
        conv = (windows * self.conv1d.float()).sum(-1)
        k, q, v = F.silu(conv).unflatten(-1, (3, self.heads, self.dim)).unbind(-3)
        log_decay = -0.1 * F.softplus(dt + self.dt_bias.float()) * self.A_log.float().exp()
        return F.normalize(k, dim=-1), q * self.dim ** -0.5, v, log_decay

    def _split(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj rows -> the convolved channels, the step sizes and the output gate (float32)."""
        return u.float().split([self.channels, self.heads, self.heads * self.dim], dim=-1)

    def step(self, u: torch.Tensor, conv0: torch.Tensor, s0: torch.Tensor
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One token of each of B sequences (in_proj rows u [B, ...]) from their states (conv0 [B,
        conv_width - 1, channels], s0 [B, heads, state_dim, state_dim]): the gated outputs [B, heads
        * state_dim] and the states after the token. The same as `scan` of one token."""
        xc, dt, z = self._split(u)
        padded = torch.cat([conv0.float(), xc[:, None]], dim=1)  # [B, w, channels]
        k, q, v, log_decay = self._mix(padded.transpose(1, 2), dt)
        s = log_decay.exp()[:, :, None, None] * s0.float() + k[..., :, None] * v[..., None, :]
        y = torch.einsum("bhn,bhnm->bhm", q, s)
        return y.flatten(1) * F.silu(z), (padded[:, 1:], s)

    def scan(self, u: torch.Tensor, conv0: torch.Tensor, s0: torch.Tensor, at: Sequence[int] = ()
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """One request's segment of T tokens (their in_proj rows u) from the state (conv0, s0):
        the gated outputs [T, heads * state_dim] (float32), the state after the segment, and the
        state after its first m tokens for each m in ``at`` (1 <= m <= T)."""
        t, h, n, w = u.shape[0], self.heads, self.dim, self.width
        xc, dt, z = self._split(u)
        padded = torch.cat([conv0.float(), xc])  # [w - 1 + T, channels]
        k, q, v, log_decay = self._mix(padded.unfold(0, w, 1), dt)
        decay = log_decay.cumsum(0)  # [T, h]
        causal = torch.ones(t, t, dtype=torch.bool, device=u.device).tril()[:, :, None]
        weights = torch.where(causal, decay[:, None, :] - decay[None, :, :], -torch.inf).exp()  # [t, s, h]
        y = torch.einsum("tsh,shm->thm", torch.einsum("thn,shn->tsh", q, k) * weights, v)
        y = y + decay.exp()[:, :, None] * torch.einsum("thn,hnm->thm", q, s0.float())
        gated = (y.reshape(t, h * n) * F.silu(z))

        def after(m: int) -> tuple[torch.Tensor, torch.Tensor]:
            keep = (decay[m - 1][None, :] - decay[:m]).exp()  # [m, h]
            s = decay[m - 1].exp()[:, None, None] * s0.float() + torch.einsum("sh,shn,shm->hnm", keep, k[:m], v[:m])
            return padded[m:m + w - 1], s

        return gated, after(t), [after(m) for m in at]


class DenseState:
    """No cache: one whole sequence from the initial (all-zero) state. The reference the pooled
    path (state_access.py) matches."""

    def __call__(self, mixer: RecurrentMixer, u: torch.Tensor) -> torch.Tensor:
        conv0 = u.new_zeros(mixer.width - 1, mixer.channels, dtype=torch.float32)
        s0 = u.new_zeros(mixer.heads, mixer.dim, mixer.dim, dtype=torch.float32)
        return mixer.scan(u, conv0, s0)[0]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        if cfg.layer_groups[layer] is GroupKind.STATE:
            self.mixer = RecurrentMixer(cfg, layer)
        else:
            kind = {"mla": LatentAttention, "sparse": SparseAttention}.get(cfg.attention, Attention)
            self.self_attn = kind(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAccess,
                states: StateAccess | None = None, embeddings: torch.Tensor | None = None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "mixer"):
            x = x + self.mixer(h, states)
        elif isinstance(self.self_attn, SparseAttention):
            x = x + self.self_attn(h, cos, sin, kv, embeddings)
        else:
            x = x + self.self_attn(h, cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        freqs = torch.rand(cfg.hidden, generator=torch.Generator().manual_seed(cfg.seed + 1)) + 0.5
        self.register_buffer("adapter_freqs", freqs, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAccess,
                context_keys: torch.Tensor | None = None, states: StateAccess | None = None) -> torch.Tensor:
        x = self.embed(input_ids, context_keys)
        return self.norm(self.run_layers(x, positions, kv, states, embeddings=x))

    def embed(self, input_ids: torch.Tensor, context_keys: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states [T, hidden] the first layer reads."""
        x = self.embed_tokens(input_ids)
        if context_keys is not None:  # sin(0) = 0: no context, no offset
            x = x + (0.5 * torch.sin(context_keys.float()[:, None] * self.adapter_freqs[None, :])).to(x.dtype)
        return x

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv: KVAccess,
                   states: StateAccess | None = None, embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """Every decoder layer over hidden states x (a pipeline stage runs its own layers);
        embeddings: the tokens' input embeddings, which a sparse model's indexers read."""
        cos, sin = rope_cos_sin(positions, self.cfg.rope_dim, self.cfg.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin, kv, states, embeddings)
        return x


class CausalLM(nn.Module):
    """Built on CPU with seeded random weights (normal, std = fan_in ** -0.5; norms 1), in
    cfg.dtype; move it with ``.to(device)``. kv_codec: how its KV is stored (cfg.kv_dtype); with FP8
    KV (or FP4), its per-layer K and V scales are buffers (float32, seeded; `kv_scales`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        gen = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if "norm" not in name:
                    p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        self.to(cfg.dtype).requires_grad_(False)
        self.kv_codec = make_codec(cfg.kv_dtype, cfg.dtype, cfg.kv_head_dim)
        scales = (seeded_scales(cfg.num_layers, cfg.scale_width, cfg.attention in LATENT, cfg.seed + 2)
                  if cfg.kv_quantized else ScaleInputs(None, None))
        self.register_buffer("k_scales", scales.k, persistent=False)  # after the cast: float32
        self.register_buffer("v_scales", scales.v, persistent=False)

    @property
    def kv_scales(self) -> ScaleInputs | None:
        """The scales its FP8 or FP4 KV is stored with, ``[num_layers, W]`` each (None: KV not quantized)."""
        return None if self.k_scales is None else ScaleInputs(self.k_scales, self.v_scales)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAccess,
                context_keys: torch.Tensor | None = None, states: StateAccess | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] of the new tokens (context_keys: one per token; states:
        the recurrent mixers' states, a hybrid model's)."""
        return self.model(input_ids, positions, kv, context_keys, states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def logits_without_cache(self, token_ids: torch.Tensor, context_key: int = 0) -> torch.Tensor:
        """Logits [T, vocab] of one whole sequence, recomputed with no KV cache at all."""
        positions = torch.arange(token_ids.numel(), device=token_ids.device)
        contexts = torch.full_like(positions, context_key)
        states = DenseState() if self.cfg.attention == "hybrid" else None
        kv = (DenseSparseKV(positions, self.cfg.index_topk) if self.cfg.attention == "sparse"
              else DenseKV(positions, self.kv_codec, self.kv_scales))
        return self.compute_logits(self(token_ids, positions, kv, contexts, states))
