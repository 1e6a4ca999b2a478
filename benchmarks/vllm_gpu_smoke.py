"""GPU smoke test of vLLM 0.26.0's CUDA build installed offline by `benchmarks/vllm_gpu.sh install`.

    PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/vllm_gpu_smoke.py [STAGE ...]

Stages (default: eager graphs eager_v1), each in a subprocess of its own so that one crash or hang
does not hide the others:
  eager     LLM(enforce_eager=True)              the model runner vLLM picks (V2 for a dense Llama)
  graphs    LLM(enforce_eager=False)             default compilation and CUDA graphs
  eager_v1  LLM(enforce_eager=True) with VLLM_USE_V2_MODEL_RUNNER=0 (the V1 GPUModelRunner)

The model is a seeded random 2-layer Llama (hidden 256, 4 heads, 2 KV heads, head_dim 64) with the
project's byte-level tokenizer, written by pytest_kvcanary.adapters.random_checkpoint. Each stage
generates 8 tokens greedily for 4 prompts and reports the outputs, the attention backend, the model
runner class and the KV cache tensors of layer 0. vLLM's full logs go to $OUT/smoke-logs (else
/tmp/vllm-smoke-logs); stdout stays short. Exit status 0 iff every stage that ran passed.
Environment: SMOKE_BUDGET_S (seconds for all stages, default 540), SMOKE_STAGE_TIMEOUT_S (default 300).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGES = {
    "eager": (dict(enforce_eager=True), {}),
    "graphs": (dict(enforce_eager=False), {}),
    "eager_v1": (dict(enforce_eager=True), {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
}
COMMON = dict(gpu_memory_utilization=0.3, max_model_len=512, block_size=32, max_num_seqs=8,
              dtype="bfloat16", seed=0)
PROMPTS = ["Hello, my name is", "The capital of France is", "abc", "0123456789 " * 4]
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # the machine is offline
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # flashinfer is not installed; on CUDA vLLM's sampler imports it unless this is 0
    # (vllm/v1/sample/ops/topk_topp_sampler.py:44)
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}
INTERESTING = re.compile(
    r"attention backend|Using .*backend|FlashAttention|flash_attn|Model Runner|model runner|"
    r"CUDA graph|cudagraph|torch.compile|Compil|KV cache|Available KV|Maximum concurrency|"
    r"Error|error|Traceback|WARNING|FAIL", re.I)


def out(*a):
    for line in " ".join(str(x) for x in a).splitlines() or [""]:
        print("@@ " + line, flush=True)


# ----------------------------------------------------------------------------- child side
def describe_tensor(t) -> str:
    import torch
    if isinstance(t, (list, tuple)):
        return "[" + ", ".join(describe_tensor(x) for x in t) + "]"
    if not isinstance(t, torch.Tensor):
        return repr(type(t))
    return (f"shape={tuple(t.shape)} dtype={t.dtype} stride={tuple(t.stride())} device={t.device} "
            f"contiguous={t.is_contiguous()} storage_bytes={t.untyped_storage().nbytes()} "
            f"data_ptr=0x{t.data_ptr():x}")


def guarded(name, fn, result):
    try:
        value = fn()
        result[name] = value if isinstance(value, (str, int, float, list, dict, type(None))) else repr(value)
        return value
    except BaseException:  # noqa: BLE001 - report everything, keep going
        tb = traceback.format_exc()
        out(f"[{name}] FAILED:\n{tb}")
        result.setdefault("errors", []).append(f"{name}: {tb.strip().splitlines()[-1]}")
        return None


def child(stage: str, model: str, result_path: str) -> int:
    kwargs, _ = STAGES[stage]
    result: dict = {"stage": stage}

    def finish(rc: int) -> int:
        result["ok"] = rc == 0 and not result.get("errors")
        Path(result_path).write_text(json.dumps(result, indent=1, default=str))
        return 0 if result["ok"] else 1

    t0 = time.perf_counter()
    vllm = guarded("import vllm", lambda: __import__("vllm"), result)
    if vllm is None:
        return finish(1)
    out(f"vllm {vllm.__version__} from {vllm.__file__}")
    import torch
    out(f"torch {torch.__version__} cuda {torch.version.cuda} available {torch.cuda.is_available()}" + (
        f" device {torch.cuda.get_device_name(0)} capability {torch.cuda.get_device_capability(0)}"
        if torch.cuda.is_available() else ""))
    from vllm import LLM, SamplingParams

    args = dict(COMMON, **kwargs)
    out(f"LLM(model=<random llama>, {', '.join(f'{k}={v!r}' for k, v in args.items())})")
    t = time.perf_counter()
    llm = guarded("LLM()", lambda: LLM(model=model, **args), result)
    result["init_s"] = round(time.perf_counter() - t, 2)
    out(f"LLM init took {result['init_s']} s")
    if llm is None:
        return finish(1)

    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    times, outputs = [], None
    for i in range(3):
        t = time.perf_counter()
        o = guarded(f"generate#{i}", lambda: llm.generate(PROMPTS, sp, use_tqdm=False), result)
        times.append(round(time.perf_counter() - t, 4))
        if o is None:
            break
        outputs = o
    result["generate_s"] = times
    out(f"generate (4 prompts x 8 tokens) wall times: {times} s "
        f"(first includes warm-up; steady {32 / times[-1]:.0f} tok/s)" if times else "no generate")
    if outputs is not None:
        result["token_ids"] = [list(x.outputs[0].token_ids) for x in outputs]
        for p, x in zip(PROMPTS, outputs):
            out(f"prompt {p[:24]!r:28} -> ids {list(x.outputs[0].token_ids)} text {x.outputs[0].text!r}")

    def runner():
        eng = llm.llm_engine
        ex = getattr(eng, "model_executor", None) or eng.engine_core.engine_core.model_executor
        return ex.driver_worker.worker.model_runner

    r = guarded("model runner", runner, result)
    if r is not None:
        result["model_runner"] = f"{type(r).__module__}.{type(r).__qualname__}"
        out(f"model runner: {result['model_runner']}")

        def backends():
            names = []
            for groups in getattr(r, "attn_groups", []) or []:
                for g in groups:
                    b = g.backend
                    names.append(f"{b.get_name()} ({b.__module__}.{b.__qualname__}) "
                                 f"layers={list(getattr(g, 'layer_names', []))[:4]}")
            return names

        result["attn_groups"] = guarded("attention groups", backends, result)
        out(f"attention groups: {result['attn_groups']}")

        def layer0():
            ctx = r.vllm_config.compilation_config.static_forward_context
            names = [n for n, layer in ctx.items() if hasattr(layer, "impl")]
            name = sorted(names)[0]
            layer = ctx[name]
            impl = layer.impl
            info = {
                "layer": name,
                "backend": f"{layer.attn_backend.get_name()} ({layer.attn_backend.__qualname__})",
                "impl": f"{type(impl).__module__}.{type(impl).__qualname__}",
                "fa_version": getattr(impl, "vllm_flash_attn_version", None),
                "layer.kv_cache": describe_tensor(getattr(layer, "kv_cache", None)),
                "kv_cache_dtype": str(getattr(layer, "kv_cache_dtype", None)),
            }
            try:
                info["backend get_kv_cache_shape(num_blocks=7)"] = str(layer.attn_backend.get_kv_cache_shape(
                    7, r.vllm_config.cache_config.block_size, impl.num_kv_heads, impl.head_size))
            except Exception as e:  # noqa: BLE001
                info["backend get_kv_cache_shape"] = f"n/a: {e!r}"
            try:
                info["backend get_kv_cache_stride_order()"] = str(layer.attn_backend.get_kv_cache_stride_order())
            except Exception as e:  # noqa: BLE001
                info["backend get_kv_cache_stride_order()"] = f"n/a: {e!r}"
            return info

        info = guarded("layer 0 attention", layer0, result)
        for k, v in (info or {}).items():
            out(f"layer0 {k}: {v}")

        def kv_caches():
            kv = getattr(r, "kv_caches", None)
            return {"count": len(kv) if kv is not None else None,
                    "kv_caches[0]": describe_tensor(kv[0]) if kv else None}

        kv = guarded("runner.kv_caches", kv_caches, result)
        for k, v in (kv or {}).items():
            out(f"runner.kv_caches {k}: {v}")

        def fa():
            from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
            from vllm.vllm_flash_attn import flash_attn_interface as f
            return (f"get_flash_attn_version(head_size=64)={get_flash_attn_version(head_size=64)} "
                    f"FA2_AVAILABLE={f.FA2_AVAILABLE} FA3_AVAILABLE={f.FA3_AVAILABLE} FA4(cute)={f.FA4_AVAILABLE}")

        fa_info = guarded("flash-attn version", fa, result)
        if fa_info:
            out(fa_info)
        out(f"cudagraph mode: {guarded('cudagraph mode', lambda: str(r.vllm_config.compilation_config.cudagraph_mode), result)}; "
            f"compilation mode: {guarded('compile mode', lambda: str(r.vllm_config.compilation_config.mode), result)}")
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    out(f"peak GPU memory allocated by torch: {peak:.2f} GiB; stage total {time.perf_counter() - t0:.1f} s")
    return finish(0)


# ----------------------------------------------------------------------------- parent side
def make_checkpoint() -> str:
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import LlamaConfig

    from pytest_kvcanary.adapters.random_checkpoint import write_random_checkpoint

    config = LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         vocab_size=259, max_position_embeddings=1024, pad_token_id=256,
                         bos_token_id=257, eos_token_id=258, tie_word_embeddings=False)
    return str(write_random_checkpoint(config, "vllm-smoke-llama", 0, torch.bfloat16))


def parent(stages: list[str]) -> int:
    budget = float(os.environ.get("SMOKE_BUDGET_S", "540"))
    stage_timeout = float(os.environ.get("SMOKE_STAGE_TIMEOUT_S", "300"))
    start = time.perf_counter()
    log_dir = Path(os.environ.get("OUT") or "/tmp") / ("smoke-logs" if os.environ.get("OUT") else "vllm-smoke-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[smoke] python {sys.version.split()[0]}; PYTHONPATH={os.environ.get('PYTHONPATH')}; logs in {log_dir}")
    try:
        model = make_checkpoint()
    except BaseException:  # noqa: BLE001
        print("[smoke] FAIL building the random checkpoint:\n" + traceback.format_exc())
        return 1
    print(f"[smoke] random Llama checkpoint: {model} ({', '.join(sorted(os.listdir(model)))})")
    results, failed = {}, []
    for stage in stages:
        left = budget - (time.perf_counter() - start)
        if left < 60:
            print(f"[smoke] SKIP {stage}: only {left:.0f} s of SMOKE_BUDGET_S left")
            failed.append(stage)
            continue
        env = dict(os.environ, **STAGES[stage][1])
        for k, v in ENV.items():
            env.setdefault(k, v)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner must live in this process
        log = log_dir / f"smoke-{stage}.log"
        res = Path(tempfile.mkdtemp(prefix="smoke-")) / "result.json"
        print(f"\n[smoke] ===== stage {stage} (timeout {min(stage_timeout, left):.0f} s) =====", flush=True)
        t = time.perf_counter()
        with open(log, "w") as fh:
            try:
                rc = subprocess.run([sys.executable, __file__, "--child", stage, model, str(res)], env=env,
                                    stdout=fh, stderr=subprocess.STDOUT, timeout=min(stage_timeout, left)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = log.read_text(errors="replace")
        lines = text.splitlines()
        for line in lines:
            if line.startswith("@@"):
                print(line)
        shown = [ln for ln in lines if not ln.startswith("@@") and INTERESTING.search(ln)]
        if shown:
            print(f"[smoke] {stage}: {len(shown)} notable vLLM log lines (first 12):")
            for ln in shown[:12]:
                print("   | " + ln[:220])
        if rc != 0:
            print(f"[smoke] {stage}: exit {rc}; last 25 vLLM log lines (full log {log}):")
            for ln in [x for x in lines if not x.startswith("@@")][-25:]:
                print("   ! " + ln[:220])
            failed.append(stage)
        results[stage] = json.loads(res.read_text()) if res.exists() else {"ok": False}
        print(f"[smoke] {stage}: {'PASS' if rc == 0 else 'FAIL'} in {time.perf_counter() - t:.1f} s "
              f"(init {results[stage].get('init_s')} s, generate {results[stage].get('generate_s')} s)", flush=True)
    ids = {s: r.get("token_ids") for s, r in results.items() if r.get("token_ids")}
    if len(ids) > 1:
        ref_stage, ref = next(iter(ids.items()))
        for s, v in ids.items():
            print(f"[smoke] greedy ids {s} {'==' if v == ref else '!='} {ref_stage}")
    print()
    for s, r in results.items():
        l0 = r.get("layer 0 attention") or {}
        kv = (r.get("runner.kv_caches") or {}).get("kv_caches[0]")
        print(f"[smoke] {s}: ok={r.get('ok')} init={r.get('init_s')}s generate={r.get('generate_s')}s "
              f"runner={r.get('model_runner')} backend={l0.get('backend')} fa_version={l0.get('fa_version')} "
              f"cudagraph={r.get('cudagraph mode')} kv_caches[0]: {kv} errors={r.get('errors')}")
    print("[smoke] summary: " + ", ".join(f"{s}={'PASS' if results.get(s, {}).get('ok') else 'FAIL'}"
                                           for s in stages))
    return 1 if failed or not all(r.get("ok") for r in results.values()) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        for k, v in ENV.items():
            os.environ.setdefault(k, v)
        sys.exit(child(sys.argv[2], sys.argv[3], sys.argv[4]))
    chosen = sys.argv[1:] or ["eager", "graphs", "eager_v1"]
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        sys.exit(f"unknown stage(s) {unknown}; choose from {list(STAGES)}")
    sys.exit(parent(chosen))
