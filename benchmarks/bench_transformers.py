"""What the canary costs a transformers continuous-batching decode step, eager and with CUDA graphs.

    python benchmarks/bench_transformers.py                     # the table (GPU)
    python benchmarks/bench_transformers.py --shape llama3-8b --graphs on --batches 1 32 --runs 3
    python benchmarks/bench_transformers.py --model /path/to/checkpoint --batches 8 32
    python benchmarks/bench_transformers.py --batching async --graphs on --batches 1 32 --runs 3
    python benchmarks/bench_transformers.py --shape llama3-8b --batches 64 128 --prefill 8x16384 --runs 3
    python benchmarks/bench_transformers.py --shape llama3-8b --graphs on --batches 32 --real-data partial all --kernel-times
    python benchmarks/bench_transformers.py --smoke             # tiny model, any device (checks the script)

The engine is pytest-kvcanary's transformers adapter (SDPA attention, synchronous batching, or
transformers' async batching with --batching async) over a
random bf16 model of TinyLlama-1.1B's shape (22 layers, 32 heads, 4 KV heads x 64 dims) or of
Llama-3-8B's (32 layers, 32 heads, 8 KV heads x 128 dims), no download, or a local checkpoint.
Per batch size B: B requests of a PROMPT-token prompt each generate NEW tokens together; a
decode step is a forward whose B rows all decode one token.

Per (B, use_cuda_graph, real_data): the median wall time of a decode step (transformers'
_generation_step, which ends by synchronising with the device, so the time covers the device work)
with the canary off (no hooks) and on (the CanaryRuntime with the Triton kernels: HEAD, RECHECK and
TAIL every step over the FULL group, real_data as given, token checks on, the sweep every SWEEP
steps, the violation log drained as the runtime's drain_interval says; with CUDA graphs the canary's
per-forward work is captured inside transformers' own graphs and replays with them,
canary_graphs=True). Host us is the host wall time the canary adds to a decode step, the mean over
steps, and where it goes (PHASES): map (the model runner's compute_batch, which the engine wraps,
less the forward, the end_forward and the defect notes inside: the batch's bookkeeping into the
staged buffer and the rest of the wrapper), defect notes (transformers 5.17: the slots each forward
writes in blocks it hashed, noted as the engine's defect; nothing from 5.18), head (the view's
derivation and HEAD launched from the model's forward pre-hook: 0 in a replayed forward), tail (the
forward's inputs, RECHECK and TAIL, likewise), end_forward (counting, the sweep every SWEEP steps,
the log drain; the engine calls it right after launching the forward, so with CUDA graphs it
overlaps the device's work, but it is counted in full), prompts ahead (the next forwards' prompt
tokens converted once the forward is launched, likewise) and block log (noting hashed blocks and
forgetting freed ones, in update_batch after the step and in the next batch's preparation). The KV
cache is sized for B requests to decode together (the bench stops when transformers split most of
the batch's decode steps). Each configuration is measured `--runs` times (off, then on, each after
one warm-up generation, over `--repeats` generations); the table shows the median run and the spread
(min..max) over runs of the cost and of the host time (its phases: each phase's median). The
canary-on runs must report no violation. Without CUDA graphs the step is host-bound Python and its
time moves between runs by more than the canary costs (benchmarks/RESULTS.md): compare the graph
rows. Under async batching a step returns before the device finishes it (the host prepares the next
batch meanwhile), so a decode step's time is the interval from its start to the next step's start,
the pace the loop settles at.

--kernel-times: after each decode row, each kernel the canary adds a decode step, its device time
and launches (a generation of NEW tokens minus one of NEW / 8 under torch.profiler, each after one that
warms up and captures; canary off and on; with CUDA graphs the replayed kernels are counted, not the
gaps between them). Kernel time is steadier than a step's wall time, so it compares real_data modes
where step times cannot (on a CPU, --smoke: each op's own CPU time).

Prefill (--prefill BxP): the time to first token of B fresh prompts of P tokens submitted together
(a generation of one new token each, from submitting to the last token read back), canary off and
on, chunked as transformers chunks prompts into forwards of at most PREFILL_CHUNK tokens; eager, as
engines run prefill (CUDA graphs capture decode steps). A cell's engine first runs one unmeasured
run at its full shape (warm_prefill). One short generation warms each side up, then, with the
canary, one sweep (the first plans, compiles and captures: once an engine). A run measures
off then on, the next on then off (a drift over the runs lands on both sides); the cost is paired:
the median over runs of each run's on minus its off (ms and %), with the spread of the %. Where
the host time goes: each side's prefill forwards timed by phase (PHASES, as for a decode step),
the canary's addition on minus off, summed over the prefill; a forward's wait for the device lands
in map on both sides (the step ends by synchronising), so map's difference is mostly the device's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, TypeVar

import torch

from pytest_kvcanary.adapters.transformers_cb import TransformersEngine, load
from pytest_kvcanary.adapters.byte_tokenizer import byte_tokenizer
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.handles.single import EngineHandle

T = TypeVar("T")
PROMPT, NEW, SWEEP = 512, 64, 16
PREFILL_CHUNK = 8192  # tokens per prefill forward (SGLang's default chunked-prefill size on large GPUs)
TOKENS = dict(pad_token_id=256, bos_token_id=257, eos_token_id=258)
SHAPES = {
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768, **TOKENS),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                      rope_theta=500000.0, **TOKENS),
}
SHAPE_NAMES = {"tinyllama": "random TinyLlama-1.1B shape", "llama3-8b": "random Llama-3-8B shape"}


def random_model(device: str, shape_name: str, smoke: bool) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SHAPES[shape_name])
    if smoke:
        shape.update(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in bf16 directly: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(default)
    return model.eval(), byte_tokenizer()


def blocks(batch: int, tokens: int) -> int:
    """KV blocks of 64 tokens for `batch` requests of `tokens` each to decode as one batch (with
    one block a request fewer, transformers splits batch 32's decode steps in two, 29 + 3 requests
    with 5.17)."""
    return batch * (-(-tokens // 64) + 2) + 16


PHASES = ("map", "defect notes", "head", "tail", "end_forward", "prompts ahead", "block log")


class StepTimer:
    """Wraps the processor's generation step: wall seconds of each decode step, and where the host
    seconds the canary adds to that step go (PHASES): map (the model runner's compute_batch, which
    the engine wraps, less the forward, the end_forward and the defect notes it runs: mapping the
    batch into the staged buffer and what else the wrapper does), the defect notes (5.17), the
    view's derivation and HEAD launched from the model's forward (_head; not called in a replayed
    forward), the forward's inputs, RECHECK
    and TAIL (_tail), the runtime's end_forward (counting, the sweep every SWEEP steps, the log
    drain), the prompts converted ahead after it, and the block log noting hashed blocks and
    forgetting freed ones (in update_batch after the step and in the next batch's preparation;
    counted with the step). phases False: the step's time only (nothing inside it wrapped, so
    the canary-on side pays for no timer of its own)."""

    def __init__(self, engine: TransformersEngine, batch: int, phases: bool = True) -> None:
        self.engine, self.processor, self.batch = engine, engine.processor, batch
        self.step = self.processor._generation_step
        self.processor._generation_step = self
        self.decode: list[float] = []
        self.host: list[dict[str, float]] = []  # per decode step: host seconds per phase
        self.other: list[dict[str, float]] = []  # per other step (synchronous batching: a prefill's forwards)
        self._phases: dict[str, float] = {}
        self._async = bool(engine._io.pairs)
        self._decoding_since: float | None = None  # async: when the decode step in flight started
        self._previous_phases: dict[str, float] = {}
        forward, hooks = engine._forward, engine._forward.hooks
        runner = self.processor.model_runner
        self._wrapped = [(runner, "compute_batch", "map"), (forward, "_compute", "map", -1), (forward, "_head", "head"),
                         (forward, "_tail", "tail"), (engine.block_log, "note", "block log"),
                         (engine.block_log, "forget", "block log")]
        notes = forward.staging.hashed_writes  # called inside compute_batch too
        self._wrapped += [(notes, "note", "map", -1), (notes, "note", "defect notes")]
        if hooks is not None:  # called inside compute_batch: out of map, into its own phase
            self._wrapped += [(hooks, "end_forward", "map", -1), (hooks, "end_forward", "end_forward")]
        self._wrapped += [(forward.staging, "ahead", "map", -1), (forward.staging, "ahead", "prompts ahead")]
        if not phases:
            self._wrapped = []
        self._saved = {(id(obj), name): (obj, name, vars(obj).get(name))  # instance attributes
                       for obj, name, *_ in self._wrapped}.values()
        for obj, name, phase, *sign in self._wrapped:
            setattr(obj, name, self._timed(getattr(obj, name), phase, *sign))

    def _timed(self, work: Any, phase: str, sign: int = 1) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = work(*args, **kwargs)
            self._phases[phase] = self._phases.get(phase, 0.0) + sign * (time.perf_counter() - start)
            return result
        return timed

    def __call__(self, model: Any) -> None:
        batch = self.engine.batch_requests()
        decoding = len(batch) == self.batch and all(f.query_length == 1 for f in batch)
        self._phases = {}  # this step's, its update_batch's and the next preparation's (block log)
        start = time.perf_counter()
        self.step(model)
        if self._async:  # the previous decode step lasted until this one started
            if self._decoding_since is not None and decoding:
                self.decode.append(start - self._decoding_since)
                self.host.append(self._previous_phases)
            self._decoding_since, self._previous_phases = (start if decoding else None), self._phases
        elif decoding:
            self.decode.append(time.perf_counter() - start)
            self.host.append(self._phases)
        else:
            self.other.append(self._phases)

    def generation_done(self) -> None:
        self._decoding_since = None

    def close(self) -> None:
        self.processor._generation_step = self.step
        for obj, name, saved in self._saved:
            if saved is None:
                delattr(obj, name)
            else:
                setattr(obj, name, saved)


def run(engine: TransformersEngine, batch: int, prompt: int, new: int, repeats: int,
        warmup: bool = True, phases: bool = True) -> tuple[float, dict[str, float]]:
    """(median decode-step ms, mean canary host us per decode step by phase) over `repeats`
    generations of `batch` fresh prompts, after one that warms up (none with warmup False);
    phases False: no phase timed (StepTimer), the host times all 0."""
    timer = StepTimer(engine, batch, phases)
    gen = torch.Generator().manual_seed(batch)
    for repeat in range(repeats + warmup):
        if repeat == 1 and warmup:
            timer.decode.clear()
            timer.host.clear()
        engine.generate(torch.randint(0, 256, (batch, prompt), generator=gen).tolist(), max_new_tokens=new)
        timer.generation_done()
    timer.close()
    if len(timer.decode) < repeats * new // 2:
        raise RuntimeError(f"{len(timer.decode)} decode steps ran all {batch} requests in {repeats} generations of "
                           f"{new} tokens: transformers split the batch (too few KV blocks?)")
    host = {phase: 1e6 * statistics.mean(step.get(phase, 0.0) for step in timer.host) for phase in PHASES}
    return 1e3 * statistics.median(timer.decode), host


def per_step(short: dict[str, list[float]], long: dict[str, list[float]], steps: int
             ) -> dict[str, tuple[float, float]]:
    """Per kernel name: (us, launches) a step of the `steps` decode steps a long generation runs past
    a short one, from each one's kernel durations by name."""
    return {name: ((sum(long.get(name, ())) - sum(short.get(name, ()))) / steps,
                   (len(long.get(name, ())) - len(short.get(name, ()))) / steps) for name in {*short, *long}}


def kernel_steps(engine: TransformersEngine, batch: int, prompt: int, new: int) -> dict[str, tuple[float, float]]:
    """Per kernel name, (device us, launches) a decode step: a generation of `new` tokens minus one of
    new // 8, each profiled (torch.profiler; a CUDA graph's kernels included) after one of each that
    warms up (captures). On a CPU: each op's own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    prompts = torch.randint(0, 256, (batch, prompt), generator=torch.Generator().manual_seed(batch)).tolist()

    def durations(tokens: int) -> dict[str, list[float]]:
        synchronize(engine.device)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as profiler:
            engine.generate(prompts, max_new_tokens=tokens)
            synchronize(engine.device)
        found: dict[str, list[float]] = {}
        for event in profiler.events():
            if cuda == (event.device_type == torch.autograd.DeviceType.CUDA):
                found.setdefault(event.name, []).append(event.device_time if cuda else event.self_cpu_time_total)
        return found

    short = max(1, new // 8)
    for tokens in (short, new):
        engine.generate(prompts, max_new_tokens=tokens)
    return per_step(durations(short), durations(new), new - short)


def added(off: dict[str, tuple[float, float]], on: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Per kernel name, on minus off (a name one side lacks counts 0 there)."""
    none = (0.0, 0.0)
    return {name: (on.get(name, none)[0] - off.get(name, none)[0], on.get(name, none)[1] - off.get(name, none)[1])
            for name in {*off, *on}}


def print_kernel_times(by_kernel: dict[str, tuple[float, float]], what: str, rows: int = 16) -> None:
    """The kernels the canary adds a decode step (``added``), largest first; the total over those
    that move by at least 0.5 us or 0.05 launches a step."""
    shown = sorted(((us, n, name) for name, (us, n) in by_kernel.items() if abs(us) >= 0.5 or abs(n) >= 0.05),
                   reverse=True)
    print(f"kernels the canary adds a decode step, {what}: {sum(us for us, _, _ in shown):+.1f} us, "
          f"{sum(n for _, n, _ in shown):+.1f} launches")
    print("| kernel | us a step | launches a step |\n|---|---:|---:|")
    for us, n, name in shown[:rows]:
        print(f"| {name[:80]} | {us:+.1f} | {n:+.1f} |")


def measure(engine: TransformersEngine, batch: int, real_data: str, kernels: str, prompt: int, new: int,
            repeats: int) -> tuple[float, float, dict[str, float]]:
    """One run: (off ms, on ms, canary host us by phase) per decode step."""
    off, _ = run(engine, batch, prompt, new, repeats)
    on, host = with_canary(engine, real_data, kernels, lambda _: run(engine, batch, prompt, new, repeats))
    return off, on, host


def with_canary(engine: TransformersEngine, real_data: str, kernels: str, work: Callable[[EngineHandle], T]) -> T:
    """work(handle)'s result with the canary attached to the engine around it, then detached (the
    engine stays open: a handle's close() would close it). The canary must have seen the work's
    forwards and report nothing."""
    handle = EngineHandle(engine, CanaryConfig(real_data=real_data, sweep_interval=SWEEP, kernels=kernels))
    handle.reset(0, ())
    result = work(handle)
    handle.side.runtime.drain()
    engine.set_forward_hooks(None)
    assert not handle.violations(), handle.violations()[:3]
    assert handle.side.runtime.stats().forwards > 0, "the canary saw none of the forwards it was timed on"
    return result


def time_to_first_token(engine: TransformersEngine, batch: int, prompt: int, seed: int) -> float:
    """Seconds from submitting `batch` fresh prompts of `prompt` tokens to each one's first token."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 256, (batch, prompt), generator=gen).tolist()
    synchronize(engine.device)
    start = time.perf_counter()
    engine.generate(prompts, max_new_tokens=1)
    synchronize(engine.device)
    return time.perf_counter() - start


def measure_prefill(engine: TransformersEngine, batch: int, prompt: int, real_data: str, kernels: str,
                    run: int, breakdown: bool = False) -> tuple[float, float, dict[str, float]]:
    """One run: (off ms, on ms) to the first token, each after its warm-up (the module docstring);
    even runs measure off first, odd runs on first. breakdown: and the host us the canary adds to
    the prefill in each of PHASES (on minus off, summed over its forwards; "forwards": how many
    the on side ran), else {}."""
    host: dict[bool, dict[str, float]] = {}

    def warmed_ms(handle: EngineHandle | None) -> float:
        if handle is None:  # an empty cache, as the handle's reset leaves it (the sides' prompts are the same)
            engine.reset()
        time_to_first_token(engine, 2, min(prompt, PREFILL_CHUNK), seed=-1 - run)
        if handle is not None:
            handle.side.runtime.sweep()
        timer = StepTimer(engine, batch) if breakdown else None
        ms = 1e3 * time_to_first_token(engine, batch, prompt, seed=run)
        if timer is not None:
            timer.close()
            host[handle is not None] = {phase: 1e6 * sum(step.get(phase, 0.0) for step in timer.other)
                                        for phase in PHASES} | {"forwards": len(timer.other)}
        return ms

    if run % 2:
        on = with_canary(engine, real_data, kernels, warmed_ms)
        off = warmed_ms(None)
    else:
        off = warmed_ms(None)
        on = with_canary(engine, real_data, kernels, warmed_ms)
    added = {} if not host else {phase: host[True][phase] - host[False][phase] for phase in PHASES} | {
        "forwards": host[True]["forwards"]}
    return off, on, added


def warm_prefill(engine: TransformersEngine, batch: int, prompt: int, kernels: str) -> None:
    """One unmeasured run of measure_prefill at the full shape, a prefill a mode: each side's own
    warm-up prefills one chunk a prompt, and the first prefill reading past it ran its forwards
    slower (the pair it opened read low)."""
    measure_prefill(engine, batch, prompt, "partial", kernels, -1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_cell(text: str) -> tuple[int, int]:
    """--prefill's BxP: (batch, prompt tokens)."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a cell is BATCHxPROMPT with positive integers, e.g. 32x16384; got {text!r}")
    return int(parts[0]), int(parts[1])


def prefill_engine(model: Any, tokenizer: Any, batch: int, prompt: int) -> TransformersEngine:
    """The engine a prefill cell runs on: room for `batch` prompts of `prompt` tokens and one new
    token each, prompts chunked into forwards of at most PREFILL_CHUNK tokens."""
    return TransformersEngine(model, tokenizer, page_size=64, num_blocks=blocks(batch, prompt + 1),
                              max_batch_tokens=min(prompt, PREFILL_CHUNK), max_requests_per_batch=batch,
                              max_context=prompt + 1)


def decode_engine(model: Any, tokenizer: Any, batch: int, prompt: int, new: int, use_cuda_graph: bool,
                  batching: str) -> TransformersEngine:
    """The engine a decode row runs on. 64 prompt tokens a request a forward (2048 at least): every
    request is prefilled within PROMPT / 64 forwards, and the batch decodes together for most of
    its NEW tokens."""
    return TransformersEngine(model, tokenizer, page_size=64, num_blocks=blocks(batch, prompt + new),
                              max_batch_tokens=max(2048, 64 * batch), max_requests_per_batch=batch,
                              max_context=prompt + new, use_cuda_graph=use_cuda_graph,
                              use_async_batching=batching == "async", canary_graphs=use_cuda_graph)


def prefill_rows(model: Any, tokenizer: Any, cells: list[tuple[int, int]], real_datas: list[str], kernels: str,
                 runs: int) -> None:
    """The prefill table (see the module docstring): per cell and real_data, the median of `runs`."""
    print("| prefill batch x prompt | real_data | canary off ms | canary on ms | cost ms | cost % | cost % min..max "
          "| forwards | host ms the canary adds, by phase (" + ", ".join(PHASES) + "; on - off, median over runs) |")
    print("|---|---|---:|---:|---:|---:|---|---:|---|")
    for batch, prompt in cells:
        engine = prefill_engine(model, tokenizer, batch, prompt)
        warm_prefill(engine, batch, prompt, kernels)
        for real_data in real_datas:
            measured = [measure_prefill(engine, batch, prompt, real_data, kernels, run, breakdown=True)
                        for run in range(runs)]
            costs = sorted(100 * (on - off) / off for off, on, _ in measured)
            off, on = (statistics.median(column) for column in list(zip(*measured))[:2])
            paired_ms = statistics.median(on_ms - off_ms for off_ms, on_ms, _ in measured)
            phases = ", ".join(f"{statistics.median(host[p] for _, _, host in measured) / 1e3:.2f}" for p in PHASES)
            print(f"| {batch}x{prompt} | {real_data} | {off:.1f} | {on:.1f} | {paired_ms:.1f} | "
                  f"{statistics.median(costs):.2f}% | {costs[0]:.2f}..{costs[-1]:.2f}% | "
                  f"{measured[0][2]['forwards']:.0f} | {phases} |", flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face checkpoint directory (default: a random model, --shape)")
    parser.add_argument("--shape", default="tinyllama", choices=sorted(SHAPES))
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8, 32], help="decode batch sizes (none: no decode rows)")
    parser.add_argument("--prefill", nargs="*", type=prefill_cell, default=[], metavar="BxP",
                        help="prefill cells: batch x prompt tokens (time to first token)")
    parser.add_argument("--real-data", nargs="*", default=["partial"], choices=["none", "partial", "all"])
    parser.add_argument("--graphs", default="both", choices=["on", "off", "both"])
    parser.add_argument("--batching", default="sync", choices=["sync", "async"],
                        help="transformers' synchronous or async batching (async: CUDA only)")
    parser.add_argument("--runs", type=int, default=1, help="measurements per configuration (spread shown)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per measurement")
    parser.add_argument("--kernel-times", action="store_true",
                        help="after each decode row, the device time and launches of each kernel the canary adds "
                             "a decode step (torch.profiler, canary off and on)")
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 1 repeat, any device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.smoke:
        raise SystemExit("bench_transformers.py needs a CUDA device (or --smoke)")
    prompt, new = (24, 8) if args.smoke else (PROMPT, NEW)
    if args.smoke:
        args.batches, args.repeats = [2], 1
        args.prefill = args.prefill and [(2, 24)]
    model, tokenizer = load(args.model, device) if args.model else random_model(device, args.shape, args.smoke)
    import transformers

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    described = args.model or ("random tiny" if args.smoke else SHAPE_NAMES[args.shape])
    print(f"device: {name}  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"model: {described} {model.dtype}  prompt {prompt} + {new} new tokens  {args.batching} batching  "
          f"runs {args.runs} x {args.repeats} generations")
    kernels = "triton" if device == "cuda" else "torch"
    if args.prefill:
        prefill_rows(model, tokenizer, args.prefill, args.real_data, kernels, args.runs)
    if not args.batches:
        return
    print("| batch | cuda graphs | real_data | canary off ms/step | canary on ms/step | cost ms | cost % "
          "| cost % min..max | host us/step | host us min..max | "
          + " | ".join(f"{phase} us" for phase in PHASES) + " |")
    print("|---:|---|---|---:|---:|---:|---:|---|---:|---|" + "---:|" * len(PHASES))
    graph_modes = {"on": [True], "off": [False], "both": [False, True]}[args.graphs] if device == "cuda" else [False]
    for batch in args.batches:
        for use_cuda_graph in graph_modes:
            engine = decode_engine(model, tokenizer, batch, prompt, new, use_cuda_graph, args.batching)
            for real_data in args.real_data:
                runs = [measure(engine, batch, real_data, kernels, prompt, new, args.repeats) for _ in range(args.runs)]
                costs = sorted(100 * (on - off) / off for off, on, _ in runs)
                off, on = (statistics.median(column) for column in list(zip(*runs))[:2])
                phases = {phase: statistics.median(host[phase] for _, _, host in runs) for phase in PHASES}
                hosts = sorted(sum(host.values()) for _, _, host in runs)
                print(f"| {batch} | {'on' if use_cuda_graph else 'off'} | {real_data} | {off:.3f} | {on:.3f} | "
                      f"{on - off:.3f} | {statistics.median(costs):.1f}% | {costs[0]:.1f}..{costs[-1]:.1f}% | "
                      f"{sum(phases.values()):.0f} | {hosts[0]:.0f}..{hosts[-1]:.0f} | "
                      + " | ".join(f"{phases[p]:.0f}" for p in PHASES) + " |",
                      flush=True)
                if args.kernel_times:
                    off_kernels = kernel_steps(engine, batch, prompt, new)
                    on_kernels = with_canary(engine, real_data, kernels,
                                             lambda _: kernel_steps(engine, batch, prompt, new))
                    print_kernel_times(added(off_kernels, on_kernels),
                                       f"batch {batch}, graphs {'on' if use_cuda_graph else 'off'}, {real_data}")
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
