#!/usr/bin/env bash
# Build a CPU virtual environment with one SGLang release, the real transfer
# engines (Mooncake non-CUDA, NIXL/UCX) and this plugin installed editable.
#
#   scripts/setup_venv.sh <sglang-release> <venv-dir>
#
# SGLang hard-pins CUDA torch and GPU kernels, so it goes in with --no-deps and
# the packages its imports need come from pinned files in requirements/.
# The script fails if any nvidia-* wheel ends up installed.
set -euo pipefail
release=${1:?usage: setup_venv.sh <sglang-release> <venv-dir>}
venv=${2:?usage: setup_venv.sh <sglang-release> <venv-dir>}
root=$(cd "$(dirname "$0")/.." && pwd)
req="$root/requirements"

if [ ! -f "$req/sglang-$release.txt" ]; then
  echo "setup: no pin file requirements/sglang-$release.txt; supported: $(ls "$req" | sed -n 's/^sglang-\(.*\)\.txt$/\1/p' | tr '\n' ' ')" >&2
  exit 2
fi

# Mooncake's non-CUDA wheel links against these Debian libraries.
missing=()
for lib in libibverbs1 librdmacm1 libnuma1; do
  dpkg -s "$lib" >/dev/null 2>&1 || missing+=("$lib")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "setup: missing Debian packages ${missing[*]} (install them as root)" >&2
    exit 2
  fi
fi

py=${PYTHON:-python3}
# uv installs (parallel downloads, a shared cache that later venvs link from: a release's venv
# takes ~15 s once the cache is warm, pip took ~3 min each). It lives in its own small venv.
tools="$root/.venv-tools"
uv="$tools/bin/uv"
if [ ! -x "$uv" ] || ! "$uv" --version >/dev/null 2>&1; then
  rm -rf "$tools"
  "$py" -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check -r "$req/tools.txt"
fi
# The marker file is written last: a half-built venv has none and is rebuilt.
rm -rf "$venv"
"$uv" venv -q --seed --python "$py" "$venv"
pip=("$uv" pip install -q --python "$venv/bin/python")

# CPU torch first, so nothing later pulls a CUDA build. On PyPI torch 2.13.0 is a CUDA build;
# the CPU build comes from pip's find-links folder (this machine's /opt/wheels), as pip takes it.
find_links=$("$py" -m pip config get global.find-links 2>/dev/null || true)
torch_wheel=$(ls $find_links/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)
if [ -n "$torch_wheel" ]; then
  "${pip[@]}" "$torch_wheel"
else
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
"${pip[@]}" --no-deps "sglang==$release"
"${pip[@]}" -r "$req/cpu-imports.txt" -r "$req/sglang-$release.txt" -r "$req/test.txt" -r "$req/server.txt"
"${pip[@]}" --no-deps -r "$req/no-deps.txt"
"${pip[@]}" --no-deps -e "$root"

# Import-only stand-ins for GPU packages (see their docstrings); test
# environments only. sgl_kernel only where SGLang's decode module needs it.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stubs=(torchvision)
case "$release" in 0.5.10.post1) stubs+=(sgl_kernel) ;; esac
cp "$root/scripts/cpu_stubs/import_only_stub.py" "$site/import_only_stub.py"
for stub in "${stubs[@]}"; do
  rm -rf "${site:?}/$stub"
  cp -r "$root/scripts/cpu_stubs/$stub" "$site/$stub"
done

# Byte-code for what the tests and servers import. Importing them writes exactly those .pyc files
# (with PYTHONDONTWRITEBYTECODE unset for this one process: where it is set, as on this project's
# machines, nothing else would ever write them, and every test process would compile SGLang's and
# torch's sources again: `doctor` took 31 s instead of a few). compileall over site-packages
# compiled ~5x more (all of torch) and took ~5 min per venv on 2 cores. A module that fails to
# import here fails later in its own test, with its reason.
# SETUP_COMPILE=0 skips it (a venv used once, e.g. to record a release's probe values).
if [ "${SETUP_COMPILE:-1}" != 0 ]; then
  env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" - <<'PY' >/dev/null 2>&1 || true
import importlib
for name in ("torch", "numpy", "zmq", "transformers", "aiohttp", "fastapi", "uvicorn",
             "sglang_disagg_ext.registration", "sglang_disagg_ext.doctor", "sglang_disagg_ext.selftest.runner",
             "sglang_disagg_ext.selftest.harness.worker", "sglang.srt.server_args", "sglang.srt.disaggregation.utils",
             "sglang.srt.disaggregation.mooncake.conn", "sglang.srt.disaggregation.nixl.conn",
             "sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
             "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
             "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama",
             "sglang.srt.entrypoints.http_server", "sglang.launch_server", "sglang_router", "mooncake.engine", "nixl"):
    try:
        importlib.import_module(name)
    except BaseException:
        pass
PY
fi

# No CUDA wheels on a CPU machine. (No pipe into grep -q: with pipefail,
# SIGPIPE can turn a match into a failure.)
listing=$("$venv/bin/python" -m pip list --format=freeze 2>/dev/null)
if printf '%s\n' "$listing" | grep -i '^nvidia-' >/dev/null; then
  echo "setup: CUDA wheels were installed into $venv:" >&2
  printf '%s\n' "$listing" | grep -i '^nvidia-' >&2
  exit 1
fi

echo "$release" > "$venv/.sglang-release"
echo "setup: $venv ready (sglang $release)"
