#!/usr/bin/env bash
# The GPU checks in one command, on a CUDA machine that has torch, triton and transformers (Ray is not needed):
# the tests that run on CUDA there (Triton kernels against torch_ref, the engine on the Triton backend against the
# torch one, fp32 parity with transformers, bf16 by vLLM's top-5 rule, sliding window, odd shapes, the fp8 KV cache,
# int8 weights against the dequantized model), then benchmarks/bench_kernels.py, then bench-llama-7b-shape end to end
# against HF sequential and static batching, and with an fp8 KV cache against bf16 at one KV budget.
# Results go to $OUT when set (the device tool), else benchmarks/results/gpu/: one log, gpu-check.log, and each
# benchmark's JSON and plot, six files (the device tool returns at most eight).
#
#   bash benchmarks/gpu_check.sh [--quick] [--dry-run]
#
# --quick: a few batch sizes and contexts in the kernel sweep, no end-to-end run. --dry-run (CI, no GPU): the same
# steps' CPU-only parts, all at once: the test subsets are collected, not run, the kernel benchmark finds no GPU and
# says so, the end-to-end run only parses its arguments. PYTHON names the interpreter (default python3). Wheels of packages the
# machine lacks (llguidance) may be put in .whl/ beside it (WHEELS names another dir); they are installed to a
# temporary site dir, as is a link that makes this checkout importable as `pagedserve` where it is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
dest=${OUT:-benchmarks/results/gpu}
wheels=${WHEELS:-.whl}
quick=0 dry=0
for arg in "$@"; do
    case $arg in
        --quick) quick=1 ;;
        --dry-run) dry=1 ;;
        *) echo "gpu_check: unknown argument $arg" >&2; exit 2 ;;
    esac
done
mkdir -p "$dest"
export PYTHONUNBUFFERED=1

if [ $dry = 0 ] && ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device (--dry-run runs the CPU-only parts)" >&2
    exit 1
fi
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$py" -c "import pagedserve" 2>/dev/null || ln -s "$PWD" "$site/pagedserve"  # not installed there
if compgen -G "$wheels/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl || exit 1
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# The engine imports llguidance (structured output), which the device image lacks: without its wheel every engine
# test fails to collect, so say so before any device time goes to the rest.
if ! err=$("$py" -c "import pagedserve.engine.llm" 2>&1); then
    echo "gpu_check: the engine does not import here: ${err##*$'\n'}" >&2
    echo "gpu_check: put the missing wheels in $wheels/ (and carry it), e.g. python3 -m pip download --no-deps" \
        "--only-binary=:all: --python-version 3.12 --implementation cp --abi abi3 --platform manylinux_2_31_x86_64" \
        "-d $wheels llguidance==\$(pip show llguidance | sed -n 's/^Version: //p')" >&2
    exit 1
fi

log="$dest/gpu-check.log"
{
    [ $dry = 0 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c "import sys, torch, triton, transformers, pagedserve; print(pagedserve.__file__, 'python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$log"

step() {  # step NAME SECONDS COMMAND...: run it under a timeout, logged, and say how long it took
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    if [ $dry = 1 ]; then  # CPU-only parts, mostly imports: all at once, logged in order by finish_steps
        ( echo "== $name"; timeout "$limit" "$@" 2>&1; rc=$?; echo "$name: $((SECONDS - t0)) s"; exit $rc ) \
            > "$site/step${#running[@]}.log" &
        running+=($!)
        return
    fi
    echo "== $name" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log" || status=1
    echo "$name: $((SECONDS - t0)) s" | tee -a "$log"
}
running=()
finish_steps() {
    local i
    for i in "${!running[@]}"; do
        wait "${running[$i]}" || status=1
        tee -a "$log" < "$site/step$i.log"
    done
}

opts=(-q -p no:randomly -rfEs)
[ $dry = 1 ] && opts+=(--collect-only)
"$py" -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout=150)
parallel=()
[ $dry = 0 ] && "$py" -c "import xdist" 2>/dev/null && parallel=(-n 8)
status=0
# Kernels against torch_ref: many small cases, compiled in parallel.
step "kernel tests" 150 "$py" -m pytest "${opts[@]}" "${parallel[@]}" \
    tests/engine/test_kernels_triton.py tests/engine/test_triton_window.py tests/engine/test_moe_triton.py -k "not generate"
# Engines one at a time: each sizes its KV cache from the GPU memory it finds free.
step "engine tests" 200 "$py" -m pytest "${opts[@]}" tests/engine/test_triton_e2e.py tests/engine/test_models_parity.py \
    tests/engine/test_moe_triton.py::test_moe_models_on_triton_generate_what_torch_does \
    tests/engine/test_sliding_window.py tests/engine/test_odd_shapes.py
# bf16 against transformers' bf16, the fp8 cache against the bf16 cache, int8 weights against the dequantized model.
step "precision tests" 120 "$py" -m pytest "${opts[@]}" tests/engine/test_bf16.py tests/engine/test_kv_cache_fp8.py \
    tests/engine/test_int8.py -k "cuda and (bf16_greedy or greedy_close_to_bf16_cache or greedy_equals_dequantized)"

sweep=()
[ $quick = 1 ] && sweep=(--quick)
step "kernels" 200 "$py" benchmarks/bench_kernels.py "${sweep[@]}" --results-dir "$dest"

if [ $quick = 0 ]; then
    export PAGEDSERVE_RESULTS_DIR="$dest"
    e2e=(--model bench-llama-7b-shape --device cuda --workloads sharegpt --hf-sequential-requests 2
         --hf-static-batches 1 --extra-block-sizes --no-vllm)
    [ $dry = 1 ] && e2e+=(--help)
    step "end to end" 300 "$py" benchmarks/bench_throughput.py "${e2e[@]}"
    # The fp8 KV cache against bf16 at a budget that makes bf16 preempt: 128 requests peak near 1500 blocks, and
    # 4 GiB holds 512 bf16 blocks of the 7B shape.
    fp8=(--model bench-llama-7b-shape --device cuda --kv-mib 4096 --requests 128 --pairs 1)
    [ $dry = 1 ] && fp8+=(--help)
    step "fp8 KV cache" 200 "$py" benchmarks/bench_kv_cache_fp8.py "${fp8[@]}"
fi
finish_steps
exit $status
