"""The workload soak over the engine configurations we ship: seeded workloads run until a forward
count (or a time limit) is reached, one row per configuration with its verdict counts.

    python benchmarks/soak.py --configs reference-mha-eager transformers-mha-sync-eager --forwards 20000
    python benchmarks/soak.py --list
    python benchmarks/soak.py --table run1.jsonl run2.jsonl   # runs of one configuration add up

Engines are built small so that the workloads press them (the radix cache evicts, the scheduler
retracts or offloads). On a CPU the canary runs the kernels' torch references (bit-identical to the
Triton kernels), on a GPU the Triton kernels. A configuration the machine cannot run (CUDA graphs
on a CPU, an engine whose package is missing) is reported as skipped. `--json` gets one line per
seed as it ends, so a run stopped part way keeps every seed it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import atexit
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from pytest_kvcanary.config import CanaryConfig  # noqa: E402
from pytest_kvcanary.handles.pd import PDHandle  # noqa: E402
from pytest_kvcanary.handles.single import EngineHandle  # noqa: E402
from pytest_kvcanary.soak.verdicts import VERDICTS  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda:0" if CUDA else "cpu"


def _reference(attention: str, decode_mode: str = "eager", speculative_k: int = 0, page_size: int = 1,
               host_num_slots: int = 0, num_state_slots: int = 64, disk: bool = False, jitter: bool = False,
               async_scheduling: bool = False, kv_dtype: str = "auto", **shape: int) -> Any:
    """The soak's reference engine; ``shape``: ModelConfig fields besides the defaults (head_dim, ...)."""
    from pytest_kvcanary.reference_engine import Engine, EngineConfig, ModelConfig

    model = ModelConfig(attention=attention, window=16, full_every=2, max_context=256, seed=0, kv_dtype=kv_dtype,
                        kv_scale="head", **shape)
    return Engine(EngineConfig(model=model, num_slots=512, swa_num_slots=256, max_running=8, max_batch_tokens=512,
                               device=DEVICE, decode_mode=decode_mode, speculative_k=speculative_k,
                               draft_layers=2 if attention == "hybrid" else 1,
                               page_size=page_size, host_num_slots=host_num_slots, num_state_slots=num_state_slots,
                               disk_dir=_scratch_dir() if disk else None, jitter_seed=0 if jitter else None,
                               async_scheduling=async_scheduling))


def _scratch_dir() -> str:
    """A directory for a disk tier's files, removed when the soak exits."""
    path = tempfile.mkdtemp(prefix="kvcanary-soak-disk-")
    atexit.register(shutil.rmtree, path, True)
    return path


def _transformers(attention: str, batching: str, graphs: str) -> Any:
    from pytest_kvcanary.adapters.transformers_cb import TransformersEngine, load, random_checkpoint

    model, tokenizer = load(random_checkpoint(attention, 0), DEVICE)
    return TransformersEngine(model, tokenizer, page_size=16, num_blocks=48, max_batch_tokens=256,
                              max_requests_per_batch=8, max_context=512, use_cuda_graph=graphs == "graphs",
                              use_async_batching=batching == "async")


def _vllm(attention: str) -> Any:
    from pytest_kvcanary.adapters.vllm.checkpoint import random_checkpoint
    from pytest_kvcanary.adapters.vllm.engine import VllmEngine, VllmSettings

    # Pools small enough to evict; a hybrid model's 64-token blocks hold attention pages and states alike.
    blocks = {"mha": 24, "swa": 34, "mla": 34}.get(attention)
    settings = VllmSettings(**({} if blocks is None else {"num_blocks": blocks}), device="cuda" if CUDA else "cpu")
    return VllmEngine(random_checkpoint(attention, 0), 0, settings)


class Config(NamedTuple):
    """A soak configuration: what builds its handle's engine or PD pair, why this machine cannot run
    it (None: it can), and the liveness counters its workloads must move (`liveness_gate`)."""

    build: Callable[[], Any]
    why: str | None = None
    requires: tuple[str, ...] = ()


def configurations() -> dict[str, Config]:
    """name -> Config. Every reference configuration must reuse a cached prefix; one with a host tier
    must load pages back from it, with a disk tier from disk, with speculative decoding reject a
    proposal (roll back), a pair transfer (a hybrid model's checkpoint restores are the canary's
    own count, `state_restores`)."""
    configs: dict[str, Config] = {}
    hits = ("prefix hits",)
    for attention in ("mha", "swa", "mla", "hybrid"):
        for mode in ("eager", "padded", "graph"):
            configs[f"reference-{attention}-{mode}"] = Config(
                lambda a=attention, m=mode: _reference(a, m), None if mode != "graph" or CUDA else "needs CUDA", hits)
    for attention in ("mha", "mla", "hybrid"):
        configs[f"reference-{attention}-speculative"] = Config(
            lambda a=attention: _reference(a, speculative_k=3), None, hits + ("rejected proposals",))
    for attention in ("mha", "swa", "hybrid"):
        configs[f"reference-pd-{attention}"] = Config(
            lambda a=attention: ("pd", _reference(a), _reference(a)), None, hits + ("transfers",))
    for attention in ("mha", "swa", "mla"):  # pages of 16 tokens
        configs[f"reference-{attention}-pages"] = Config(lambda a=attention: _reference(a, page_size=16), None, hits)
    # A hybrid model's checkpoints in a state pool that evicts them (17 slots: 8 running requests, 8
    # checkpoints being written, one to spare), with pages of 16 tokens, and with a host tier too.
    configs["reference-hybrid-state-pressure"] = Config(lambda: _reference("hybrid", num_state_slots=17), None, hits)
    configs["reference-hybrid-pages"] = Config(lambda: _reference("hybrid", page_size=16), None, hits)
    configs["reference-hybrid-host"] = Config(lambda: _reference("hybrid", page_size=16, host_num_slots=1024), None,
                                              hits + ("host loads",))
    for attention in ("mha", "mla"):  # pages and a host-memory tier, with and without speculative decoding
        configs[f"reference-{attention}-host"] = Config(
            lambda a=attention: _reference(a, page_size=16, host_num_slots=1024), None, hits + ("host loads",))
        configs[f"reference-{attention}-speculative-host"] = Config(
            lambda a=attention: _reference(a, speculative_k=3, page_size=16, host_num_slots=1024), None,
            hits + ("host loads", "rejected proposals"))
    # Seeded timing jitter (jitter_seed 0, restarted by each seed's reset): load-backs acknowledged
    # late and out of order; a pair's transfers held back and reordered.
    configs["reference-mha-host-jitter"] = Config(
        lambda: _reference("mha", page_size=16, host_num_slots=1024, jitter=True), None, hits + ("host loads",))
    configs["reference-pd-mha-jitter"] = Config(
        lambda: ("pd", _reference("mha", jitter=True), _reference("mha")), None, hits + ("transfers",))
    # Async scheduling: each step launched before the one before it is processed (in a pair, the
    # decode side; graph decode needs CUDA).
    configs["reference-mha-host-async"] = Config(
        lambda: _reference("mha", page_size=16, host_num_slots=1024, async_scheduling=True), None,
        hits + ("host loads",))
    configs["reference-swa-padded-async"] = Config(lambda: _reference("swa", "padded", async_scheduling=True), None,
                                                   hits)
    configs["reference-mha-graph-async"] = Config(lambda: _reference("mha", "graph", async_scheduling=True),
                                                  None if CUDA else "needs CUDA", hits)
    configs["reference-pd-mha-async"] = Config(
        lambda: ("pd", _reference("mha"), _reference("mha", async_scheduling=True)), None, hits + ("transfers",))
    # Async scheduling with seeded jitter: each launched step's forward runs at a drawn point (at
    # launch, once the step before it is processed, or when waited for), load-backs are acknowledged
    # late and out of order, a pair's transfers held back and reordered; the workloads' rounds of
    # pauses hold requests mid-decode meanwhile.
    configs["reference-mha-host-async-jitter"] = Config(
        lambda: _reference("mha", page_size=16, host_num_slots=1024, jitter=True, async_scheduling=True), None,
        hits + ("host loads", "pauses"))
    configs["reference-pd-mha-async-jitter"] = Config(
        lambda: ("pd", _reference("mha", jitter=True), _reference("mha", jitter=True, async_scheduling=True)), None,
        hits + ("transfers",))
    # On a GPU the jitter also spins inside each forward, around the canary's phases, captured in
    # the decode graphs with them.
    configs["reference-mha-graph-async-jitter"] = Config(
        lambda: _reference("mha", "graph", page_size=16, host_num_slots=1024, jitter=True, async_scheduling=True),
        None if CUDA else "needs CUDA", hits + ("host loads", "pauses"))
    # Speculative decoding under async scheduling: each decode launched before the speculative one
    # in flight is processed, moved back on the device by the proposals that one rejected.
    configs["reference-mha-spec-async-jitter"] = Config(
        lambda: _reference("mha", speculative_k=3, jitter=True, async_scheduling=True), None,
        hits + ("rejected proposals", "in-flight rollbacks", "pauses"))
    # Each side in a process of its own, the KV moved by torch.distributed sends (gloo on the CPU;
    # NCCL on two GPUs), the records with it (docs/pd-processes.md).
    for attention in ("mha", "mla"):
        configs[f"reference-pd-processes-{attention}"] = Config(
            lambda a=attention: ("pd-processes", a), "needs two GPUs" if CUDA and torch.cuda.device_count() < 2
            else None, hits + ("transfers",))
    # Quantized KV (FP8 with per-head scales; FP4 in NVFP4 blocks), with pages and a host tier.
    configs["reference-mha-fp8"] = Config(
        lambda: _reference("mha", page_size=16, host_num_slots=1024, kv_dtype="fp8_e4m3"), None, hits + ("host loads",))
    configs["reference-mla-fp4"] = Config(lambda: _reference("mla", "padded", kv_dtype="fp4_e2m1"), None, hits)
    # MXFP4 (a power-of-two scale per 32 values), so heads and latent rows of a multiple of 32 values.
    configs["reference-mha-mxfp4"] = Config(lambda: _reference("mha", kv_dtype="mxfp4", head_dim=32), None, hits)
    configs["reference-mla-mxfp4"] = Config(
        lambda: _reference("mla", "padded", kv_dtype="mxfp4", kv_lora_rank=48), None, hits)
    # Sparse attention (DeepSeek-V3.2-style: each query attends to the 16 tokens its indexer selects,
    # fewer than most contexts hold), with pages: the indexer keys guarded as a group, every selection checked.
    configs["reference-sparse"] = Config(lambda: _reference("sparse", page_size=16), None, hits)
    # A disk tier under a small host tier (16 pages of 16 tokens), so host memory evicts to disk.
    # Not hybrid: the disk tier keeps no checkpoints.
    for attention in ("mha", "mla"):
        configs[f"reference-{attention}-disk"] = Config(
            lambda a=attention: _reference(a, page_size=16, host_num_slots=256, disk=True), None,
            hits + ("host loads", "disk loads"))
    for attention in ("mha", "swa"):
        for batching in ("sync", "async"):
            for graphs in ("eager", "graphs"):
                why = None if CUDA or (batching, graphs) == ("sync", "eager") else "needs CUDA"
                configs[f"transformers-{attention}-{batching}-{graphs}"] = Config(
                    lambda a=attention, b=batching, g=graphs: _transformers(a, b, g), why)
    for attention in ("mha", "swa", "mla", "hybrid"):
        configs[f"vllm-{attention}"] = Config(lambda a=attention: _vllm(a))
    return configs


def soak_canary(real_data: str) -> CanaryConfig:
    """The canary every soak runs: a sweep every 4 forwards, the Triton kernels on a GPU, their
    torch references on a CPU."""
    return CanaryConfig(real_data=real_data, sweep_interval=4, kernels="triton" if CUDA else "torch")


def _handle(engine: Any, canary: CanaryConfig) -> tuple[Any, Any]:
    """The handle, and the engine or pair it drives (whose `liveness()` counts, where it has one)."""
    if isinstance(engine, tuple) and engine[0] == "pd-processes":  # the pair's own liveness counts
        from pytest_kvcanary.handles.pd_processes import start_pd_processes

        handle = start_pd_processes(engine[1], 0, canary, ["cuda:0", "cuda:1"] if CUDA else ["cpu"],
                                    num_slots=512, swa_num_slots=256)
        return handle, handle
    if isinstance(engine, tuple):
        from pytest_kvcanary.reference_engine.pd import PDPair

        pair = PDPair(engine[1], engine[2])
        return PDHandle(pair, canary), pair
    return EngineHandle(engine, canary), engine


def soak(name: str, build: Callable[[], Any], forwards: int, seconds: float, rounds: int, seed: int,
         real_data: str, arrivals: bool, on_seed: Callable[[dict[str, Any]], None],
         requires: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Seeds from `seed` on, `rounds` rounds each, until `forwards` forwards or `seconds` passed; one
    row per seed, each handed to `on_seed` as it ends (`merge` adds them up);
    arrivals: requests join running batches where the engine serves them (else generate batches);
    requires: the liveness counters the configuration must move (each row keeps them, `liveness_gate`)."""
    handle, target = _handle(build(), soak_canary(real_data))
    counters = getattr(target, "liveness", None)
    rows: list[dict[str, Any]] = []
    start = time.monotonic()
    while sum(r["forwards"] for r in rows) < forwards and time.monotonic() - start < seconds:
        began = time.monotonic()
        before = counters() if counters is not None else {}
        handle.reset(seed, ())
        result = handle.run_workload(seed=seed, rounds=rounds, arrivals=arrivals)
        data = result.to_json()
        after = counters() if counters is not None else {}
        # a hybrid model's liveness (a cross-process pair runs none, and its sides are in its processes)
        restores = handle.sides[0].runtime.readout().state_restores() if hasattr(handle, "sides") else None
        rows.append({"config": name + ("" if arrivals else " (batches)"),
                     "device": torch.cuda.get_device_name() if CUDA else "cpu", "real_data": real_data,
                     "seeds": [seed], "rounds": data["rounds"], "forwards": data["forwards"],
                     "near_ties": data["near_ties"], "verdicts": {**dict.fromkeys(VERDICTS, 0), **data["verdicts"]},
                     "failures": [{"seed": seed, **f} for f in data["failures"]],
                     "untrusted_rounds": [{"seed": seed, **r} for r in data["untrusted_rounds"][:4]],
                     "seconds": round(time.monotonic() - began, 1),
                     **({} if restores is None else {"state_restores": restores}),
                     **({"liveness": {k: n - before.get(k, 0) for k, n in after.items()}, "requires": list(requires)}
                        if counters is not None else {}),
                     "versions": {m: sys.modules[m].__version__ for m in ("torch", "transformers", "vllm")
                                  if m in sys.modules}})
        on_seed(rows[-1])
        print(f"  {name} seed {seed}: {result.summary()}", flush=True)
        for line in result.describe_failures():
            print(f"    {line}", flush=True)
        seed += 1
    handle.close()
    return rows


def merge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of one configuration and data mode added up, in first-seen order (a row per seed, or per
    run as earlier runs wrote them; the devices and engine versions they ran on listed); a seed
    counted twice is an error."""
    merged: dict[tuple[str, ...], dict[str, Any]] = {}
    for r in rows:
        if "skipped" in r:
            merged.setdefault((r["config"], "skipped"), r)
            continue
        key = (r["config"], r["real_data"])
        if key not in merged:
            merged[key] = {**r, "seeds": list(r["seeds"]), "verdicts": dict(r["verdicts"]),
                           **({"liveness": dict(r["liveness"])} if "liveness" in r else {}),
                           "failures": list(r["failures"]), "versions": dict(r.get("versions", {}))}
            continue
        m = merged[key]
        if twice := set(m["seeds"]) & set(r["seeds"]):
            raise ValueError(f"{r['config']}: seed {min(twice)} appears in two rows; each run needs seeds of its own")
        m["seeds"] += r["seeds"]
        if r["device"] not in m["device"].split(" + "):
            m["device"] += " + " + r["device"]
        for name, version in r.get("versions", {}).items():
            if version not in m["versions"].get(name, "").split(" + "):
                m["versions"][name] = m["versions"][name] + " + " + version if name in m["versions"] else version
        for field in ("rounds", "forwards", "near_ties", "seconds"):
            m[field] = round(m[field] + r[field], 1)
        if "state_restores" in r:
            m["state_restores"] = m.get("state_restores", 0) + r["state_restores"]
        if "liveness" in r:
            m["liveness"] = {k: m.get("liveness", {}).get(k, 0) + r["liveness"].get(k, 0)
                             for k in {*m.get("liveness", {}), *r["liveness"]}}
            m["requires"] = sorted({*m.get("requires", ()), *r.get("requires", ())})
        for verdict, n in r["verdicts"].items():
            m["verdicts"][verdict] = m["verdicts"].get(verdict, 0) + n
        m["failures"] += r["failures"]
    return list(merged.values())


def seed_ranges(seeds: list[int]) -> str:
    """[0, 1, 2, 1000, 1001] -> '0..2, 1000..1001'."""
    spans: list[list[int]] = []
    for s in sorted(seeds):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in spans) or "-"


def liveness_gate(row: dict[str, Any]) -> list[str]:
    """What the configuration should have exercised and did not: a required liveness counter at 0,
    or a hybrid model's checkpoint restores at 0 (the canary's count)."""
    idle = [f"no {name}" for name in row.get("requires", ()) if not row.get("liveness", {}).get(name)]
    if row.get("state_restores") == 0:
        idle.append("no checkpoint restored")
    return idle


def liveness(row: dict[str, Any]) -> str:
    """The liveness column: FAILED and what is missing (`liveness_gate`), else the counts (a hybrid
    model's checkpoint restores first); "-" where nothing is counted."""
    if idle := liveness_gate(row):
        return "FAILED: " + ", ".join(idle)
    counts = [f"{row['state_restores']} checkpoint restores"] if "state_restores" in row else []
    counts += [f"{n} {name}" for name, n in sorted(row.get("liveness", {}).items()) if n]
    return ", ".join(counts) or "-"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows merged (`merge`); time is the seconds of every run added up."""
    lines = ["| configuration | device | real_data | seeds | rounds | forwards | clean | engine defect | "
             "damage detected | damage missed | suspected false alarms | near ties | liveness | time |",
             "|" + "---|" * 14]
    for r in merge(rows):
        if "skipped" in r:
            lines.append(f"| {r['config']} | skipped: {r['skipped']} |" + " |" * 12)
            continue
        v = r["verdicts"]
        seeds = seed_ranges(r["seeds"])
        engine = ", ".join(f"{k} {v}" for k, v in r.get("versions", {}).items() if k != "torch")
        device = f"{r['device']} ({engine})" if engine else r["device"]
        lines.append(f"| {r['config']} | {device} | {r['real_data']} | {seeds} | {r['rounds']} | {r['forwards']} | "
                     f"{v['clean']} | {v['engine defect']} | {v['damage detected']} | {v['damage missed']} | "
                     f"{v['suspected false alarm']} | "
                     f"{r['near_ties']} | {liveness(r)} | {r['seconds']} s |")
    return "\n".join(lines)


def main() -> int:
    configs = configurations()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=[], metavar="NAME", help="configurations to soak")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--forwards", type=int, default=20000, help="forwards per configuration (default 20000)")
    parser.add_argument("--seconds", type=float, default=1e9, help="time limit per configuration")
    parser.add_argument("--rounds", type=int, default=30, help="rounds per seed (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--real-data", default="partial", choices=("none", "partial", "all"))
    parser.add_argument("--batches", action="store_true",
                        help="submit each round's requests in generate batches (no request joins a running batch)")
    parser.add_argument("--json", help="write the rows to this file (JSON lines)")
    parser.add_argument("--table", nargs="+", metavar="FILE", help="print the table of rows these JSON lines files hold")
    args = parser.parse_args()
    if args.table:
        try:
            print(table([json.loads(line) for name in args.table for line in open(name) if line.strip()]))
        except ValueError as e:
            parser.error(f"--table: {e}")
        return 0
    if args.list:
        for name, config in configs.items():
            needs = f"  [must show: {', '.join(config.requires)}]" if config.requires else ""
            print(name + (f"  ({config.why})" if config.why else "") + needs)
        return 0
    if unknown := [c for c in args.configs if c not in configs]:
        parser.error(f"unknown configuration {unknown[0]!r}; --list shows them")
    rows: list[dict[str, Any]] = []

    def keep(row: dict[str, Any]) -> None:
        rows.append(row)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    for name in args.configs:
        config = configs[name]
        if config.why is not None:
            keep({"config": name, "skipped": config.why})
            continue
        try:
            soak(name, config.build, args.forwards, args.seconds, args.rounds, args.seed, args.real_data,
                 not args.batches, keep, config.requires)
        except ImportError as e:
            keep({"config": name, "skipped": f"{type(e).__name__}: {e}"})
    print(table(rows))
    bad = sum(r["verdicts"]["damage missed"] + r["verdicts"]["suspected false alarm"] for r in rows if "verdicts" in r)
    idle = [f"{r['config']} ({', '.join(gaps)})" for r in merge(rows) if (gaps := liveness_gate(r))]
    if idle:
        print(f"liveness gate: {'; '.join(idle)}", file=sys.stderr)
    return 1 if bad or idle else 0


if __name__ == "__main__":
    sys.exit(main())
