"""What the canary costs a transformers continuous-batching decode step, eager and with CUDA graphs.

    python benchmarks/bench_transformers.py                     # the table (GPU)
    python benchmarks/bench_transformers.py --model /path/to/checkpoint --batches 8 32
    python benchmarks/bench_transformers.py --smoke             # tiny model, any device (checks the script)

The engine is pytest-kvcanary's transformers adapter (SDPA attention, synchronous batching) over a
random model of TinyLlama-1.1B's shape in bf16 (22 layers, 32 heads, 4 KV heads x 64 dims; no
download), or a local checkpoint. Per batch size B: B requests of a PROMPT-token prompt each
generate NEW tokens together; every forward whose rows all decode one token is a decode step.

Per (B, use_cuda_graph): the median wall time of a decode step (transformers' _generation_step,
which ends by synchronising with the device, so the time covers the device work) with the canary
off (no hooks) and on (the CanaryRuntime with the Triton kernels: HEAD, RECHECK and TAIL every
step over the FULL group, real_data as given, token checks on, the sweep every SWEEP steps, the
violation log drained as the runtime's drain_interval says). Each configuration runs once to warm
up (Triton compiles, CUDA graphs are captured) and is then timed over `--repeats` generations.
The canary-on runs must report no violation. Without CUDA graphs the step is host-bound Python and
its time moves between runs by more than the canary costs (benchmarks/RESULTS.md): compare the
graph rows.
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
from pytest_kvcanary.harness import EngineHandle

PROMPT, NEW, SWEEP = 512, 64, 16
TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
                 pad_token_id=256, bos_token_id=257, eos_token_id=258)


def random_model(device: str, smoke: bool) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(TINYLLAMA)
    if smoke:
        shape.update(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(dtype)
    return model.eval(), byte_tokenizer()


class StepTimer:
    """Wraps the processor's (already guarded) generation step: wall seconds of each decode step."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.processor = engine.processor
        self.step = self.processor._generation_step
        self.processor._generation_step = self
        self.decode: list[float] = []

    def __call__(self, model: Any) -> None:
        decoding = all(f.query_length == 1 for f in self.processor.inputs_and_outputs.requests_in_batch)
        start = time.perf_counter()
        self.step(model)
        if decoding:
            self.decode.append(time.perf_counter() - start)


def run(engine: TransformersEngine, batch: int, prompt: int, new: int, repeats: int) -> float:
    """Median decode-step ms over `repeats` generations of `batch` fresh prompts, after one that
    warms up."""
    timer = StepTimer(engine)
    gen = torch.Generator().manual_seed(batch)
    for repeat in range(repeats + 1):
        if repeat == 1:
            timer.decode.clear()
        engine.generate(torch.randint(0, 256, (batch, prompt), generator=gen).tolist(), max_new_tokens=new)
    engine.processor._generation_step = timer.step
    return 1e3 * statistics.median(timer.decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face checkpoint directory (default: random TinyLlama shape)")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8, 32])
    parser.add_argument("--real-data", default="partial", choices=["none", "partial", "all"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny random model, 1 repeat, any device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.smoke:
        raise SystemExit("bench_transformers.py needs a CUDA device (or --smoke)")
    prompt, new = (24, 8) if args.smoke else (PROMPT, NEW)
    if args.smoke:
        args.batches, args.repeats = [2], 1
    model, tokenizer = load(args.model, device) if args.model else random_model(device, args.smoke)
    import transformers

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"model: {args.model or ('random tiny' if args.smoke else 'random TinyLlama-1.1B shape')} {model.dtype}  prompt {prompt} + {new} new tokens")
    print("| batch | cuda graphs | canary off ms/step | canary on ms/step | cost ms | cost % |")
    print("|---:|---|---:|---:|---:|---:|")
    graph_modes = [False, True] if device == "cuda" else [False]
    for batch in args.batches:
        for use_cuda_graph in graph_modes:
            engine = TransformersEngine(model, tokenizer, page_size=64, num_blocks=batch * (prompt + new) // 64 + 16,
                                        max_batch_tokens=max(2048, batch), max_requests_per_batch=batch,
                                        max_context=prompt + new, use_cuda_graph=use_cuda_graph)
            off = run(engine, batch, prompt, new, args.repeats)
            handle = EngineHandle(engine, CanaryConfig(real_data=args.real_data, sweep_interval=SWEEP),
                                  "triton" if device == "cuda" else "torch")
            handle.reset(0, ())
            on = run(engine, batch, prompt, new, args.repeats)
            handle.side.runtime.drain()
            assert not handle.violations(), handle.violations()[:3]
            handle.close()
            print(f"| {batch} | {'on' if use_cuda_graph else 'off'} | {off:.3f} | {on:.3f} | {on - off:.3f} | "
                  f"{100 * (on - off) / off:.1f}% |", flush=True)
            del engine, handle
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
