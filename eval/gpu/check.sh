#!/usr/bin/env bash
# The prepared device check (issue 30): CUDA correctness, the kernels against HBM, the 8B-shaped speed against
# the weight-read limit, CUDA graphs, the official Fast-dLLM dual cache side by side, where a step's time goes.
# The device step (issue 40, dllm/engine/device.py) is measured by the same steps: step 1 checks it on CUDA (no
# synchronisation inside a step, eager's tokens and forwards, nothing recorded by a second captured generation),
# step 4's --compile reduce-overhead compiles the whole step, step 6 profiles eager, device and captured.
# Run from the repository root on an H100 / H200, the official code carried in .official/ (git-ignored;
# eval/gpu/official_fastdllm.py says how to get it):
#
#   bash eval/gpu/check.sh            # on the GPU machine; OUT: where the results go (default /tmp/gpu-check)
#   REHEARSAL=1 bash eval/gpu/check.sh   # the same steps on the CPU, scaled down (the --small paths)
#   STEPS="1 6" K="kernel_a" bash eval/gpu/check.sh   # some steps only (K: a pytest -k filter for step 1)
#   MODES / MODES8: profile_step.py's modes at batch 1 / 8; FAMILIES_ARGS: families.py's options (a rerun's subset)
# All seven steps take about 11 minutes on an H200 (eval/results/gpu/README.md), more than one call's 10: run
# them as STEPS="0 1 2 3" and STEPS="4 5 6". Steps 7-9 (issue 45): the MoE and encoder-decoder families at their
# published widths (eval/gpu/families.py), the constraint's cost per step with the logits on the GPU, dllm serve at
# 1 / 8 / 32 clients; step 10 (issue 44): dllm serve under open-loop load, requests joining the running rows against a
# batch of mixed settings at a time and a batch per setting (python -m dllm.bench.open_loop). BUDGET (seconds, default 540): the whole run's limit; a step gets at
# most what is left of it, and a step with under 20 s left is skipped, so the call ends in time with every earlier
# step's logs. LIMIT_<step> (LIMIT_4=300): a step's own limit instead of its default.
#
# Packages the device machine lacks (the constraints' and the server's: eval/results/gpu/README.md lists them) travel
# as wheels in .whl/ (git-ignored; carried by the device tool) and are installed into /tmp/site first.
#
# Each step runs under its own time limit, so a slow or failing step costs only its box and the next one runs;
# every step's log goes to $OUT/check.tar.gz as soon as it ends (the device tool returns at most 8 files), and
# a summary of every step is printed last.
set -u
OUT=${OUT:-/tmp/gpu-check}
WORK=$(mktemp -d)
mkdir -p "$OUT" "$WORK/results"
if [ -d .whl ] && [ -z "${REHEARSAL:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
BUDGET=${BUDGET:-540}
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor

STEPS=" ${STEPS:-0 1 2 3 4 5 6} "
if [ -n "${REHEARSAL:-}" ]; then
    export TRITON_INTERPRET=1
    DEVICE=(--device cpu --small)
    K=${K:-"126464 and 0.0-torch.bfloat16-None or kernel_b or llada-llada or threshold-dual-auto"}
else
    DEVICE=()
fi
CORRECTNESS=()
[ -n "${K:-}" ] && CORRECTNESS=(-k "$K")

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to $WORK/NAME.log, pack the results
    local name=$1 limit=$2 start=$SECONDS
    local override=LIMIT_${name%%-*}  # LIMIT_4=300: step 4's own limit (the whole step's compile at 8B takes minutes)
    limit=${!override:-$limit}
    shift 2
    [[ $STEPS == *" ${name%%-*} "* ]] || return 0
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "$name: skipped, $left s of the budget left" | tee -a "$WORK/steps.txt"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
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
step 3-speed 160 python3 -m dllm.bench.speed "${DEVICE[@]}" --shapes llada-8b --batch-sizes 1,8 \
    --caches none,prefix,dual --out "$WORK/results"
step 4-captured 90 python3 -m dllm.bench.speed "${DEVICE[@]}" --shapes llada-8b --batch-sizes 1 --caches dual \
    --settings threshold --compile reduce-overhead --out "$WORK/results"
step 5-official 60 python3 eval/gpu/official_fastdllm.py "${DEVICE[@]}" --out "$WORK/results"
step 6-profile 150 python3 eval/gpu/profile_step.py "${DEVICE[@]}" --modes "${MODES:-eager,device,captured}" \
    --out "$WORK/results"
step 7-families 170 python3 eval/gpu/families.py "${DEVICE[@]}" ${FAMILIES_ARGS:-} --out "$WORK/results"
if [ -z "${REHEARSAL:-}" ]; then
    step 8-structured 60 python3 -m dllm.bench.structured --cost-only --device cuda --out "$WORK/results/structured.md"
    step 9-serve 150 python3 -m dllm.bench.serve --requests 32 --out "$WORK/results/serve.md"
    step 10-open-loop 210 python3 -m dllm.bench.open_loop --rates 8,32,128 --requests 128 \
        --out "$WORK/results/serve-open-loop.md"
else
    step 8-structured 60 python3 -m dllm.bench.structured --cost-only --vocab 32000 --canvas 64 \
        --out "$WORK/results/structured.md"
    step 9-serve 150 python3 -m dllm.bench.serve --models tiny-llada --clients 1,2 --requests 4 \
        --out "$WORK/results/serve.md"
    step 10-open-loop 90 python3 -m dllm.bench.open_loop --rates 8 --requests 4 --out "$WORK/results/serve-open-loop.md"
fi
step 6b-profile 120 python3 eval/gpu/profile_step.py "${DEVICE[@]}" --batch 8 --modes "${MODES8:-device,captured}" \
    --out "$WORK/results"

echo
echo "== summary"
cat "$WORK/steps.txt"
cd "$WORK" || exit 1
[ -f 0-machine.log ] && { echo "-- 0 machine"; cat 0-machine.log; }
[ -f 1-correctness.log ] && { echo "-- 1"; grep -E "FAILED|ERROR|passed|failed|recordings|grouped GEMM|reads:" 1-correctness.log | tail -n 40; }
[ -f 2-kernels.log ] && { echo "-- 2 kernels"; grep -E "^\||HBM|NO" 2-kernels.log | tail -n 40; }
for name in 3-speed 4-captured 5-official 6-profile 6b-profile 7-families; do  # the final tables (the speed bench prints rows as it goes)
    [ -f $name.log ] || continue
    echo "-- $name"; awk '/^\| (shape |mode )?\|/ {table=1} table && /^\|/ || /Same tokens|Error|limit|first forward/' $name.log | tail -n 40
done
for name in 6-profile 6b-profile; do
    [ -f $name.log ] && grep -E "kernels per forward" $name.log
done
[ -f results/structured.md ] && { echo "-- 8 structured"; grep -E "^\||costs|context-free" results/structured.md; }
[ -f results/serve.md ] && { echo "-- 9 serve"; grep -E "^\||Machine" results/serve.md; }
[ -f results/serve-open-loop.md ] && { echo "-- 10 open loop"; grep -E "^\||Machine" results/serve-open-loop.md; }
