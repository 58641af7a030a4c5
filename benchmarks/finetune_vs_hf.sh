#!/usr/bin/env bash
# bertctl vs Hugging Face fine-tuning on one GPU (see finetune_vs_hf.py), run from the repo root.
#
# Inputs (SRC, default .device): SRC/minilm/ (config, vocab, tokenizer files and the weights as
# model.safetensors, or as model.fp16.safetensors when they had to travel at half size: they
# are widened back to fp32 here, so both libraries load the very same fp32 tensors) and
# SRC/data/ with glue/SST-2/{train,dev}.tsv, conll2003/{train,valid,test}.txt,
# squad/{dev-v1.1.json,split.json}, each optionally gzipped.
# Results: OUT (default benchmarks/results/run)/finetune-{sst2,conll,squad}.json.
# Extra arguments go to finetune_vs_hf.py (e.g. --tasks sst2 --limit 500).
set -euo pipefail
SRC=${SRC:-.device}
OUT=${OUT:-benchmarks/results/run}
WORK=${WORK:-/tmp/bertctl-finetune}
mkdir -p "$WORK/data/SST-2" "$WORK/data/conll2003" "$WORK/data/squad" "$WORK/minilm" "$OUT"

unpack() {  # unpack SRC/data/REL(.gz) to WORK/data/DEST
  local rel=$1 dest=$2
  if [ -f "$SRC/data/$rel.gz" ]; then gunzip -c "$SRC/data/$rel.gz" > "$WORK/data/$dest"
  else cp "$SRC/data/$rel" "$WORK/data/$dest"; fi
}
for f in train.tsv dev.tsv; do unpack "glue/SST-2/$f" "SST-2/$f"; done
for f in train.txt valid.txt test.txt; do unpack "conll2003/$f" "conll2003/$f"; done
for f in dev-v1.1.json split.json; do unpack "squad/$f" "squad/$f"; done

cp "$SRC"/minilm/*.json "$SRC"/minilm/vocab.txt "$WORK/minilm/"
rm -f "$WORK/minilm/model.safetensors"
if [ -f "$SRC/minilm/model.safetensors" ]; then cp "$SRC/minilm/model.safetensors" "$WORK/minilm/"
else python3 - "$SRC/minilm/model.fp16.safetensors" "$WORK/minilm/model.safetensors" <<'PY'
import sys, torch
from safetensors.torch import load_file, save_file
state = load_file(sys.argv[1])
save_file({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, sys.argv[2], metadata={"format": "pt"})
PY
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
export PYTHONUNBUFFERED=1
python3 benchmarks/finetune_vs_hf.py --model "$WORK/minilm" --data "$WORK/data" --out "$OUT" --work "$WORK/runs" "$@"
