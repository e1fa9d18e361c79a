#!/usr/bin/env bash
# The prepared device check (issue 30): CUDA correctness, the kernels against HBM, the 8B-shaped speed against
# the weight-read limit, CUDA graphs, the official Fast-dLLM dual cache side by side. One run of about 8
# minutes on an H100 / H200, from the repository root, the official code carried in .official/ (git-ignored;
# eval/gpu/official_fastdllm.py says how to get it):
#
#   bash eval/gpu/check.sh            # on the GPU machine; OUT: where the results go (default /tmp/gpu-check)
#   REHEARSAL=1 bash eval/gpu/check.sh   # the same steps on the CPU, scaled down (the --small paths)
#
# Each step runs under its own time limit, so a slow or failing step costs only its box and the next one runs;
# every step's log goes to $OUT/check.tar.gz as soon as it ends (the device tool returns at most 8 files), and
# a summary of every step is printed last.
set -u
OUT=${OUT:-/tmp/gpu-check}
WORK=$(mktemp -d)
mkdir -p "$OUT" "$WORK/results"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor

if [ -n "${REHEARSAL:-}" ]; then
    export TRITON_INTERPRET=1
    DEVICE=(--device cpu --small)
    CORRECTNESS=(-k "126464 and 0.0-torch.bfloat16-None or kernel_b or llada-llada or threshold-dual-auto")
else
    DEVICE=()
    CORRECTNESS=()
fi

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to $WORK/NAME.log, pack the results
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (at most ${limit} s): $*"
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$WORK/steps.txt"
    tar -czf "$OUT/check.tar.gz" -C "$WORK" --exclude=inductor . 2>/dev/null
}

machine() {  # the device, the versions, and the two ceilings measured (copy bandwidth, bf16 matrix product)
    git rev-parse HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv || true
    python3 - <<'EOF'
import torch, transformers
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "none"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, transformers {transformers.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
    x = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB, random (never zeros)
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for name, fn, amount, unit in [
        ("copy", lambda: y.copy_(x), 2 * x.numel() * 2, "GB/s read + written"),
        ("bf16 matmul 8192^3", lambda: a @ b, 2 * 8192**3, "TFLOP/s"),
    ]:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000 / 20
        print(f"{name}: {amount / seconds / (1e9 if unit.startswith('GB') else 1e12):.0f} {unit}")
EOF
}

export -f machine
step 0-machine 30 bash -c machine
step 1-correctness 150 python3 -m pytest -v -s -p no:cacheprovider --tb=short eval/gpu/test_cuda.py "${CORRECTNESS[@]}"
if [ -z "${REHEARSAL:-}" ]; then
    step 2-kernels 60 python3 -m dllm.bench.kernels
else
    step 2-kernels 60 env TRITON_INTERPRET= python3 -m dllm.bench.kernels  # no GPU: says so and exits 0
fi
step 3-speed 130 python3 -m dllm.bench.speed "${DEVICE[@]}" --shapes llada-8b --batch-sizes 1,8 \
    --caches none,prefix,dual --out "$WORK/results"
step 4-captured 110 python3 -m dllm.bench.speed "${DEVICE[@]}" --shapes llada-8b --batch-sizes 1 --caches dual \
    --settings threshold --compile reduce-overhead --out "$WORK/results"
step 5-official 70 python3 eval/gpu/official_fastdllm.py "${DEVICE[@]}" --out "$WORK/results"

echo
echo "== summary"
cat "$WORK/steps.txt"
echo "-- 0 machine"; cat "$WORK/0-machine.log"
echo "-- 1 correctness"; grep -E "FAILED|ERROR|passed|failed|recordings" "$WORK/1-correctness.log" | tail -n 30
echo "-- 2 kernels"; grep -E "^\||HBM|NO" "$WORK/2-kernels.log" | tail -n 40
for name in 3-speed 4-captured 5-official; do  # the final tables (the speed bench prints each row as it goes too)
    echo "-- $name"; awk '/^\| (shape )?\|/ {table=1} table && /^\|/ || /Same tokens|Error/' "$WORK/$name.log" | tail -n 40
done
