#!/usr/bin/env bash
# The checks this project runs on a lent CUDA machine (issues 16 and 18), in one call.
#
# That machine has PyTorch with CUDA but no SGLang and no network, so SGLang's wheel
# (0.5.10.post1: pure Python, 6 MB, F5 live there) and the few pure-Python modules its
# import chain needs that the machine's image lacks travel as wheels in .whl/ (ignored
# by git) and are installed --no-deps into /tmp/site. Prepare them here with:
#
#   bench/gpu_checks.sh --prepare        # fills .whl/ (needs the package registry)
#
# and run there (the device tool: carry .whl):
#
#   bash bench/gpu_checks.sh             # logs under $OUT (or /tmp/gpu_checks)
#   bash bench/gpu_checks.sh digest      # the kernel tests and the steps named digest* only
#
# What runs (each step bounded, each log kept, one line "=== <step> rc=N" per step):
#   verify_kernels  test/unit/test_verify_kernels.py: the digest's device kernels (the fused Triton
#                   kernel, torch's int64 ones) give the byte-by-byte reference's value, as the CPU ones do
#   selftest_f5     the F5 rows with pools on the GPU: stock vs -ext, bytes checked
#   offload         bench.offload --device cuda --large: F5 offload + restore vs a plain
#                   device-to-host copy (pageable) and a pinned memcpy, GB/s
#   digest_8k/128k  bench.digest --device cuda: the digest (all buffers, one copy back; and one
#                   copy back per buffer) against a gather of the same pages
# Not run there: anything needing a transfer engine (no Mooncake or NIXL build for that
# machine is carried) and the head-slice descriptor bench (plain integers, no device memory).
set -u
cd "$(dirname "$0")/.."

# Modules SGLang 0.5.10.post1 imports (memory_pool, the F5 scenario's allocator and
# Req) that the machine's image does not have (its package list: the device tool's
# KINDS.md), with what they pull in. Pinned: the set was found by importing in a
# Python 3.12 venv that holds only the image's packages.
CARRIED="annotated-types==0.8.0 asttokens==3.0.2 compressed-tensors==0.20.0 dill==0.4.1 executing==2.3.0
gguf==0.19.0 httpcore2==2.16.2 httpx2==2.16.2 ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1
jiter==0.19.0 loguru==0.7.3 matplotlib-inline==0.2.2 msgspec==0.22.0 openai==3.57.0 orjson==3.13.0 parso==0.8.7
partial-json-parser==0.2.1.1.post7 pexpect==4.9.0 prompt_toolkit==3.0.53 ptyprocess==0.7.0 pure_eval==0.2.4
pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 stack-data==0.6.3
starlette==1.10.0 traitlets==5.16.1 truststore==0.10.5 typing-inspection==0.4.5 wcwidth==0.9.4
typing_extensions==4.16.0"
SGLANG_RELEASE=0.5.10.post1

if [ "${1:-}" = "--prepare" ]; then
  rm -rf .whl && mkdir -p .whl
  plat=()
  for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
           manylinux1; do plat+=(--platform "${p}_x86_64"); done
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl $CARRIED "sglang==$SGLANG_RELEASE" || exit 1
  du -sh .whl
  exit 0
fi

OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
# SGLang's fp8 module imports sgl_kernel at module level where torch sees CUDA (0.5.10.post1
# layers/quantization/fp8_kernel.py:55, on memory_pool's import chain); sgl_kernel is not
# carried (no wheel for this torch), so the test venvs' import-only stand-in goes last on the
# path: importable, any call raises, so a real use would fail the step, never fake a figure.
rm -rf /tmp/stubs && mkdir -p /tmp/stubs && cp -r scripts/cpu_stubs/sgl_kernel scripts/cpu_stubs/import_only_stub.py /tmp/stubs/
export PYTHONPATH=/tmp/site:$PWD:/tmp/stubs PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -c "import torch, sglang; print('torch', torch.__version__, 'sglang', sglang.__version__, \
  torch.cuda.get_device_name(0))"

ONLY=${1:-}  # a step-name prefix: run only those steps (e.g. "digest"); none: every step
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  case "$name" in "$ONLY"*) ;; *) [ -n "$ONLY" ] && [ "$name" != verify_kernels ] && return ;; esac
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name rc=$rc"
}

step verify_kernels 120 python3 -m pytest -q -p no:cacheprovider test/unit/test_verify_kernels.py
step selftest_f5 240 python3 -m sglang_disagg_ext.cli selftest --json --device cuda \
  --scenario "retract-resume NSA kv+index_k (100 cycles)" --scenario "NSA _clear_buffers releases index_k" \
  --scenario "metadata get_buf isolated from slot reuse"
step offload 240 python3 -m bench.offload --device cuda --large --repeats 31
step digest_8k 60 python3 -m bench.digest --device cuda --tokens 8192 --samples 51 --profile
step digest_128k 60 python3 -m bench.digest --device cuda --tokens 131072 --samples 31
