#!/usr/bin/env bash
# On the GPU machine: build the CUDA extension, run the CUDA tests of the kernels, then
# `bertctl bench ops`.  Logs and JSON go to $OUT (default ./gpu-out).
#   BERTCTL_COMMIT=$(git rev-parse HEAD) benchmarks/gpu_kernels.sh [quick|bf16|full|bench|ncu]
#   (bench: skip the tests; BERTCTL_COMMIT names the commit where the copy has no .git)
set -uo pipefail
MODE=${1:-quick}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} BERTCTL_CUDA=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
start=$(date +%s)
if ! python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
# Registers / spills of every kernel (no spills expected).
cuobjdump -res-usage bertctl/_C*.so 2>/dev/null | grep -B1 -E "STACK:[1-9]|LOCAL:[1-9]" | head -20 > "$OUT/spills.txt"
echo "kernels with stack/local memory: $(grep -c Function "$OUT/spills.txt")"
python3 -m bertctl env
if [ "$MODE" != bench ] && [ "$MODE" != ncu ]; then
  start=$(date +%s)
  python3 -m pytest -q --maxfail=30 -m cuda -p no:cacheprovider tests/test_ops.py tests/test_fused_model.py tests/test_ops_bench.py \
    > "$OUT/pytest-cuda.log" 2>&1
  echo "pytest -m cuda: rc=$? in $(( $(date +%s) - start )) s"; tail -15 "$OUT/pytest-cuda.log"
fi
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE "H100|H200|A100|L40S|[A-Z][0-9]+" | head -1)
if [ "$MODE" = ncu ]; then
  :
elif [ "$MODE" = quick ]; then
  python3 -m bertctl bench ops --device cuda --dtype bfloat16 --quick --output "$OUT/ops-${name,,}-bf16-quick.json" \
    2> "$OUT/bench.log"
elif [ "$MODE" = bf16 ]; then  # all shapes, bf16 only (the targets)
  python3 -m bertctl bench ops --device cuda --dtype bfloat16 --output "$OUT/ops-${name,,}-bf16.json" \
    2> "$OUT/bench.log"
else  # bf16 (the targets), then fp16 and fp32
  python3 -m bertctl bench ops --device cuda --dtype bfloat16 --dtype float16 --dtype float32 \
    --output "$OUT/ops-${name,,}.json" 2> "$OUT/bench.log"
fi
[ "$MODE" != ncu ] && { echo "bench rc=$?"; grep -A60 "^op " "$OUT/bench.log"; }
if [ "$MODE" = ncu ] || [ "${NCU:-0}" = 1 ]; then  # Nsight Compute: speed of light, occupancy, stall reasons per kernel
  PYTHONPATH="$PWD" ncu --target-processes all --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    -k regex:'softmax|ln_|bias_gelu|column_sum' python3 benchmarks/ncu_ops.py > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "^  [a-z_]+.*\(|DRAM Throughput|Compute \(SM\) Throughput|Duration|Achieved Occupancy|Registers Per|Issue Slots|Stall" "$OUT/ncu.txt" | head -120
fi
