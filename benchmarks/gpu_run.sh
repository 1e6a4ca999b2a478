#!/usr/bin/env bash
# The GPU pass, on a machine with CUDA and no network: install the project, run the test suite on
# the GPU, the example suite under two xdist workers, and the kernel benchmark; a table comes last.
#
#   OUT=/some/dir bash benchmarks/gpu_run.sh
#
# Wheels the machine lacks (pytest-xdist, execnet) may be placed in .whl/ beforehand.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvcanary-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"

summary="$OUT/summary.txt"
: >"$summary"
step() {  # step NAME COMMAND...: run, keep the log, note exit code, time and pytest's last line
  local name=$1 start=$SECONDS rc
  shift
  "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '| %s | %s | %ss | %s |\n' "$name" "$rc" "$((SECONDS - start))" \
    "$(grep -E '(passed|failed|error)' "$OUT/$name.log" | tail -n 1 | tr -d '=')" >>"$summary"
  tail -n 25 "$OUT/$name.log"
}

# Each step is time-boxed (TESTS selects the GPU tests; the whole suite is the default).
step bench timeout 150 python3 benchmarks/bench_kernels.py
step examples timeout 150 python3 -m pytest --kv-canary examples/ -n 2 -p no:cacheprovider -rA \
  --kv-canary-report "$OUT/examples-report.json"
# shellcheck disable=SC2086
step tests timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest ${TESTS:-tests/} -q -p no:cacheprovider --durations=10

echo
python3 - "$OUT/examples-report.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
pairs = sorted({(t["worker"], t["kind"], t["device"]) for t in data["tests"]})
print("examples: worker -> device:", "; ".join(f"{w} {k} {d}" for w, k, d in pairs))
PY
echo
echo "| step | exit | time | result |"
echo "|---|---|---|---|"
cat "$summary"
echo
sed -n '/^| case/,$p' "$OUT/bench.log"
