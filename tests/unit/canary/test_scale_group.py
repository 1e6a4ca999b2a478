"""A SCALES PoolGroup as an adapter declares it: what the seam accepts and what it refuses, naming
the field."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcanary.canary.seam import GroupKind, PoolGroup, SlotMapping


def _scales(layers: int = 4, width: int = 2, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((layers, width), 0.01, dtype=dtype)


def test_a_scales_group_is_one_buffer_a_half_with_a_slot_a_layer():
    group = PoolGroup(GroupKind.SCALES, [_scales()], [_scales()], 4, None)
    assert group.page_size == 1
    latent = PoolGroup(GroupKind.SCALES, [_scales(width=1)], [], 4, None)  # no V: a latent pool
    assert latent.v_layers == []
    assert PoolGroup(GroupKind.SCALES, [_scales(layers=1)], [], 1, None).num_slots == 1  # no slot is reserved


@pytest.mark.parametrize("case,message", [
    ("mapping", "PoolGroup.mapping must be None for a SCALES group; got SlotMapping"),
    ("two buffers", "a SCALES PoolGroup has one k_layers buffer, at most one v_layers buffer and no window; got 2, 1"),
    ("float16", r"a SCALES PoolGroup's k_layers\[0\] must be a contiguous float32 \[num_slots=4, W\] tensor; got "
                r"torch.float16 of shape \(4, 2\)"),
    ("rows", r"a SCALES PoolGroup's v_layers\[0\] must be a contiguous float32 \[num_slots=4, W\] tensor; got "
             r"torch.float32 of shape \(3, 2\)"),
    ("strided", r"a SCALES PoolGroup's k_layers\[0\] must be a contiguous float32"),
])
def test_a_malformed_scales_group_is_refused_naming_the_field(case, message):
    k, v, mapping = [_scales()], [_scales()], None
    if case == "mapping":
        mapping = SlotMapping(torch.zeros(1, 1, dtype=torch.int64))
    elif case == "two buffers":
        k = [_scales(), _scales()]
    elif case == "float16":
        k = [_scales(dtype=torch.float16)]
    elif case == "rows":
        v = [_scales(layers=3)]
    else:
        k = [_scales(layers=2, width=4).t()]
    with pytest.raises(ValueError, match=message):
        PoolGroup(GroupKind.SCALES, k, v, 4, mapping)
