"""What the canary costs a transformers continuous-batching decode step, eager and with CUDA graphs.

    python benchmarks/bench_transformers.py                     # the table (GPU)
    python benchmarks/bench_transformers.py --shape llama3-8b --graphs on --batches 1 32 --runs 3
    python benchmarks/bench_transformers.py --model /path/to/checkpoint --batches 8 32
    python benchmarks/bench_transformers.py --smoke             # tiny model, any device (checks the script)

The engine is pytest-kvcanary's transformers adapter (SDPA attention, synchronous batching) over a
random bf16 model of TinyLlama-1.1B's shape (22 layers, 32 heads, 4 KV heads x 64 dims) or of
Llama-3-8B's (32 layers, 32 heads, 8 KV heads x 128 dims), no download, or a local checkpoint.
Per batch size B: B requests of a PROMPT-token prompt each generate NEW tokens together; every
forward whose rows all decode one token is a decode step.

Per (B, use_cuda_graph, real_data): the median wall time of a decode step (transformers'
_generation_step, which ends by synchronising with the device, so the time covers the device
work) with the canary off (no hooks) and on (the CanaryRuntime with the Triton kernels: HEAD,
RECHECK and TAIL every step over the FULL group, real_data as given, token checks on, the sweep
every SWEEP steps, the violation log drained as the runtime's drain_interval says; with CUDA
graphs the canary's per-forward work replays from graphs of its own, canary_graphs=True). Host
ms is the host wall time the canary adds to a decode step (mapping the batch, launching or
replaying its work, end_forward's sweep and drain), the mean over steps. Each configuration is
measured `--runs` times (off, then on, each after one warm-up generation, over `--repeats`
generations); the table shows the median run and the spread (min..max) of the cost over runs.
The canary-on runs must report no violation. Without CUDA graphs the step is host-bound Python
and its time moves between runs by more than the canary costs (benchmarks/RESULTS.md): compare
the graph rows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pytest_kvcanary.adapters.transformers_cb import TransformersEngine, load
from pytest_kvcanary.adapters.byte_tokenizer import byte_tokenizer
from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.handles.single import EngineHandle

PROMPT, NEW, SWEEP = 512, 64, 16
TOKENS = dict(pad_token_id=256, bos_token_id=257, eos_token_id=258)
SHAPES = {
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096, **TOKENS),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
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


class StepTimer:
    """Wraps the processor's (already guarded) generation step: wall seconds of each decode step,
    and the host seconds the canary's work around it took in that step."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.engine, self.processor = engine, engine.processor
        self.step = self.processor._generation_step
        self.processor._generation_step = self
        self.decode: list[float] = []
        self.host: list[float] = []
        self._canary = 0.0
        for name in ("_canary_before", "_canary_after"):
            setattr(engine, name, self._timed(getattr(engine, name)))

    def _timed(self, work: Any) -> Any:
        def timed(*args: Any) -> None:
            start = time.perf_counter()
            work(*args)
            self._canary += time.perf_counter() - start
        return timed

    def __call__(self, model: Any) -> None:
        decoding = all(f.query_length == 1 for f in self.processor.inputs_and_outputs.requests_in_batch)
        self._canary = 0.0
        start = time.perf_counter()
        self.step(model)
        if decoding:
            self.decode.append(time.perf_counter() - start)
            self.host.append(self._canary)

    def close(self) -> None:
        self.processor._generation_step = self.step
        for name in ("_canary_before", "_canary_after"):
            delattr(self.engine, name)


def run(engine: TransformersEngine, batch: int, prompt: int, new: int, repeats: int) -> tuple[float, float]:
    """(median decode-step ms, mean canary host ms per decode step) over `repeats` generations of
    `batch` fresh prompts, after one that warms up."""
    timer = StepTimer(engine)
    gen = torch.Generator().manual_seed(batch)
    for repeat in range(repeats + 1):
        if repeat == 1:
            timer.decode.clear()
            timer.host.clear()
        engine.generate(torch.randint(0, 256, (batch, prompt), generator=gen).tolist(), max_new_tokens=new)
    timer.close()
    return 1e3 * statistics.median(timer.decode), 1e3 * statistics.mean(timer.host)


def measure(engine: TransformersEngine, batch: int, real_data: str, kernels: str, prompt: int, new: int,
            repeats: int) -> tuple[float, float, float]:
    """One run: (off ms, on ms, canary host ms) per decode step."""
    off, _ = run(engine, batch, prompt, new, repeats)
    handle = EngineHandle(engine, CanaryConfig(real_data=real_data, sweep_interval=SWEEP), kernels)
    handle.reset(0, ())
    on, host = run(engine, batch, prompt, new, repeats)
    handle.side.runtime.drain()
    assert not handle.violations(), handle.violations()[:3]
    handle.close()
    return off, on, host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face checkpoint directory (default: a random model, --shape)")
    parser.add_argument("--shape", default="tinyllama", choices=sorted(SHAPES))
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8, 32])
    parser.add_argument("--real-data", nargs="*", default=["partial"], choices=["none", "partial", "all"])
    parser.add_argument("--graphs", default="both", choices=["on", "off", "both"])
    parser.add_argument("--runs", type=int, default=1, help="measurements per configuration (spread shown)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations per measurement")
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 1 repeat, any device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.smoke:
        raise SystemExit("bench_transformers.py needs a CUDA device (or --smoke)")
    prompt, new = (24, 8) if args.smoke else (PROMPT, NEW)
    if args.smoke:
        args.batches, args.repeats = [2], 1
    model, tokenizer = load(args.model, device) if args.model else random_model(device, args.shape, args.smoke)
    import transformers

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    described = args.model or ("random tiny" if args.smoke else SHAPE_NAMES[args.shape])
    print(f"device: {name}  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"model: {described} {model.dtype}  prompt {prompt} + {new} new tokens  runs {args.runs} x {args.repeats} "
          f"generations")
    print("| batch | cuda graphs | real_data | canary off ms/step | canary on ms/step | cost ms | cost % "
          "| cost % min..max | host ms/step |")
    print("|---:|---|---|---:|---:|---:|---:|---|---:|")
    graph_modes = {"on": [True], "off": [False], "both": [False, True]}[args.graphs] if device == "cuda" else [False]
    kernels = "triton" if device == "cuda" else "torch"
    for batch in args.batches:
        for use_cuda_graph in graph_modes:
            engine = TransformersEngine(model, tokenizer, page_size=64, num_blocks=batch * (prompt + new) // 64 + 16,
                                        max_batch_tokens=max(2048, batch), max_requests_per_batch=batch,
                                        max_context=prompt + new, use_cuda_graph=use_cuda_graph,
                                        canary_graphs=use_cuda_graph)
            for real_data in args.real_data:
                runs = [measure(engine, batch, real_data, kernels, prompt, new, args.repeats) for _ in range(args.runs)]
                costs = sorted(100 * (on - off) / off for off, on, _ in runs)
                off, on, host = (statistics.median(column) for column in zip(*runs))
                print(f"| {batch} | {'on' if use_cuda_graph else 'off'} | {real_data} | {off:.3f} | {on:.3f} | "
                      f"{on - off:.3f} | {statistics.median(costs):.1f}% | {costs[0]:.1f}..{costs[-1]:.1f}% | "
                      f"{host:.3f} |", flush=True)
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
