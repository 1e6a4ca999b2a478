"""What the historic-bug scenarios share: a small reference engine with the canary attached, the
no-cache truth a damaged KV read is measured against, and the canary's first reports.

The canary runs the torch reference kernels on a CPU (bit-identical to the Triton ones, which the
kernel tests check) and the Triton kernels where CUDA is present. The sweep is off: every report
here comes from the per-forward checks.
"""

from __future__ import annotations

import torch

from pytest_kvcanary.canary.runtime import CanaryRuntime
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig, Request
from pytest_kvcanary.reference_engine.attention import DenseKV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "torch"
WINDOW = 4
# (phase, half, group, reasons, slot, position, row) of one violation.
Report = tuple[str, str, str, tuple[str, ...], int, int, int]


def make_engine(attention: str = "mha", **engine_kw: object) -> Engine:
    """A 4-layer model on seeded random weights, window 4 (swa: layers 0 and 2 windowed); engine_kw:
    EngineConfig fields (pages, a host tier, speculative decoding, pool sizes)."""
    model = ModelConfig(attention=attention, window=WINDOW, max_context=64, seed=0)
    engine_kw.setdefault("max_batch_tokens", 64)
    return Engine(EngineConfig(model=model, device=DEVICE, **engine_kw))


def attach_canary(engine: Engine, **settings: object) -> CanaryRuntime:
    """A canary on every forward of the engine: every check on, real-KV fingerprints over whole
    slots, no sweep (unless settings say otherwise)."""
    settings = {"real_data": "all", "sweep_interval": 0, **settings}
    runtime = CanaryRuntime(CanaryConfig(**{"kernels": KERNELS, **settings}), engine)
    engine.set_forward_hooks(runtime)
    return runtime


def tokens(seed: int, n: int) -> list[int]:
    """n seeded token ids in [1, 256) (never 0, the token padding lanes feed)."""
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reports(halves: tuple[str, ...], phases: tuple[str, ...], group: str, reasons: tuple[str, ...],
            places: list[tuple[int, int, int]]) -> set[Report]:
    """The reports a damage should produce: each (slot, position, row) place, on each half and phase."""
    return {(phase, half, group, reasons, slot, position, row)
            for phase in phases for half in halves for slot, position, row in places}


def first_reports(runtime: CanaryRuntime) -> tuple[int | None, set[Report]]:
    """The step of the earliest violation the canary logged and everything it reported at that
    step; (None, set()) when it logged nothing."""
    runtime.drain()
    violations = runtime.log.violations
    if not violations:
        return None, set()
    step = min(v.step for v in violations)
    return step, {(v.phase, v.half, v.group, v.reasons, v.slot, v.position, v.row)
                  for v in violations if v.step == step}


class _RecordingKV(DenseKV):
    """No cache, keeping each layer's K and V."""

    def __init__(self, positions: torch.Tensor) -> None:
        super().__init__(positions)
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None) -> torch.Tensor:
        self.kv[layer] = (k, v)
        return super().__call__(layer, q, k, v, window)


@torch.no_grad()
def kv_off_reference(engine: Engine, req: Request) -> set[tuple[str, int]]:
    """(group, position) of every position whose K or V, as the request's next forward would read
    it through its mapping (FULL layers: [0, kv_len); windowed layers: the last `window`; with
    speculative decoding, the draft model's layers: [0, kv_len)), differs from what a forward of
    its tokens at their positions with no cache at all computes. Independent of the canary."""
    n = req.kv_len
    positions = torch.arange(n, device=engine.device)
    ids = torch.tensor(req.token_ids[:n], device=engine.device)
    table = engine.req_to_token_pool.read(req.row, 0, n).to(engine.device)
    models = [(engine.model, engine.pools.layer)]
    if engine.drafter is not None:
        models.append((engine.drafter.model, engine.pools.draft.layer))
    off = set()
    for model, layer_kv in models:
        recording = _RecordingKV(positions)
        model(ids, positions, recording, torch.full_like(positions, req.context_key))
        for layer, computed in recording.kv.items():
            buf = layer_kv(layer)
            start = 0 if buf.slot_map is None else max(0, n - WINDOW)
            slots = table[start:n] if buf.slot_map is None else buf.slot_map[table[start:n]]
            for truth, pool in zip(computed, (buf.k, buf.v)):
                close = torch.isclose(pool[slots], truth[start:n], rtol=1e-3, atol=1e-4).flatten(1).all(1)
                off |= {(buf.group.name, start + i) for i in (~close).nonzero().flatten().tolist()}
    return off


@torch.no_grad()
def off_greedy_reference(engine: Engine, req: Request) -> bool:
    """True when some output token is not the argmax of a no-cache forward over the prompt and the
    outputs before it, in the request's context."""
    ids = torch.tensor(req.prompt_ids + req.output_ids[:-1], device=engine.device)
    logits = engine.model.logits_without_cache(ids, req.context_key)
    return logits.argmax(-1)[len(req.prompt_ids) - 1:].tolist() != req.output_ids


def owner_of(engine: Engine, slot: int) -> tuple[Request, int]:
    """The running request whose cached prefix maps position p to this FULL slot, and p."""
    table = engine.req_to_token_pool
    found = [(req, p) for req in engine.running for p, at in enumerate(table.read(req.row, 0, req.kv_len).tolist())
             if at == slot]
    assert len(found) == 1, f"slot {slot} is in {len(found)} running requests' KV"
    return found[0]
