#!/usr/bin/env bash
# The GPU pass, on a machine with CUDA and no network: install the project, then run the selected
# steps (default: all), each time-boxed; a table comes last.
#
#   OUT=/some/dir bash benchmarks/gpu_run.sh                       # every step
#   STEPS="tests overhead" OUT=/some/dir bash benchmarks/gpu_run.sh  # some of them
#
# Steps: tests (the GPU-relevant tests: kernels (the canary's and the transformers adapter's), runtime, graph decode, bug scenarios, and the Triton
# fault and soak cases CPU CI leaves to this pass), kernels (bench_kernels.py), overhead
# (bench_overhead.py), examples (the example suite under two xdist workers), transformers (the example
# suite on the transformers engine, eager and with CUDA graphs), tf-bench (bench_transformers.py with
# CUDA graphs over the TinyLlama and Llama-3-8B shapes: decode at TF_BATCHES, default 1 32 64 128, and a
# long prefill, TF_PREFILL= for none; TF_SHAPES picks shapes; one shape takes more than one call's 10
# minutes on an H200: split it, e.g. TF_SHAPES=llama3-8b TF_BATCHES=128 TF_PREFILL=), reference (bench_reference.py: the reference engine's graph
# decode, canary off vs on), parallel (on two GPUs: the tp=2 graph-decode and rank-divergence tests, then
# bench_reference.py --tp 2), async (the example suite under
# transformers' async batching, eager and with CUDA graphs, and the TinyLlama bench; the async tests run
# in "tests"), soak (benchmarks/soak.py over every transformers configuration, on the machine's
# transformers and on the release whose wheel is in .whl/tf523/, all at once: SOAK_SECONDS each,
# SOAK_SEED the first seed, SOAK_ROUNDS rounds a seed, SOAK_EXTRA more configurations such as
# reference-mha-graph; NAME*3 runs three copies on seeds 100 apart; processes take the GPUs in turn),
# gate (benchmarks/gate.py: the rows GATE_ROWS names, default all, each held to its budget; a gate process
# a GPU, each on its own share of the CPU cores, first reading the rows GATE_POOL names together (default the TinyLlama
# prefill, its pairs pooled), then taking the next row none has claimed; GATE_SECONDS for each process, GATE_ARGS more of gate.py's
# options such as --seconds; one table from the readings; not in the default steps). Wheels the machine lacks (pytest-xdist, execnet) may be placed
# in .whl/ beforehand.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvcanary-gpu}
STEPS=${STEPS:-tests kernels overhead examples transformers tf-bench reference}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"

summary="$OUT/summary.txt"
: >"$summary"
step() {  # step NAME SECONDS COMMAND...: run time-boxed, keep the log, note exit code, time, last result line
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '| %s | %s | %ss | %s |\n' "$name" "$rc" "$((SECONDS - start))" \
    "$(grep -E '(passed|failed|error)' "$OUT/$name.log" | tail -n 1 | tr -d '=')" >>"$summary"
  tail -n 30 "$OUT/$name.log"
}
wants() { [[ " $STEPS " == *" $1 "* ]]; }

if wants tests; then  # kernel compiles dominate: spread them over workers when xdist is there
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
  step tests 400 python3 -m pytest -q -p no:cacheprovider -x $workers --durations=5 tests/unit/kernels \
    tests/unit/canary tests/unit/engine/test_cuda_graph_canary.py tests/unit/engine/test_padded_decode.py \
    tests/unit/engine/test_jitter.py tests/unit/engine/test_async_scheduling.py \
    tests/unit/scenarios tests/adapters/transformers/test_cuda_graphs.py \
    tests/adapters/transformers/test_forward_inputs.py tests/adapters/transformers/test_faults.py \
    tests/adapters/transformers/test_view_kernels.py \
    tests/adapters/transformers/test_async_batching.py tests/adapters/transformers/test_model_hooks.py \
    tests/adapters/transformers/test_engine_defects.py tests/unit/soak \
    tests/unit/perturb/test_modes.py::test_triton_kernels_detect_every_fault \
    tests/e2e/test_soak.py::test_30_requests_under_pressure_raise_no_violation_with_triton_kernels
fi
wants kernels && step kernels 150 python3 benchmarks/bench_kernels.py
wants overhead && step overhead 300 python3 benchmarks/bench_overhead.py
if wants examples; then
  step examples 240 python3 -m pytest --kv-canary examples/ -n 2 -p no:cacheprovider -rA \
    --kv-canary-report "$OUT/examples-report.json"
  python3 - "$OUT/examples-report.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
pairs = sorted({(t.get("worker"), t.get("device")) for t in data["tests"]})
print("examples: worker -> device:", "; ".join(f"{w} {d}" for w, d in pairs))
PY
fi
if wants transformers; then
  step tf-eager 240 python3 -m pytest --kv-canary --kv-canary-engine transformers examples/ -p no:cacheprovider -q
  KVCANARY_TRANSFORMERS_CUDA_GRAPHS=1 step tf-graphs 240 python3 -m pytest --kv-canary \
    --kv-canary-engine transformers examples/ -p no:cacheprovider -q
fi
if wants tf-bench; then  # decode B1..B128 and a long prefill per shape (prefill cells fit an 80 GB card)
  for shape in ${TF_SHAPES:-tinyllama llama3-8b}; do
    prefill=$([ "$shape" = tinyllama ] && echo 32x16384 || echo 8x16384)
    step "tf-bench-$shape" "${TF_BENCH_SECONDS:-400}" python3 benchmarks/bench_transformers.py --shape "$shape" \
      --graphs on --batches ${TF_BATCHES:-1 32 64 128} --prefill ${TF_PREFILL-$prefill} --real-data partial all \
      --runs 3 --repeats 1
  done
fi
if wants gate; then  # a gate process a GPU side by side, each taking the next row no other has claimed; one table
  read -ra names <<<"${GATE_ROWS:-$(python3 benchmarks/gate.py --list | cut -d: -f1 | tr "\n" " ")}"
  pooled=() pool=()  # the rows of GATE_POOL among them: every process reads them at once, first, their pairs pooled
  for name in ${GATE_POOL-prefill-tinyllama-32x16384}; do [[ " ${names[*]} " == *" $name "* ]] && pooled+=("$name"); done
  ((${#pooled[@]})) && pool=(--pool "${pooled[@]}")
  gpus=$(nvidia-smi -L | wc -l) start=$SECONDS claims=$(mktemp -d)
  share=$(($(nproc) / gpus))  # each process its own CPU cores: the rows' host work does not contend
  rm -f "$OUT"/gate-*.jsonl
  for ((gpu = 0; gpu < gpus && (gpu < ${#names[@]} || ${#pooled[@]}); gpu++)); do
    pin=() && command -v taskset >/dev/null && ((share > 0)) && pin=(taskset -c "$((gpu * share))-$((gpu * share + share - 1))")
    # shellcheck disable=SC2086  # GATE_ARGS: more of gate.py's options, word-split on purpose
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=$((share > 0 ? share : 1)) timeout "${GATE_SECONDS:-580}" "${pin[@]}" \
      python3 benchmarks/gate.py --rows "${names[@]}" "${pool[@]}" --claim "$claims" --json "$OUT/gate-$gpu.jsonl" ${GATE_ARGS:-} \
      >"$OUT/gate-$gpu.log" 2>&1 &
  done
  wait
  # shellcheck disable=SC2086
  python3 benchmarks/gate.py --table "$OUT"/gate-*.jsonl --rows "${names[@]}" ${GATE_ARGS:-} >"$OUT/gate.log" 2>&1
  printf '| gate | %s | %ss | %s |\n' "$?" "$((SECONDS - start))" "$(grep -c '| within |' "$OUT/gate.log") of \
${#names[@]} rows within" >>"$summary"
fi
wants reference && step reference 300 python3 benchmarks/bench_reference.py --batches 1 32 --real-data partial all
if wants parallel; then  # two GPUs: tp=2 graph decode and the divergence scenario, then its cost
  step parallel-tests 200 python3 -m pytest -q -p no:cacheprovider tests/unit/engine/test_parallel.py \
    tests/unit/scenarios/test_rank_divergence.py
  step parallel 400 python3 benchmarks/bench_reference.py --tp 2 --batches 1 32
fi
if wants async; then
  export KVCANARY_TRANSFORMERS_ASYNC_BATCHING=1
  step async-eager 150 python3 -m pytest --kv-canary --kv-canary-engine transformers examples/ -p no:cacheprovider -q
  KVCANARY_TRANSFORMERS_CUDA_GRAPHS=1 step async-graphs 150 python3 -m pytest --kv-canary \
    --kv-canary-engine transformers examples/ -p no:cacheprovider -q
  unset KVCANARY_TRANSFORMERS_ASYNC_BATCHING
  step async-bench 300 python3 benchmarks/bench_transformers.py --shape tinyllama --graphs on --batches 1 32 \
    --real-data partial --runs 3 --repeats 1 --batching async
fi

if wants soak; then  # the workload soak, every configuration at once: it is host-bound, one process each
  if compgen -G ".whl/tf523/*.whl" >/dev/null; then  # a second transformers release, beside the machine's
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tf523 .whl/tf523/*.whl
  fi
  configs=${SOAK_CONFIGS:-"transformers-mha-sync-eager transformers-mha-sync-graphs transformers-mha-async-eager \
transformers-mha-async-graphs transformers-swa-sync-eager transformers-swa-sync-graphs transformers-swa-async-eager \
transformers-swa-async-graphs"}
  releases=${SOAK_RELEASES:-"installed 5.23"}
  gpus=$(nvidia-smi -L | wc -l)
  start=$SECONDS n=0
  set -f  # NAME*COPIES is no pattern
  for release in $releases; do
    for entry in $configs ${SOAK_EXTRA:-}; do  # NAME or NAME*COPIES: copies run seeds 100 apart
      config=${entry%%\**} copies=1
      [ "$config" != "$entry" ] && copies=${entry#*\*}
      [ "$release" != installed ] && [[ $config != transformers-* ]] && continue
      path=$([ "$release" = installed ] || echo /tmp/tf523)
      for ((copy = 0; copy < copies; copy++)); do
        gpu=$((n % gpus)) n=$((n + 1))
        CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH} \
          timeout $((${SOAK_SECONDS:-480} + 150)) python3 benchmarks/soak.py --configs "$config" \
          --seconds "${SOAK_SECONDS:-480}" --forwards "${SOAK_FORWARDS:-50000}" --rounds "${SOAK_ROUNDS:-30}" \
          --seed $((${SOAK_SEED:-0} + 100 * copy)) --json "$OUT/soak-$release-$config-$copy.jsonl" \
          >"$OUT/soak-$release-$config-$copy.log" 2>&1 &
      done
    done
  done
  set +f
  wait
  for f in "$OUT"/soak-*.jsonl; do  # the release each row ran on (a row per seed)
    release=${f#"$OUT"/soak-}; release=${release%%-*}
    sed "s/\"config\": \"/\"config\": \"$release: /" "$f"
  done >"$OUT/soak.jsonl"
  grep -h -E "replay|round [0-9]+:|Error" "$OUT"/soak-*.log >"$OUT/soak-failures.txt"
  rm -f "$OUT"/soak-installed-* "$OUT"/soak-5.*
  printf '| soak | - | %ss | %s |\n' "$((SECONDS - start))" "$n processes, $(wc -l <"$OUT/soak.jsonl") seeds" >>"$summary"
fi

echo
echo "| step | exit | time | result |"
echo "|---|---|---|---|"
cat "$summary"
for f in kernels overhead tf-bench-tinyllama tf-bench-llama3-8b async-bench reference parallel gate; do
  [ -f "$OUT/$f.log" ] && { echo; echo "== $f"; grep -E '^(\||device)' "$OUT/$f.log"; }
done
[ -f "$OUT/soak.jsonl" ] && { echo; echo "== soak"; python3 benchmarks/soak.py --table "$OUT/soak.jsonl"; }
