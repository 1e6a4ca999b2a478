"""The scale check (a SCALES group's HEAD and SWEEP) against its torch reference, on fresh random
scales with random damage: the same rows, counters and reasons, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvcanary_kernels import ViolationRing, verify_scales, verify_scales_ref
from kvcanary_kernels.records import (
    COL_EXPECTED, COL_POSITION, COL_REASONS, COL_ROW, COL_SLOT, COL_STORED, Reason, launch_tag, Phase, Half, GroupKind,
)

from kv_world import DEVICE

TAG = launch_tag(Phase.HEAD, Half.V, GroupKind.SCALES)


def _damaged(seed: int, layers: int, width: int) -> tuple[torch.Tensor, torch.Tensor, set[tuple[int, int]]]:
    """Guarded scales, a copy with a few entries damaged (a flipped bit, 1.0, another layer's row),
    and the (layer, head) entries that differ."""
    g = torch.Generator().manual_seed(seed)
    guarded = 0.01 + 0.01 * torch.rand(layers, width, generator=g)
    found = guarded.clone()
    bit = int(torch.randint(31, (), generator=g))
    found.view(torch.int32)[int(torch.randint(layers, (), generator=g)), 0] ^= 1 << bit
    found[int(torch.randint(layers, (), generator=g)), width - 1] = 1.0
    found[layers - 1] = guarded[0]
    diff = (found.view(torch.int32) != guarded.view(torch.int32)).nonzero().tolist()
    return found.to(DEVICE), guarded.to(DEVICE), {(a, b) for a, b in diff}


@pytest.mark.parametrize("seed,layers,width", [(1, 4, 1), (2, 6, 4), (3, 40, 32)])
def test_the_kernel_and_its_reference_log_the_same_rows(seed, layers, width):
    found, guarded, diff = _damaged(seed, layers, width)
    rings = {}
    for name, launch in (("kernel", verify_scales), ("reference", verify_scales_ref)):
        ring = rings[name] = ViolationRing(256, DEVICE)
        launch(found, guarded, ring, TAG)
        launch(guarded, guarded, ring, TAG)  # clean: counted, nothing logged
    kernel, ref = (sorted(map(tuple, r.rows[:int(r.count)].tolist())) for r in rings.values())
    assert kernel == ref and len(kernel) == len(diff) > 0
    assert {(row[COL_SLOT], row[COL_POSITION]) for row in kernel} == diff
    for row in kernel:
        assert row[COL_REASONS] == Reason.VERIFY_SCALE and row[COL_ROW] == -1
        layer, head = row[COL_SLOT], row[COL_POSITION]
        assert row[COL_STORED] == found[layer, head].view(torch.int32).item() & 0xFFFFFFFF
        assert row[COL_EXPECTED] == guarded[layer, head].view(torch.int32).item() & 0xFFFFFFFF
    for ring in rings.values():
        assert int(ring.kernel_runs[TAG]) == 2 and int(ring.slot_runs[TAG]) == 2 * layers


@pytest.mark.parametrize("case,message", [
    ("dtype", "scales must be a contiguous float32 tensor [num_layers, W]; got torch.float16"),
    ("shape", "scales has shape (3, 2); the guarded scales (4, 2)"),
    ("strided", "guarded must be a contiguous float32 tensor"),
])
def test_bad_scale_args_raise_naming_the_argument(case, message):
    ring = ViolationRing(8, DEVICE)
    guarded = torch.ones(4, 2, device=DEVICE)
    scales = {"dtype": guarded.half(), "shape": guarded[:3].clone(), "strided": guarded}[case]
    if case == "strided":
        guarded = torch.ones(2, 4, device=DEVICE).t()
    for launch in (verify_scales, verify_scales_ref):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            launch(scales, guarded, ring, TAG)
