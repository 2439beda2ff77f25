#!/usr/bin/env bash
# The GPU checks in one command, on a CUDA machine that has torch, triton and transformers (Ray is not needed):
# the tests that run on CUDA there (Triton kernels against torch_ref, the engine on the Triton backend against the
# torch one, fp32 parity with transformers, bf16 by vLLM's top-5 rule, sliding window, odd shapes), then
# benchmarks/kernels.py.
# Logs and results go to $OUT when set (the device tool), else benchmarks/results/gpu/.
#
#   bash benchmarks/gpu_check.sh [--full]    # --full: every batch size and context in the kernel benchmark
#
# Wheels of packages the machine lacks (llguidance) may be put in .whl/ beside it; they are installed to a
# temporary site dir, as is a link that makes this checkout importable as `pagedserve`.
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-benchmarks/results/gpu}
mkdir -p "$dest"
export PYTHONUNBUFFERED=1

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device; nothing to do" >&2
    exit 1
fi
site=$(mktemp -d)
ln -s "$PWD" "$site/pagedserve"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, torch, triton, transformers, pagedserve; print(pagedserve.__file__, 'python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$dest/gpu-env.txt"

opts=(-q -p no:randomly -rfEs)
python3 -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout=150)
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n 8)
status=0
start=$SECONDS
log="$dest/gpu-tests.log"
: >"$log"
# Kernels against torch_ref: many small cases, compiled in parallel.
timeout 150 python3 -m pytest "${opts[@]}" "${parallel[@]}" \
    tests/engine/test_kernels_triton.py tests/engine/test_triton_window.py 2>&1 | tee -a "$log" || status=1
# Engines one at a time: each sizes its KV cache from the GPU memory it finds free.
timeout 200 python3 -m pytest "${opts[@]}" tests/engine/test_triton_e2e.py tests/engine/test_models_parity.py \
    tests/engine/test_sliding_window.py tests/engine/test_odd_shapes.py 2>&1 | tee -a "$log" || status=1
timeout 60 python3 -m pytest "${opts[@]}" tests/engine/test_bf16.py -k "bf16_greedy and cuda" 2>&1 | tee -a "$log" \
    || status=1
echo "tests: $((SECONDS - start)) s" | tee -a "$log"

quick=(--quick)
[ "${1:-}" = "--full" ] && quick=()
start=$SECONDS
timeout 200 python3 benchmarks/kernels.py "${quick[@]}" --results-dir "$dest" 2>&1 | tee "$dest/kernels.log" || status=1
echo "kernels: $((SECONDS - start)) s" | tee -a "$dest/kernels.log"
exit $status
