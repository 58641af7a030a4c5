#!/usr/bin/env bash
# The model benchmark and a short real pretraining run on the GPU machine, run from the repo root.
#
#   benchmarks/gpu_model.sh one   # 1 GPU: bench model --compare hf --compile (BERT-Base 128/512,
#                                 #   BERT-Large 128), then the default-job corpus pretraining
#                                 #   BERT-Base, bf16 + torch.compile, batch 256; meanwhile the
#                                 #   built-in default job on 4 CPU threads (a laptop's worth)
#   benchmarks/gpu_model.sh two   # 2 GPUs: 1-GPU and torchrun 2-GPU DDP throughput of the same step,
#                                 #   eager and torch.compile, on the same machine, then a real torchrun
#                                 #   pretraining run (torch.compile inside DDP)
#
# Results go to $OUT (default ./gpu-out): log.txt, model-<gpu>.json, pretrain-<gpu>.json (the run's
# JSON summary), pretrain-metrics.jsonl, pretrain-curves.png, default-job-cpu.json; two: scaling-<gpu>.json,
# pretrain-ddp2-<gpu>.json.
# The compiled extension is built unless a CUDA build is already importable (a module built on an
# earlier machine can be carried in as bertctl/_C*.so); the built module is copied to $OUT.
set -uo pipefail
MODE=${1:-one}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} BERTCTL_CUDA=1
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
say() { echo "$@" | tee -a "$LOG"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE "H100|H200|A100|L40S" | head -1)
name=${name:-gpu}; name=${name,,}
python3 -c "import torch, transformers, typer, rich; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" 2>&1 | tee -a "$LOG"

has_cuda_ext() {
  python3 -c "from bertctl._ext import kernels_loaded; import sys; sys.exit(0 if 'CUDA' in kernels_loaded().get('layer_norm', []) else 1)" 2>/dev/null
}
# BUILD=0: no build (plain PyTorch ops, BERTCTL_NO_EXT=1), e.g. to spend a 2-GPU lease on measuring only.
if [ "${BUILD:-1}" = 0 ]; then
  export BERTCTL_NO_EXT=1
  say "no extension build: plain PyTorch ops"
elif ! has_cuda_ext; then
  start=$(date +%s)
  if ! python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    grep -E "error|Error" "$OUT/build.log" | head -40; exit 1
  fi
  rm -f "$OUT/build.log"
  say "build: $(( $(date +%s) - start )) s"
  cp bertctl/_C*.so "$OUT/" 2>/dev/null
fi
python3 -m bertctl env 2>&1 | tail -20 >> "$LOG"

if [ "$MODE" = one ]; then
  # The default job on the CPU, 4 threads (a laptop's worth), while the GPU is measured.
  (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 python3 -m bertctl pretrain --device cpu --no-progress \
     --output /tmp/bertctl-default-run > "$OUT/default-job-cpu.json" 2> "$OUT/default-job-cpu.log") &
  cpu_job=$!
  start=$(date +%s)
  python3 -m bertctl bench model --compare hf --compile --steps ${STEPS:-10} --warmup 3 \
    --output "$OUT/model-$name.json" > /dev/null 2>> "$LOG"
  say "bench model rc=$? in $(( $(date +%s) - start )) s"

  # A short real run: Python's docs -> vocabulary -> shards -> BERT-Base, bf16 + compile, with
  # whichever kernels were faster under compile in the benchmark just run.
  kernels=$(python3 - "$OUT/model-$name.json" <<'PY'
import json, sys
rows = {r["provider"]: r.get("seq_per_s", 0) for r in json.load(open(sys.argv[1]))["train"] if r["case"] == "base-128"}
print("torch" if rows.get("bertctl/torch-ops+compile", 0) > rows.get("bertctl+compile", 0) else "auto")
PY
)
  say "pretrain with --kernels ${kernels:-auto}"
  start=$(date +%s)
  python3 -m bertctl pretrain --model-size base --batch-size 256 --lr 1e-4 --max-steps ${PRETRAIN_STEPS:-80} \
    --warmup-steps 8 --compile --kernels ${kernels:-auto} --precision bf16 --minutes 6 --log-every 10 --no-progress \
    --output /tmp/bertctl-base-run > "$OUT/pretrain-$name.json" 2>> "$LOG"
  say "pretrain rc=$? in $(( $(date +%s) - start )) s"
  cp /tmp/bertctl-base-run/metrics.jsonl "$OUT/pretrain-metrics.jsonl" 2>/dev/null
  cp /tmp/bertctl-base-run/curves.png "$OUT/pretrain-curves.png" 2>/dev/null
  grep '"event": "train"' /tmp/bertctl-base-run/metrics.jsonl | tail -3 | tee -a "$LOG"
  wait $cpu_job
  say "default job (CPU) rc=$?"; tail -3 "$OUT/default-job-cpu.log" | tee -a "$LOG"
  cat "$OUT/default-job-cpu.log" >> "$LOG"; rm -f "$OUT/default-job-cpu.log"
else
  # The default job on 4 CPU threads, and data for a real 2-GPU run, while the GPUs are measured.
  (CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 python3 -m bertctl pretrain --device cpu --no-progress \
     --output /tmp/bertctl-default-run > "$OUT/default-job-cpu.json" 2> "$OUT/default-job-cpu.log") &
  cpu_job=$!
  (python3 -c "from bertctl.default_job import prepare_default_data as p; p('/tmp/ddp-work', show_progress=False)" \
     >> "$LOG" 2>&1) &
  prep=$!
  start=$(date +%s)
  # Eager and torch.compile (the compiled model inside DistributedDataParallel on 2 GPUs).
  python3 -m bertctl bench model --cases base-128 --no-inference --compile --steps ${STEPS:-10} --warmup 3 \
    --output "$OUT/scaling-1gpu.json" > /dev/null 2>> "$LOG"
  say "1 GPU rc=$? in $(( $(date +%s) - start )) s"
  start=$(date +%s)
  python3 -m torch.distributed.run --nproc-per-node 2 -m bertctl bench model --cases base-128 --no-inference \
    --compile --steps ${STEPS:-10} --warmup 3 --output "$OUT/scaling-2gpu.json" > /dev/null 2>> "$LOG"
  say "2 GPUs rc=$? in $(( $(date +%s) - start )) s"
  python3 - "$OUT" "$name" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
out, name = sys.argv[1], sys.argv[2]
one = json.load(open(f"{out}/scaling-1gpu.json"))
two = json.load(open(f"{out}/scaling-2gpu.json"))
rows = []
for r1 in one["train"]:
    r2 = next((r for r in two["train"] if r["provider"] == r1["provider"] and r["case"] == r1["case"]), None)
    if r2 is None or "seq_per_s" not in r1 or "seq_per_s" not in r2:
        continue
    rows.append({"case": r1["case"], "provider": r1["provider"], "one_gpu": r1, "two_gpus": r2,
                 "speedup": round(r2["seq_per_s"] / r1["seq_per_s"], 3)})
    print(f"DDP scaling {r1['case']} {r1['provider']}: 1 GPU {r1['seq_per_s']} seq/s, "
          f"2 GPUs {r2['seq_per_s']} seq/s -> {rows[-1]['speedup']}x")
json.dump({"benchmark": "ddp-scaling", "device": one["device"], "rows": rows}, open(f"{out}/scaling-{name}.json", "w"),
          indent=2)
PY
  rm -f "$OUT/scaling-1gpu.json" "$OUT/scaling-2gpu.json"
  wait $prep
  # The real training loop under torchrun + NCCL: BERT-Base, global batch 512 (256 per GPU), bf16, compiled.
  start=$(date +%s)
  python3 -m torch.distributed.run --nproc-per-node 2 -m bertctl pretrain --data /tmp/ddp-work/data \
    --model-size base --batch-size 512 --lr 1e-4 --max-steps ${DDP_STEPS:-40} --warmup-steps 4 --log-every 10 \
    --compile --no-progress --output /tmp/ddp-run > "$OUT/pretrain-ddp2-$name.json" 2>> "$LOG"
  say "torchrun pretrain rc=$? in $(( $(date +%s) - start )) s"
  grep '"event": "train"' /tmp/ddp-run/metrics.jsonl | tail -2 | tee -a "$LOG"
  wait $cpu_job
  say "default job (CPU) rc=$?"; tail -3 "$OUT/default-job-cpu.log" | tee -a "$LOG"
  cat "$OUT/default-job-cpu.log" >> "$LOG"; rm -f "$OUT/default-job-cpu.log"
  cp /tmp/bertctl-default-run/metrics.jsonl "$OUT/default-job-metrics.jsonl" 2>/dev/null
fi
