"""What the fault-injection tests share: reference-engine handles, a workload, and a record of
what each forward's HEAD reads.

Runs that sweep many seeds use the torch reference kernels on a CPU (bit-identical to the Triton
ones, which the kernel tests check) and the Triton kernels where CUDA is present.
"""

from __future__ import annotations

import random

import torch

from pytest_kvcanary.adapters.reference import make_reference_engine
from pytest_kvcanary.canary.readout import GroupReadout
from pytest_kvcanary.canary.seam import ForwardView
from pytest_kvcanary.config import PERTURB_MODES, SCALE_MODES, CanaryConfig
from pytest_kvcanary.handles.sided import Side
from pytest_kvcanary.handles.single import EngineHandle
from pytest_kvcanary.perturb.targets import read_targets

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The modes that damage attention KV (state_wrong_restore damages a hybrid model's recurrent state:
# test_state_faults.py and examples/test_hybrid.py; the scale modes FP8 KV's scales: test_scale_faults.py;
# index_stale a sparse attention's selection: test_index_faults.py).
KV_MODES = tuple(mode for mode in PERTURB_MODES
                 if mode not in ("state_wrong_restore", "index_stale") and mode not in SCALE_MODES)
SEED_SWEEP_KERNELS = "triton" if DEVICE == "cuda" else "torch"
# The pool groups of each attention kind.
POOL_GROUPS = {"mha": ("full",), "swa": ("full", "swa"), "mla": ("full",)}
# The seed sweep also runs an mha engine decoding speculatively (k = 3), whose draft pool is a group,
# and one with pages of 4 tokens and a host tier behind a pool that prompts overflow ("host").
SEED_SWEEP_ENGINES = {**POOL_GROUPS, "speculative": ("full", "draft"), "host": ("full",)}
HOST_ENGINE = {"page_size": 4, "num_slots": 128, "host_num_slots": 1024, "max_running": 4}
BYTE_TOKENS = 256  # prompt tokens below this; first tokens above it, one per request of a run
LATENCY_PROPERTY = "detection_latency"


def group_name(group: GroupReadout) -> str:
    return group.kind.name.lower()


def make_handle(attention: str, **canary: object) -> EngineHandle:
    """A fresh reference engine (window 16, roomy pools) with the canary on; "speculative": mha
    decoding speculatively with 3 draft tokens per step; "host": mha with a host tier (HOST_ENGINE);
    "hybrid": recurrent layers beside full attention (groups full and state); "hybrid-host": that
    with a host tier (HOST_ENGINE); "fp8": mha storing its KV in FP8 (groups full and scales);
    "sparse": sparse attention (groups full and indexer)."""
    options = {"speculative": {"speculative_k": 3}, "host": HOST_ENGINE, "hybrid-host": HOST_ENGINE,
               "fp8": {"kv_dtype": "fp8_e4m3"}}.get(attention, {})
    kind = attention if attention in POOL_GROUPS or attention in ("hybrid", "sparse") else (
        "hybrid" if attention == "hybrid-host" else "mha")
    engine = make_reference_engine(kind, DEVICE, seed=0, **options)
    return EngineHandle(engine, CanaryConfig(**{"kernels": SEED_SWEEP_KERNELS, **canary}))


def send_waves(handle: EngineHandle, seed: int, waves: int = 3, per_wave: int = 4, longest_output: int = 7) -> None:
    """Waves of distinct prompts of 5-24 tokens, 3 to longest_output new tokens each. Each prompt
    opens with a token of its own, so no request reuses another's cached prefix: a wave's KV stays
    in the radix cache, unlocked and read by nothing but the sweep, while the next wave runs. On an
    engine with a host tier each wave also sends two earlier requests' whole sequences again, with a
    token more: their pages, written back to host memory meanwhile, are loaded back."""
    rng = random.Random(seed)
    sent: list[list[int]] = []
    host = handle.engine.host_tier is not None
    for wave in range(waves):
        prompts = [[BYTE_TOKENS + wave * per_wave + i]
                   + [rng.randrange(BYTE_TOKENS) for _ in range(rng.randrange(4, 24))] for i in range(per_wave)]
        again = [seq + [rng.randrange(BYTE_TOKENS)] for seq in rng.sample(sent, min(2, len(sent)))] if host else []
        outputs = handle.generate(prompts + again, max_new_tokens=rng.randrange(3, longest_output + 1))
        sent += [p + o[:-1] for p, o in zip(prompts, outputs)]


def final_sweep(handle: EngineHandle) -> None:
    """One more sweep once every request finished: the engine then holds nothing outside the radix
    cache, so any damage not freed yet is read before the run ends."""
    handle.side.runtime.sweep()
    handle.side.runtime.drain()


class HeadReads:
    """A runtime observer, after the fault injector: the slots each forward's HEAD reads, per
    pool group ("full", "swa"); steps[i] is forward i of the run."""

    def __init__(self, side: Side) -> None:
        self.groups = side.runtime.readout().kv_groups
        self.steps: list[dict[str, set[int]]] = []
        side.runtime.observers.append(self)

    def before_forward(self, view: ForwardView) -> None:
        self.steps.append({group_name(g): {t.slot for t in read_targets(view, g)} for g in self.groups})

    def after_stamp(self, view: ForwardView) -> None:
        pass

    def first_read(self, group: str, slot: int, since: int) -> int | None:
        """The first forward from `since` on whose HEAD reads this slot of the group."""
        return next((step for step in range(since, len(self.steps)) if slot in self.steps[step][group]), None)
