#!/usr/bin/env bash
# One short GPU check of the model: build the extension, run the CUDA model tests, and time the
# BERT-Base seq-128 pretraining step against transformers (eager) in the same run.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} BERTCTL_CUDA=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/log.txt"
start=$(date +%s)
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - start )) s" | tee -a "$OUT/log.txt"
python3 -m pytest -q -m cuda tests/test_fused_model.py tests/test_model.py 2>&1 | tail -3 | tee -a "$OUT/log.txt"
python3 -m bertctl bench model --compare hf --cases base-128 --steps ${STEPS:-10} --warmup 3 --no-inference \
  --output "$OUT/model-quick.json" 2>&1 | tail -25 | tee -a "$OUT/log.txt"
