"""The SCALES group over an FP8 KV cache's dequantization scales (docs/quantized.md): per attention
layer, the static per-tensor K and V scales vLLM loaded with the weights (W = 1; slot i: the i-th
attention layer, in the order vLLM registered their KV caches).

vLLM keeps each layer's scales twice: as tensors (``_k_scale`` / ``_v_scale``, which vLLM's CUDA
FP8 backends read) and as host floats (``_k_scale_float`` / ``_v_scale_float``), which vLLM's CPU
attention hands its ops at every cache write (``cpu_attn_reshape_and_cache``) and every read
(``cpu_attention_with_kv_cache``).

- The pool: vLLM's scale tensors, made rows of the group's two float32 ``[num_layers, 1]``
  buffers (each layer's ``_k_scale`` becomes a view of its row; put back on close). SWEEP checks
  what they hold.
- The view: the floats each layer holds when the forward starts (the model's pre-hook), copied
  into two buffers of the same shape: what the forward's ops receive. HEAD checks them before the
  forward reads KV, so a scale reset to 1.0 or another layer's is a ``verify_scale`` at that layer.
- Fed back: once HEAD ran, a view scale that differs from the layer's float (a fault the perturb
  injector put into the view) is written into that float for this forward only (`restore` after
  it), as `VllmEngine.feed_token` feeds a token: what HEAD checked is what the ops receive.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_kvcanary.canary.seam import GroupKind, PoolGroup, ScaleInputs

from ..patches import Patches

HALVES = (("_k_scale", "_k_scale_float"), ("_v_scale", "_v_scale_float"))  # (tensor, float) per half


class KvScales:
    """The SCALES group of these attention layers (vLLM Attention modules on a CPU_ATTN FP8
    cache), its pool tensors installed into the layers through `patches`."""

    def __init__(self, layers: list[Any], patches: Patches) -> None:
        backends = {layer.attn_backend.get_name() for layer in layers}
        if backends != {"CPU_ATTN"}:
            raise NotImplementedError(f"the adapter guards an FP8 KV cache on vLLM's CPU_ATTN backend; this model runs "
                                      f"{', '.join(sorted(backends))}")
        self.layers = layers
        self.pool = tuple(torch.tensor([[getattr(layer, f)] for layer in layers], dtype=torch.float32)
                          for _, f in HALVES)
        for i, layer in enumerate(layers):
            for (tensor, _), pool in zip(HALVES, self.pool):
                held = getattr(layer, tensor)
                if held.numel() != 1 or float(held) != float(pool[i, 0]):
                    raise RuntimeError(f"vLLM's layer {i} holds {tensor} {held.tolist()} and a float of "
                                       f"{float(pool[i, 0])}: the adapter guards one static scale a half")
                setattr(layer, tensor, pool[i].view(held.shape))
                patches.on_uninstall(lambda layer=layer, tensor=tensor, held=held: setattr(layer, tensor, held))
        self.group = PoolGroup(GroupKind.SCALES, [self.pool[0]], [self.pool[1]], len(layers), None)
        self._used = tuple(torch.empty_like(p) for p in self.pool)
        self._fed: list[tuple[Any, str, float]] = []  # (layer, float attribute, what it held) to put back
        patches.on_uninstall(self.restore)

    def inputs(self) -> ScaleInputs:
        """The scales the forward now starting hands its ops: each layer's floats, read now."""
        for (_, name), used in zip(HALVES, self._used):
            used.copy_(torch.tensor([[getattr(layer, name)] for layer in self.layers], dtype=torch.float32))
        return ScaleInputs(*self._used)

    def feed(self) -> None:
        """After HEAD: each layer's floats become the view's scales for this forward (only where
        they differ)."""
        for (_, name), used in zip(HALVES, self._used):
            for layer, scale in zip(self.layers, used[:, 0].tolist()):
                held = getattr(layer, name)
                if scale != held:
                    self._fed.append((layer, name, held))
                    setattr(layer, name, scale)

    def restore(self) -> None:
        """After the forward: the floats `feed` changed hold again what they held."""
        for layer, name, held in reversed(self._fed):
            setattr(layer, name, held)
        self._fed.clear()
