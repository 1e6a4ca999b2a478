"""The canary of a quantized pool's dequantization scales (the SCALES group): per layer and half,
the scales attention multiplies the stored K and V by, per KV head or per tensor.

Scales are data: a scale corrupted, reset to 1.0 or taken from another layer dequantizes every
token of the layer wrongly, and no KV byte changes. The guard keeps the scales the pool held when
the canary attached (static scales, loaded with the weights) as the group's records, an exact copy
(a few floats a layer), and compares bit for bit:

- HEAD: the scales the forward will use (`ForwardView.scales`, the tensors its attention reads)
  against the guarded ones, before the forward reads KV: a path that runs with 1.0, or with another
  layer's scales, is a `verify_scale` at that layer before its samples are used.
- SWEEP: the scales the pool holds against the guarded ones (damage to scales no forward read yet).

A violation's slot is the layer (its row in the scale buffers), its position the KV head (0 for a
per-tensor scale), its row -1, stored and expected the two scales' float32 bits.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvcanary_kernels.records import GroupKind, Half, Phase, launch_tag

from .seam_data import ForwardView, PoolGroup


class ScaleGuard:
    """Guards one SCALES group. verify: the runtime's `verify_scales` (kernel or reference)."""

    def __init__(self, pool: PoolGroup, verify: Callable) -> None:
        assert pool.kind is GroupKind.SCALES
        self.pool = pool
        self.buffers = {Half.K: pool.k_layers[0], **({Half.V: pool.v_layers[0]} if pool.v_layers else {})}
        self.guarded = {half: buffer.detach().clone() for half, buffer in self.buffers.items()}
        self._verify = verify
        self.tags = {(phase, half): launch_tag(phase, half, GroupKind.SCALES)
                     for phase in (Phase.HEAD, Phase.SWEEP) for half in self.buffers}

    def phase_tags(self, phase: Phase) -> list[int]:
        """The launches a forward (HEAD) or a sweep (SWEEP) makes: one a half."""
        return [self.tags[phase, half] for half in self.buffers]

    def used(self, view: ForwardView) -> dict[Half, torch.Tensor]:
        """The scales the view says its forward uses, per half."""
        if view.scales is None:
            raise ValueError("ForwardView.scales is None: an engine with a SCALES group hands each forward's "
                             "dequantization scales over in the view (ScaleInputs)")
        used = {Half.K: view.scales.k, Half.V: view.scales.v}
        for half in self.buffers:
            if used[half] is None:
                raise ValueError(f"ForwardView.scales.{half.name.lower()} is None; the SCALES group guards "
                                 f"{', '.join(h.name for h in self.buffers)} scales")
        return {half: used[half] for half in self.buffers}

    def verify(self, view: ForwardView, ring) -> None:
        """HEAD: each layer's scales the forward will use are its guarded scales."""
        for half, scales in self.used(view).items():
            self._verify(scales, self.guarded[half], ring, self.tags[Phase.HEAD, half])

    def sweep(self, ring) -> None:
        """SWEEP: the scales the pool holds are the guarded ones. Device work only."""
        for half, buffer in self.buffers.items():
            self._verify(buffer, self.guarded[half], ring, self.tags[Phase.SWEEP, half])
