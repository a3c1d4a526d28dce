#!/usr/bin/env bash
# One session on a lent GPU, in one call: the device and software, the CUDA loader's probe, the
# gpu tests (every kernel against the torch reference, the KV adapter in fp32, bf16 and fp16),
# then whole decode steps through the KV adapter against DynamicCache in bf16 and fp16, with
# and without cuDNN's SDPA (bench/kv_gpu.py --e2e-only), and a profile of one step; the kernel
# tables (bench/kv_gpu.py without --e2e-only, bench/gpu.py) are not re-run. Each stage has its
# own time limit so that a stage that hangs costs only its own rows. Runs from the source tree
# (PYTHONPATH; the CPU extension is not built: the CPU side of the comparisons runs the torch
# reference).
#
#     OUT=/tmp/gpu bash bench/gpu_session.sh      # logs and result files land in $OUT
set -u
OUT=${OUT:-/tmp/tqvec_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
stage() {  # stage SECONDS COMMAND...: run with a time limit, say how it ended
    local limit=$1; shift
    echo "=== $(date +%T) $* (limit ${limit}s)"
    timeout "$limit" "$@"
    echo "=== exit $? after ${SECONDS}s in all"
    cp bench/results/gpu.json bench/results/gpu.md bench/results/gpu_10m.json \
        bench/results/gpu_10m.md bench/results/kv_gpu.json bench/results/kv_gpu.md \
        bench/results/kv_gpu_e2e.json bench/results/kv_gpu_e2e.md "$OUT/" \
        2>/dev/null
}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit \
        --format=csv
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(0))"
    stage 30 python3 -c "import time; t = time.time(); from tqvec.ops import cuda; \
print('unavailable_reason:', cuda.unavailable_reason(), f'({time.time() - t:.1f}s)')"
    stage 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda.py
    stage 60 python3 -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_turbo.py \
        tests/test_polar.py -k cuda
    stage 330 python3 bench/kv_gpu.py --e2e-only --e2e-dtype bfloat16 float16 \
        --e2e-sdpa cudnn no-cudnn --e2e-ctx 4096 32768 --e2e-batch 1 4 --e2e-steps 16 \
        --out kv_gpu_e2e
    stage 60 python3 bench/kv_gpu.py --e2e-profile --e2e-ctx 4096
} 2>&1 | tee "$OUT/log.txt"
ls -l "$OUT"
