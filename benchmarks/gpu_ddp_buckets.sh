#!/usr/bin/env bash
# On a 2-GPU machine: the eager BERT-Base 128 step on 1 GPU, then DDP on 2 with several all-reduce
# bucket sizes (BERTCTL_DDP=bucket_mb=N).  OUT=dir BUCKETS="25 50" benchmarks/gpu_ddp_buckets.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 BERTCTL_CUDA=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$(date +%s)
python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "build $(( $(date +%s) - start )) s"; rm -f $OUT/build.log
python3 -m bertctl bench model --cases base-128 --no-inference --steps 10 --warmup 3 -o $OUT/one.json > /dev/null 2> $OUT/one.log
for b in ${BUCKETS:-25 50 100 200}; do
  BERTCTL_DDP=bucket_mb=$b python3 -m torch.distributed.run --nproc-per-node 2 -m bertctl bench model --cases base-128 \
    --no-inference --steps 10 --warmup 3 -o $OUT/two-$b.json > /dev/null 2> $OUT/two-$b.log
  python3 - $OUT $b <<'PY'
import json, sys
out, b = sys.argv[1], sys.argv[2]
r1 = json.load(open(f"{out}/one.json"))["train"][0]
r2 = json.load(open(f"{out}/two-{b}.json"))["train"][0]
print(f"bucket {b} MB: 1 GPU {r1['seq_per_s']} seq/s, 2 GPUs {r2['seq_per_s']} seq/s -> {r2['seq_per_s'] / r1['seq_per_s']:.3f}x")
PY
done
