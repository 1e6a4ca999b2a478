"""One GPU run that says as much as it can about the vLLM adapter on vLLM's CUDA build.

    python benchmarks/vllm_gpu_probe.py                      # eager, then PIECEWISE graphs, FLASH_ATTN
    python benchmarks/vllm_gpu_probe.py --backends FLASH_ATTN FLASHINFER --modes eager graphs

Per (backend, mode) stage it starts the adapter's engine as the plugin does (the seeded random
``mha`` model; FLASHINFER gets a head size of 64, which its kernels need), prints vLLM's version,
the backend and graph mode vLLM settled on, the layout found (layout.PagedLayout), each pool
group's views (shape, strides, readable), runs a clean workload with the canary (real_data all,
Triton kernels) and prints its stats and violations, then a workload with a flipped byte of a slot
a request reads (real_kv_used), which must be reported. Every stage's exception is printed with its
full traceback and the run goes on; the exit status is the number of failed stages.

    python benchmarks/vllm_gpu_probe.py --replay 'REPLAY' [--config vllm-swa] [--seed 2]

runs a soak failure's replay instead, on the soak's engine of that configuration (benchmarks/soak.py:
eager; vLLM's CPU build without a GPU) and, for every
violation, prints what the adapter and vLLM hold for its slot: vLLM's block sizes and prefix-hash
granularity, the full-attention slots the full-to-window map sends there, the book's content and
vLLM's hash, ref count and hashed tokens of those blocks and of the window block, and the (full,
window) pairs naming them (the prefix cache's and the last forward's rows'). Exit status 1 when the
replay's round is not clean.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _checkpoint(backend: str):
    from pytest_kvcanary.adapters.random_checkpoint import write_random_checkpoint
    from pytest_kvcanary.adapters.vllm.checkpoint import random_checkpoint, random_model_config

    if backend != "FLASHINFER":
        return random_checkpoint("mha", 0)
    import torch

    config = random_model_config("mha")
    config.head_dim, config.hidden_size = 64, 256
    return write_random_checkpoint(config, "kvcanary-vllm-mha-hd64", 0, torch.bfloat16)


def stage(backend: str, mode: str) -> bool:
    import torch
    import vllm

    from pytest_kvcanary.adapters.vllm.engine import VllmEngine, VllmSettings
    from pytest_kvcanary.config import CanaryConfig, PerturbSpec
    from pytest_kvcanary.handles.single import EngineHandle

    print(f"\n=== {backend} {mode}: vLLM {vllm.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    settings = VllmSettings(device="cuda", cuda_graphs=mode == "graphs", attention_backend=backend)
    engine = VllmEngine(_checkpoint(backend), 0, settings)
    first = next(iter(engine.llm.llm_engine.vllm_config.compilation_config.static_forward_context.values()))
    print(f"backend {first.attn_backend.get_name()}, graph mode {engine.graph_mode}, layout {engine.layout}")
    for group in engine.canary_groups():
        print(f"group {group.kind.name}: {group.num_slots} slots, fingerprintable {group.fingerprintable}, "
              f"opaque {sorted(h.name for h in group.opaque_halves)}")
        for half, views in (("K", group.k_layers), ("V", group.v_layers)):
            for v in views[:2]:
                print(f"  {half} view {tuple(v.shape)} strides {v.stride()} {v.dtype}")
            print(f"  {half}: {len(views)} views")
    ok = True
    config = CanaryConfig(mode="log", real_data="all", sweep_interval=2)
    handle = EngineHandle(engine, config)
    handle.reset(0, ())
    rng = random.Random(0)
    stem = [rng.randrange(256) for _ in range(70)]
    prompts = [stem + [rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    handle.generate(prompts, 8)
    handle.generate(prompts[:3], 8)  # prefix-cache hits
    print(f"clean: forwards {engine.forwards}, stats {handle.stats()}")
    violations = handle.violations()
    for v in violations[:10]:
        print(f"  violation {v}")
    ok &= not violations
    handle.reset(1, (PerturbSpec("real_kv_used", warmup_steps=1),))
    firsts = [[rng.randrange(256) for _ in range(rng.randrange(40, 90))] for _ in range(3)]
    handle.generate(firsts, 4)
    handle.generate([p + [rng.randrange(256) for _ in range(10)] for p in firsts], 6)
    seen = handle.violations()
    print(f"real_kv_used: injections {handle.injections()}, violations {len(seen)}")
    for v in seen[:5]:
        print(f"  violation {v}")
    ok &= bool(seen)
    return ok


def describe_block(engine, block_id: int) -> str:
    """What the book and vLLM's pool hold for one block."""
    block, content = engine.book.pool.blocks[block_id], engine.book._contents.get(block_id)
    book = "no content" if content is None else (f"group {content.group} index {content.index} "
                                                 f"{len(content.tokens)} tokens {list(content.tokens[:6])}...")
    return (f"block {block_id}: ref {block.ref_cnt} hash {'none' if block.block_hash is None else 'set'} "
            f"hashed tokens {block.block_hash_num_tokens}; book: {book}")


def replay(text: str, config: str, seed: int) -> bool:
    """Run a soak failure's replay on the soak's configuration `config` (soak.py: CUDA where there
    is one, else vLLM's CPU build) and dump, per violation, the slot's blocks and pairs."""
    from soak import configurations, soak_canary

    from pytest_kvcanary.handles.single import EngineHandle

    chosen = configurations()[config]
    if chosen.why is not None:
        raise SystemExit(f"{config} cannot run here: {chosen.why}")
    engine = chosen.build()
    manager = engine.book.manager
    print(f"block sizes {[g.kv_cache_spec.block_size for g in manager.kv_cache_config.kv_cache_groups]}, "
          f"hash block size {engine.book.pool.hash_block_size}, window groups {engine.book.window_groups}")
    handle = EngineHandle(engine, soak_canary("partial"))
    handle.reset(seed, ())
    found = handle.run_workload(seed=seed, rounds=1, replay=text, shrink_trials=0)
    print(found.summary())
    for line in found.describe_failures():
        print(f"  {line}")
    bs, to_window = engine.block_size, engine._window.slots.cpu()
    cached, own = engine.book.window_pairs(), engine._window.pairs.tolist()
    for v in handle.violations()[:12]:
        print(f"violation {v.describe()}")
        if v.group != "SWA":
            continue
        fulls = sorted({int(s) // bs for s in (to_window == v.slot).nonzero().flatten().tolist()})
        print(f"  window {describe_block(engine, v.slot // bs)}")
        for full in fulls:
            print(f"  full {describe_block(engine, full)}")
            print(f"    cached pairs {[p for p in cached if p[0] == full]}, rows' pairs {[p for p in own if p[0] == full]}")
    return not handle.violations()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["FLASH_ATTN"])
    parser.add_argument("--modes", nargs="+", default=["eager", "graphs"], choices=["eager", "graphs"])
    parser.add_argument("--replay", help="a soak failure's replay text: run it and dump its violations' slots")
    parser.add_argument("--config", default="vllm-swa", choices=["vllm-mha", "vllm-swa"],
                        help="the soak configuration the replay came from")
    parser.add_argument("--seed", type=int, default=2, help="the replay's seed")
    args = parser.parse_args()
    if args.replay is not None:
        return int(not replay(args.replay, args.config, args.seed))
    failed = 0
    for backend in args.backends:
        for mode in args.modes:
            try:
                good = stage(backend, mode)
                print(f"=== {backend} {mode}: {'OK' if good else 'FAILED (see above)'}", flush=True)
                failed += not good
            except BaseException:  # noqa: BLE001 - every stage reports and the run goes on
                traceback.print_exc()
                print(f"=== {backend} {mode}: ERROR", flush=True)
                failed += 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
