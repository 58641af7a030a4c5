"""Write docs/measured.md, and the README's summary table, from the result files in benchmarks/results/.

Every figure the docs give has one home, a committed result file; this script turns those files
into tables, and the README's "how fast, how good" table into a summary of them, so that a new
result file changes them only by running it again (`tests/unit/test_docs.py` fails until someone
does). Commit hashes appear only here, in the "commit" columns, taken from the files.

    python docs/generate.py           # rewrite docs/measured.md and the README's summary table
    python docs/generate.py --check   # exit 1 if either is not what this script writes
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
OUTPUT = os.path.join(ROOT, "docs", "measured.md")


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
        return json.load(f)


def link(name: str) -> str:
    """A link from docs/ to the result file (or folder) that holds a figure."""
    return f"[`{name}`](../benchmarks/results/{name})"


def short(commit) -> str:
    """The 7-character commit a result file names, whatever form the file gives it in."""
    if isinstance(commit, list):
        return ", ".join(dict.fromkeys(short(c) for c in commit))
    m = re.match(r"[0-9a-f]{7,40}", str(commit or ""))
    return m.group(0)[:7] if m else "?"


def num(x, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def mean_std(s: dict, digits: int = 2, scale: float = 1.0) -> str:
    if s.get("n", len(s.get("values", [None]))) > 1:
        return f"{s['mean'] * scale:,.{digits}f} ± {s['std'] * scale:,.{digits}f}"
    return f"{s['mean'] * scale:,.{digits}f}"


def table(header: list[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


# --- the training step against transformers ---------------------------------------------------

MODEL_FILES = ["model-padding-free-h200-a259644.json", "model-h200-b401318.json", "model-h200-d2af69e.json",
               "model-h100.json"]
PROVIDERS = {
    "bertctl": "bertctl, eager",
    "bertctl/graphs": "bertctl, CUDA graphs",
    "bertctl/unpadded": "bertctl, unpadded",
    "bertctl/unpadded/graphs": "bertctl, unpadded, CUDA graphs",
    "bertctl+compile": "bertctl, `torch.compile`",
    "hf": "transformers",
    "hf+compile": "transformers, `torch.compile`",
}


def model_step() -> list[str]:
    out = ["## The training step against `transformers`", "",
           "`bertctl bench model --compare hf`: one pretraining step (MLM + NSP, bf16, fused AdamW) of "
           "BERT-Base, bertctl's model against `transformers`' `BertForPreTraining` on the same batches; "
           "sequences a second, median of 3 repeats. `base-mixed` is fine-tuning's mix of lengths at "
           "batch 256.", ""]
    for name in MODEL_FILES:
        d = load(name)
        dev = d["device"]
        hf = {r["case"]: r["seq_per_s"] for r in d["train"] if r["provider"] == "hf"}
        rows = []
        for r in d["train"]:
            if r["provider"] not in PROVIDERS:
                continue
            base = hf.get(r["case"])
            rows.append([f"`{r['case']}`", PROVIDERS[r["provider"]], num(r["seq_per_s"]),
                         f"{r['step_ms']:.1f}", f"{r.get('peak_mem_gib', float('nan')):.1f}",
                         f"{r['seq_per_s'] / base:.2f}×" if base else ""])
        out += [f"{dev['name']}, torch {dev['torch']}, commit {short(dev['commit'])}, "
                f"{dev['date'][:10]} ({link(name)}):", ""]
        out += table(["case", "model", "sequences/s", "ms a step", "peak GiB", "against transformers"],
                     rows, right_from=2)
    return out


def padding_free() -> list[str]:
    """Real tokens a second on mixed lengths against full-length batches, in the same run (issue: padding-free)."""
    name = MODEL_FILES[0]
    d = load(name)
    rows_by = {(r["case"], r["provider"]): r for r in d["train"] if "tokens_per_s" in r}
    out = ["### Padding-free: real tokens a second", "",
           "The same run as the first table above: real (non-padding) tokens a second, and each mixed-length "
           "figure against the 128-token case in the same step mode (the padded step's for the unpadded "
           f"providers) ({link(name)}).", ""]
    full = {"bertctl": "bertctl", "bertctl/unpadded": "bertctl", "bertctl/graphs": "bertctl/graphs",
            "bertctl/unpadded/graphs": "bertctl/graphs", "hf": "hf"}
    rows = []
    for (case, provider), r in rows_by.items():
        if provider not in full:
            continue
        ref = rows_by.get(("base-128", full[provider]))
        against = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}×" if ref and case == "base-mixed" else ""
        rows.append([f"`{case}`", PROVIDERS[provider], num(r["tokens_per_s"]), against])
    return out + table(["case", "model", "real tokens/s", "mixed against 128 tokens"], rows, right_from=2)


PROFILE_FILE = "profile-step-mixed-vs-128-h200-a20850c.json"
VARLEN_FILES = ["varlen-attention-mixed128-h200-a20850c.json", "varlen-attention-mixed512-h200-a20850c.json"]


def mixed_step() -> list[str]:
    """Where the mixed-length step's time goes, and what each attention kernel costs on its lengths."""
    prof = load(PROFILE_FILE)["cases"]
    out = ["### Where the mixed-length step goes", "",
           f"The eager step's kernels, by kind, in ms a step ({link(PROFILE_FILE)}):", ""]
    rows = []
    for case, c in prof.items():
        if "PDL" in case:
            continue
        # That run counted FlashAttention's kernels (named with cutlass types) as matmuls: move them over.
        flash = sum(k["ms_per_step"] for k in c["top_kernels"] if "pytorch_flash::" in k["kernel"])
        kinds = {**c["by_kind_ms"], "matmuls": c["by_kind_ms"]["matmuls"] - flash,
                 "attention": c["by_kind_ms"].get("attention", 0.0) + flash}
        rows.append([f"`{case}`", f"{c['kernel_ms']:.2f}"] + [f"{kinds.get(k, 0.0):.2f}" for k in
                    ("matmuls", "attention", "fused ops", "copies, casts, fills", "optimizer, clipping", "other")])
    out += table(["case", "kernels ms", "matmuls", "attention", "fused ops", "copies", "optimizer", "other"], rows)
    out += ["One layer's attention alone, forward and backward with dropout, on the same lengths "
            "(`benchmarks/model/varlen_attention.py`). FlashAttention's variable-length kernel works in tiles of "
            "128 queries and keys, so a sequence shorter than 128 costs a whole tile: on mixed lengths up to 128 it "
            "costs about what cuDNN does on the batch padded.", ""]
    rows = []
    for name in VARLEN_FILES:
        d = load(name)
        for c in d["cases"]:
            if "fwd_bwd_ms" in c:
                rows.append([f"{d['batch']} x up to {d['seq']}", f"`{c['kernel']}`", str(c.get("max_seqlen", "")),
                             f"{c['fwd_bwd_ms']:.3f}", link(name)])
    return out + table(["batch", "kernel", "max_seqlen", "ms", "file"], rows, right_from=2)


def model_history() -> list[str]:
    out = ["### Every committed `bench model` run", "",
           "BERT-Base at 128 tokens (batch 256), the eager step, bertctl against `transformers` in the same run; "
           "MFU is the share of the GPU's bf16 peak the model's FLOPs use.", ""]
    rows = []
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "model-*.json")))
    for name in names:
        d = load(name)
        if not isinstance(d.get("train"), list) or not isinstance(d.get("device"), dict):
            continue
        by = {r["provider"]: r for r in d["train"] if r["case"] == "base-128"}
        if "bertctl" not in by or "hf" not in by:
            continue
        b, h = by["bertctl"], by["hf"]
        rows.append([d["device"]["date"][:10], short(d["device"]["commit"]), d["device"]["name"], num(b["seq_per_s"]),
                     f"{b['mfu'] * 100:.1f}%", num(h["seq_per_s"]), f"{b['seq_per_s'] / h['seq_per_s']:.2f}×", link(name)])
    rows.sort()
    return out + table(["date", "commit", "GPU", "bertctl sequences/s", "MFU", "transformers sequences/s",
                        "against transformers", "file"], rows, right_from=3)


def model_scaling() -> list[str]:
    name = "model-scaling-2xh100-51bdee7.json"
    d = load(name)
    one = {(r["case"], r["provider"]): r["seq_per_s"] for r in d["one_gpu"]["train"]}
    rows = [[f"`{r['case']}`", PROVIDERS.get(r["provider"], r["provider"]), num(one[(r["case"], r["provider"])]),
             num(r["seq_per_s"]), f"{r['seq_per_s'] / one[(r['case'], r['provider'])]:.2f}×"]
            for r in d["two_gpus"]["train"] if (r["case"], r["provider"]) in one and r["provider"].startswith("bertctl")]
    return ["### The training step on two GPUs", "",
            f"`torchrun --nproc-per-node 2 -m bertctl bench model`, the case's batch on each GPU, against one GPU "
            f"of the same 2×H100 host ({link(name)}, commit {short(d['commit'])}):", ""] + table(
        ["case", "step", "1 GPU sequences/s", "2 GPUs sequences/s", "scaling"], rows, right_from=2)


def fused_ops() -> list[str]:
    out = ["## The fused ops (`bertctl bench ops`)", "",
           "Each op at BERT-Base shapes, the fused kernel's median time against eager PyTorch and `torch.compile` of "
           "the same expression (higher is better for bertctl), and the share of the GPU's measured copy bandwidth "
           "it reaches.", ""]
    for name in ("ops-h100.json", "ops-cpu-fp32-2threads-9db954b-a.json"):
        d = load(name)
        dev = d["device"]
        rows = [[r["op"], r["mode"], r["label"], r["dtype"], f"{r['fused_ms']:.3f}", f"{r['vs_eager']:.2f}×",
                 f"{r['vs_compile']:.2f}×" if r.get("vs_compile") else "", f"{r['pct_of_copy_bw']:.0f}%"]
                for r in d["summary"] if r.get("vs_eager") and r["dtype"] in ("bfloat16", "float32")
                and (dev["type"] == "cpu" or r["dtype"] == "bfloat16")]  # training's dtype on each device
        out += [f"{dev['name']}, torch {dev['torch']}, commit {short(dev['commit'])} ({link(name)}):", ""]
        out += table(["op", "pass", "shape", "dtype", "fused ms", "against eager", "against compile",
                      "of copy bandwidth"], rows, right_from=4)
    return out


def data_path() -> list[str]:
    tok, bd, vs = load("tokenizer-vm.json"), load("build-data-cpu.json"), load("vocab-speed-cpu2.json")
    r = tok["results"]
    rows = [
        ["`tokenize encode`, ids, one process",
         f"{r['bertctl encode, cold cache (ids)']['MB_per_s_wall']:.2f} MB/s",
         f"{tok['ratio_to_hf_backend_encode_per_line_cpu']['bertctl encode, cold cache (ids)']:.2f}× the "
         "`tokenizers` backend's per-line encode", short(tok["commit"]), link("tokenizer-vm.json")],
        ["`build-data`, the shared corpus, seq 128", f"{bd['runs']['1']['mb_per_s']:.2f} MB/s with 1 worker",
         f"{bd['speedup_2_workers']:.2f}× with 2 workers", short(bd["commit"]), link("build-data-cpu.json")],
        ["`tokenize train`, 30,522 pieces",
         f"{vs['current']['count_words_workers_2']['wall_s'] + vs['current']['train_from_counts']['wall_s']:.1f} s "
         f"with 2 workers", f"against {vs['baseline']['count_words']['wall_s'] + vs['baseline']['train_from_counts']['wall_s']:.1f} s "
         f"at {short(vs['baseline']['commit'])}, the same vocabulary", short(vs["commit"]), link("vocab-speed-cpu2.json")],
    ]
    return ["## Tokenising and building data (2-core CPU)", ""] + table(
        ["what", "speed", "against", "commit", "file"], rows, right_from=5)


# --- fine-tuning against the transformers Trainer ---------------------------------------------

QUALITY = [("sst2", "SST-2 (MiniLM)"), ("acceptability", "acceptability (CoLA-style)"),
           ("paraphrase", "paraphrase (MRPC-style)"), ("similarity", "similarity (STS-B-style)"),
           ("rte_size", "RTE-size task"), ("conll", "CoNLL-2003 NER"), ("squad", "SQuAD split")]


def finetune_quality() -> list[str]:
    out = ["## Fine-tuning quality against the `transformers` Trainer", "",
           "The same checkpoint, recipe and seeds fine-tuned by `bertctl finetune` and by the "
           "`transformers` Trainer (`benchmarks/finetune/vs_hf.py`); mean ± standard deviation over the "
           "seeds, in points. The target is a difference of at least −0.3 points.", ""]
    rows = []
    for task, label in QUALITY:
        name = f"finetune-{task}.json"
        d = load(name)
        m = d["metric"]
        diff = d["difference"][m]
        rows.append([label, m, mean_std(d["bertctl"][m]), mean_std(d["hf"][m]),
                     f"{diff['mean']:+.2f} (se {diff['standard_error']:.2f})", str(d["bertctl"][m]["n"]),
                     short(d["environment"]["commit"]), link(name)])
    return out + table(["task", "metric", "bertctl", "Trainer", "difference", "seeds", "commits", "file"],
                       rows, right_from=2)


def finetune_speed() -> list[str]:
    out = ["## Fine-tuning speed against the `transformers` Trainer", "",
           "Whole runs, one at a time on one GPU: seconds from process start to `metrics.json`, and "
           "training examples a second as each side reports it.", ""]
    rows = []
    for task in ("sst2", "squad", "rte_size"):
        name = f"finetune-speed-{task}.json"
        d = load(name)
        eps = d["train_examples_per_second"]
        rows.append([task, d["environment"]["device"], mean_std(d["bertctl"]["seconds_to_metrics"], 1),
                     mean_std(d["hf"]["seconds_to_metrics"], 1), num(eps["bertctl"]["mean"]),
                     num(eps["hf"]["mean"]), f"{eps['ratio']:.1f}×", short(d["environment"]["commit"]),
                     link(name)])
    return out + table(["task", "device", "bertctl s", "Trainer s", "bertctl examples/s",
                        "Trainer examples/s", "examples/s ratio", "commits", "file"], rows, right_from=2)


def finetune_gpus() -> list[str]:
    out = ["## Fine-tuning on two GPUs", "",
           "`torchrun --nproc-per-node 2 -m bertctl finetune ...` against one GPU, MiniLM, 3 epochs, "
           "CUDA graphs; mean ± std over seeds (`benchmarks/finetune/ddp.py`).", ""]
    rows = []
    for name in ("finetune-ddp-sst2-2xh200-4502972.json", "finetune-ddp-squad-2xh200-4502972.json"):
        d = load(name)
        one = next(s for s in d["summary"] if s["gpus"] == 1)
        task = "SST-2" if "sst2" in name else "SQuAD split"
        for s in d["summary"]:
            metric = "accuracy" if "accuracy" in s else "f1"
            scale = 100 if s[metric]["mean"] <= 1 else 1
            rows.append([task, str(s["gpus"]), str(s["batch_size"]), mean_std(s["train_examples_per_second"], 0),
                         f"{s['train_examples_per_second']['mean'] / one['train_examples_per_second']['mean']:.2f}×",
                         f"{metric} {mean_std(s[metric], 2, scale)}", short(d["commit"]), link(name)])
    return out + table(["task", "GPUs", "global batch", "examples/s", "against 1 GPU", "metric", "commit",
                        "file"], rows, right_from=1)


# The suite's random restarts side by side on one GPU, through its CUDA MPS daemon; the later runs time more phases.
RESTART_FILES = ["restarts-sst2-minilm-mps-h200-0d0c13c.json", "restarts-sst2-minilm-mps-h200-9c81767.json",
                 "restarts-sst2-minilm-mps-h200-3499d68.json", "restarts-sst2-minilm-mps-h200-fa2d700.json",
                 "restarts-sst2-minilm-mps-separate-h200-fa2d700.json", "restarts-sst2-minilm-mps-h200-68920a3.json",
                 "restarts-sst2-minilm-mps-h200-a5b8d50.json", "restarts-sst2-minilm-mps-h200-3epochs-a5b8d50.json",
                 "restarts-sst2-minilm-mps-h200-b87521f.json", "restarts-sst2-base-mps-h200-0d0c13c.json"]


def finetune_restarts() -> list[str]:
    out = ["## Random restarts side by side", "",
           "`finetune glue --restarts 5` on SST-2 for the epochs shown, its five runs side by side on one H200, against "
           "one run alone (`benchmarks/finetune/restarts.py`); the target is 1.5× one run's wall time. Where every "
           "seed also ran alone, the suite is set against the median alone run too. The suite's own seconds are "
           "its planning and its wall time outside its runs (its start, torch's import for the runs it forks "
           "included, and its end; before runs were forked, its time beyond its longest run).", ""]
    rows = []
    for name in RESTART_FILES:
        d = load(name)
        alone = d.get("alone_seconds_all_seeds")
        median = f"{d['suite_seconds'] / statistics.median(alone):.2f}×" if alone else "–"
        plan = (d.get("suite_since_start") or {}).get("planned")
        beyond = d.get("suite_beyond_runs_seconds", d.get("suite_beyond_longest_run_seconds"))
        rows.append(["BERT-Base-shaped" if "-base-" in name else "MiniLM-shaped", f"{d.get('epochs') or 3:g}",
                     f"{d['one_run_seconds']:.1f}",
                     f"{d['suite_seconds']:.1f}", f"{d['ratio']:.2f}×", median,
                     "–" if plan is None else f"{plan:.2f}", "–" if beyond is None else f"{beyond:.1f}",
                     short(d["environment"]["commit"]), link(name)])
    return out + table(["model", "epochs", "one run s", "5 restarts s", "ratio", "against the median alone", "planning s",
                        "outside its runs s", "commit", "file"], rows, right_from=1)


def finetune_graphs() -> list[str]:
    name = "finetune-graphs-h100.json"
    d = load(name)
    run = d["runs"][0]
    out = ["## Fine-tuning steps as CUDA graphs", "",
           f"{run['model']}, {num(run['steps'])} SST-2 steps at batch 32 on one H100, training examples a "
           f"second in each mode ({link(name)}, commit {short(run['commit'])}):", ""]
    rows = [[mode, " and ".join(num(v) for v in (eps if isinstance(eps, list) else [eps]))]
            for mode, eps in run["examples_per_second"].items()]
    out += table(["step", "examples/s"], rows)
    name = "finetune-graph-min-steps-h200-9b4adab.json"
    d = load(name)
    out += ["Whole runs on an H200 with every batch shape captured (`--graph-min-steps 1`) against the default "
            f"(16), the runs alternating ({link(name)}, commit {short(d['commit'])}):", ""]
    rows = []
    for case, by_setting in d["summary"].items():
        for setting in sorted(by_setting, key=lambda k: int(k.split()[-1])):
            runs = by_setting[setting]
            rows.append([d["cases"][case], setting.split()[-1],
                         " and ".join(f"{r['wall_seconds']:.1f}" for r in runs),
                         str(runs[0]["graphs"]), " and ".join(f"{r['capture_seconds']:.1f}" for r in runs),
                         str(runs[0]["rare_shape_steps"])])
    return out + table(["run", "--graph-min-steps", "wall s", "graphs", "capturing s", "steps eager"], rows,
                       right_from=1)


# --- embedding --------------------------------------------------------------------------------

EMBED_FILES = ["embed-vs-st-h200-fp16-d02edce.json", "embed-vs-st-h200-fp32-d02edce.json",
               "embed-vs-st-h200-fp16-torch-d02edce.json", "embed-vs-st-cpu-c153e17.json",
               "embed-vs-st-cpu-f6c588f.json"]


# Before and after the native encoder's tensor-core attention (e81bcf9) and tokenising by characters (3499d68).
EMBED_LENGTH_FILES = ["embed-vs-st-h200-fp16-short-all-fa2d700.json",
                      "embed-vs-st-h200-fp16-passages-all-0d0c13c.json", "embed-vs-st-h200-fp16-passages-all-e81bcf9.json",
                      "embed-vs-st-h200-fp16-long-all-0d0c13c.json", "embed-vs-st-h200-fp16-long-all-e81bcf9.json",
                      "embed-vs-st-h200-fp16-long-all-3499d68.json"]


def embed_vs_st() -> list[str]:
    out = ["## `bertctl embed` against sentence-transformers", "",
           "The whole `bertctl embed` command (process start to the written file) against a warm "
           "`SentenceTransformer.encode` in its own process on the same texts (67,349 SST-2 train "
           "sentences on the GPU, 2,000 on the CPU), all-MiniLM-L6-v2; medians, the sides alternating "
           "(`benchmarks/embed/vs_sentence_transformers.py`).", ""]
    rows = []
    for name in EMBED_FILES:
        d = load(name)
        what = name[len("embed-vs-st-"):-len(".json")]
        rows.append([d["device"], what.rsplit("-", 1)[0], f"{d['bertctl_median_s']:.2f}",
                     f"{d['sentence_transformers_median_s']:.2f}", f"{d['speedup_median']:.2f}×",
                     short(d["commit"]), link(name)])
    out += table(["device", "run", "bertctl s", "sentence-transformers s", "speed-up", "commit", "file"],
                 rows, right_from=2)
    out += ["Short sentences, passages and long texts: every text of the trajectory's files (269,396 SST-2 "
            "sentences, its training set four times, and 20,000 ~180-token passages on all-MiniLM-L6-v2 at 256 tokens; 10,000 ~330-token texts on a BERT-Base-shaped model at 512), fp16, "
            "one H200; medians of two runs a side, and against sentence-transformers' faster run.", ""]
    rows = []
    for name in EMBED_LENGTH_FILES:
        d = load(name)
        rows.append([name.split("-")[5], f"{d['bertctl_median_s']:.2f}",
                     f"{d['sentence_transformers_median_s']:.2f}", f"{d['speedup_median']:.2f}×",
                     f"{min(d['sentence_transformers_encode_s']) / d['bertctl_median_s']:.2f}×",
                     f"{min(d['bertctl_embedding_s']):.2f}", f"{d['least_cosine_vs_fp32']['bertctl']:.7f}",
                     short(d["commit"]), link(name)])
    out += table(["texts", "bertctl s", "sentence-transformers s", "speed-up", "against its faster run",
                  "embedding loop s", "cosine to fp32", "commit", "file"], rows, right_from=1)
    d = load("embed-backends-cpu-f6c588f.json")
    r = d["results"]
    out += ["`embed` inside one process on the 2-core CPU, all-MiniLM-L6-v2 over 4,000 SST-2 sentences, "
            f"{d['settings']['threads']} threads ({link('embed-backends-cpu-f6c588f.json')}, commit "
            f"{short(d['commit'])}): ONNX Runtime {num(r['onnxruntime']['median_texts_per_s'])} texts/s, "
            f"PyTorch {num(r['torch']['median_texts_per_s'])} ({d['onnxruntime_over_torch']:.2f}×); least "
            f"cosine between the two {d['min_cosine_torch_vs_onnxruntime']:.12f}.", ""]
    return out


# --- pretraining ------------------------------------------------------------------------------

def _default_runs(name: str, d: dict):
    """(label, commit, summary) for each run a default-job file holds; the files come in two forms."""
    if "runs" in d:
        for label, run in d["runs"].items():
            first, _, rest = label.partition(" ")
            if re.fullmatch(r"[0-9a-f]{7,40}", first):  # "<commit> <what>": the run's own commit
                yield rest.strip("()") or "CPU", first, run
            else:
                yield label, d["benchmark"].get("commit"), run
    elif "summary" in d:
        yield d["device"], d["commit"], {**d["summary"], "eval_start_mlm_acc": d["summary"]["eval_start"]["mlm_acc"]}
    else:
        yield d.get("precision", ""), d["benchmark"].get("commit"), {**d, "eval_start_mlm_acc": d["eval_start"]["mlm_acc"]}


def default_job() -> list[str]:
    out = ["## The built-in job (`bertctl pretrain` with no data)", "",
           "Two minutes of a tiny BERT on Python's own documentation; the job re-plans its steps from the "
           "machine's pace, so the step count moves with the load. Held-out masked-LM accuracy on 2,832 "
           "masked tokens (one standard error about 0.007; the majority-token baseline 0.047).", ""]
    rows = []
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "pretrain-default-job-*.json")))
    for name in names:
        d = load(name)
        for label, commit, run in _default_runs(name, d):
            end = run["eval_end"]
            install = run.get("install_seconds") or d.get("benchmark", {}).get("install_seconds")
            rows.append([short(commit), str(label) if "runs" in d else ("H200" if "h200" in name else "CPU"),
                         num(run["steps"]), f"{run['seconds']:.0f}", f"{end['mlm_acc']:.3f}",
                         f"{end['nsp_acc']:.3f}" if "nsp_acc" in end else "",
                         f"{install} s" if install else "", link(name)])
    return out + table(["commit", "run", "steps", "training s", "held-out MLM", "held-out NSP",
                        "install", "file"], rows, right_from=2)


def convergence() -> list[str]:
    name = "convergence-seeds-h200-f29cc4e.json"
    d = load(name)
    p = d["pretraining"]
    out = ["## Pretraining that works (`benchmarks/convergence/run.py`)", "",
           f"A medium BERT pretrained for {d['settings']['minutes']} minutes on one H200 over "
           f"{len(d['pretraining_seeds'])} pretraining seeds, then fine-tuned with the paper's recipe from "
           "that checkpoint (a) and from random weights (b), fine-tuning seeds "
           f"{', '.join(map(str, d['settings']['seeds']))} ({link(name)}, commits {short(d['run_commits'])}; "
           "the method is in [pretraining.md](pretraining.md)).", "",
           f"Pretraining: {num(p['steps']['mean'])} ± {num(p['steps']['std'])} steps in the box, held-out "
           f"MLM accuracy {mean_std(p['heldout_mlm_acc'], 3)}, NSP {mean_std(p['heldout_nsp_acc'], 3)} "
           f"(target {p['nsp_target']}).", ""]
    rows = []
    for task, f in d["finetune"].items():
        a, b = f["pretrained_over_pretraining_seeds"], f["scratch"]
        rows.append([task, f["metric"], mean_std(a), mean_std(b), f"{f['gap_pretrained_minus_scratch']:+.2f}",
                     f"≥ {f['target_gap']:g}"])
    return out + table(["task", "metric", "pretrained (a)", "random init (b)", "(a) − (b)", "target"], rows,
                       right_from=2)


def convergence_runs() -> list[str]:
    out = ["### Every committed run", "",
           "Each run of the benchmark: the main MLM + NSP pretraining run in its time box, held-out accuracy at "
           "its end, and the fine-tuned gaps over random initialisation (a) − (b), mean over fine-tuning seeds. "
           "\"MLM only\" is the paper's No-NSP ablation (§5.1) pretrained in the same box, against (a), where the "
           "run had one.", ""]
    rows = []
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "convergence-*.json")))
    for name in names:
        d = load(name)
        main, t = d.get("pretrain_main"), d.get("finetune", {}).get("table", {})
        if not main or not t:
            continue
        end = main["eval_end"]
        gaps = [f"{t[k]['gap_pretrained_minus_scratch']:+.2f}" if "scratch" in t[k] else "(no b)"
                for k in ("sst2", "conll", "squad")]
        mlm = ["" if "mlm" not in t[k] else f"{t[k]['mlm']['mean'] - t[k]['pretrained']['mean']:+.2f}"
               for k in ("sst2", "conll", "squad")]
        minutes = (d.get("benchmark_time") or {}).get("total_minutes")
        rows.append([short(d["commit"]), ", ".join(d["devices"]), str(d["settings"]["seq"]), num(main["steps"]),
                     f"{end['mlm_acc']:.3f} / {end['nsp_acc']:.3f}", mean_std(t["sst2"]["pretrained"]), *gaps,
                     " / ".join(mlm) if any(mlm) else "", f"{minutes:.1f}" if minutes else "", link(name)])
    return out + table(["commit", "GPU", "seq", "steps", "held-out MLM / NSP", "SST-2 (a)", "SST-2 gap",
                        "CoNLL gap", "SQuAD gap", "MLM only − (a): SST-2 / CoNLL / SQuAD", "GPU minutes", "file"],
                       rows, right_from=2)


def convergence_race() -> list[str]:
    out = ["### Against `transformers`' pretraining", "",
           "The same shards, model, recipe and GPU: `transformers`' `BertForPreTraining` "
           "(`benchmarks/convergence/hf_pretrain.py`) in its time box against `bertctl pretrain`, and the wall "
           "time (from process start) bertctl took to reach the held-out MLM accuracy that `transformers` ended at.",
           ""]
    rows = []
    for name in ("convergence-2xh200-c9ab6e6.json", "convergence-h100.json"):
        r = load(name)["race"]
        rows.append([short(load(name)["commit"]), ", ".join(load(name)["devices"]), f"{r['hf_final_mlm_acc']:.3f}",
                     f"{r['bertctl_final_mlm_acc']:.3f}", f"{r['bertctl_reaches_hf_final_at_seconds']:.0f}",
                     f"{r['time_ratio']:.2f}×", f"{r['target_ratio']}×", link(name)])
    return out + table(["commit", "GPU", "transformers' final MLM", "bertctl's final MLM",
                        "bertctl reaches it at s", "time against transformers", "target", "file"], rows, right_from=2)


def presets() -> list[str]:
    out = ["### Preset learning rates", "",
           "Short runs of each `--model-size` preset on the benchmark's data, held-out MLM accuracy at the end "
           "against the majority-token baseline; \"collapsed\" is the run's own verdict (the model predicts "
           "token frequencies only).", ""]
    rows = []
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "convergence-*.json")))
    for name in names:
        d = load(name)
        for r in d.get("presets") or []:
            if r.get("error") or "mlm_acc" not in r:
                continue
            rows.append([r["size"], num(r["batch"]), f"{r['lr']:.3g}", r.get("optimizer", "adamw"),
                         f"{r['warmup_fraction']:g}", num(r["steps"]), f"{r['mlm_acc']:.3f}",
                         f"{r['majority_baseline']:.3f}", f"{r['nsp_acc']:.3f}", "yes" if r.get("collapsed") or r.get("collapse_warning") else "no",
                         short(d["commit"]), link(name)])
    return out + table(["preset", "batch", "lr", "optimizer", "warm-up", "steps", "held-out MLM", "baseline",
                        "NSP", "collapsed", "commit", "file"], rows, right_from=1)


def trajectory() -> list[str]:
    """Each GPU kind's performance-trajectory runs side by side (`benchmarks/trajectory.py`)."""
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "trajectory-*.json")))
    if not names:
        return []
    out = ["## The performance trajectory (`benchmarks/trajectory.py`)", "",
           "The figures a change to the model, ops, training or embedding code must not worsen by more than 3%, "
           "on randomly initialised models (speed does not depend on the weights): `bench model` per case and "
           "step, whole `embed` commands per text length and backend, and one whole fine-tuning run. Each "
           "column is one run, named by its file; runs of one GPU kind are compared with each other.", ""]
    by_gpu: dict[str, list[tuple[str, dict]]] = {}
    for name in names:
        d = load(name)
        by_gpu.setdefault(d["device"], []).append((name, d))
    for device, runs in by_gpu.items():
        runs.sort(key=lambda r: r[1]["date"])
        keys = list(dict.fromkeys(k for _, d in runs for k in d["figures"]))
        header = ["figure"] + [f"{link(name)} ({d['date'][:10]})" for name, d in runs]
        if len(runs) > 1:
            header.append("last against the first")
        rows = []
        for k in keys:
            vals = [d["figures"].get(k) for _, d in runs]
            row = [f"`{k}`"] + [("" if v is None else num(v, 2 if v < 100 else 0)) for v in vals]
            if len(runs) > 1:
                first, last = vals[0], vals[-1]
                row.append(f"{(last / first - 1) * 100:+.1f}%" if first and last else "")
            rows.append(row)
        out += [f"{device}:", ""] + table(header, rows)
    return out


# --- the README's summary table --------------------------------------------------------------

README = os.path.join(ROOT, "README.md")
README_START = "<!-- generated by docs/generate.py from benchmarks/results/: edit the script, not the table -->"
README_END = "<!-- end of the generated table -->"


def readme_summary() -> list[str]:
    """The README's "how fast, how good" rows, each a summary of a measured.md table, linked to it."""
    quality = [load(f"finetune-{task}.json") for task, _ in QUALITY]
    diffs = [d["difference"][d["metric"]]["mean"] for d in quality]
    seeds = [d["bertctl"][d["metric"]]["n"] for d in quality]
    speed = [load(f"finetune-speed-{t}.json") for t in ("sst2", "squad", "rte_size")]
    ratios = [d["hf"]["seconds_to_metrics"]["mean"] / d["bertctl"]["seconds_to_metrics"]["mean"] for d in speed]
    step = load(MODEL_FILES[0])
    hf = {r["case"]: r["seq_per_s"] for r in step["train"] if r["provider"] == "hf"}
    base = next(r for r in step["train"] if r["case"] == "base-128" and r["provider"] == "bertctl")
    cases = load(MODEL_FILES[0])
    hf_cases = {r["case"]: r["seq_per_s"] for r in cases["train"] if r["provider"] == "hf"}
    case_ratios = [r["seq_per_s"] / hf_cases[r["case"]] for r in cases["train"]
                   if r["provider"] in ("bertctl", "bertctl/graphs", "bertctl/unpadded", "bertctl/unpadded/graphs")]
    gpu_embed = load(EMBED_FILES[0])
    passages, long = load("embed-vs-st-h200-fp16-passages-all-e81bcf9.json"), load(EMBED_LENGTH_FILES[-1])
    cpu_embed = [load(f)["speedup_median"] for f in EMBED_FILES if "-cpu-" in f]
    conv = load("convergence-seeds-h200-f29cc4e.json")
    gaps = ", ".join(f"{task} {f['gap_pretrained_minus_scratch']:+.1f}" for task, f in conv["finetune"].items())
    m = "docs/measured.md#"
    rows = [
        [f"fine-tuning quality, {len(quality)} tasks, {min(seeds)} to {max(seeds)} seeds",
         f"the `transformers` Trainer's: every task within 0.3 points (the largest shortfall "
         f"{-min(diffs):.2f})", f"[tables]({m}fine-tuning-quality-against-the-transformers-trainer)"],
        ["a whole fine-tuning run on one H200",
         f"{min(ratios):.1f} to {max(ratios):.1f} times shorter than the Trainer's",
         f"[tables]({m}fine-tuning-speed-against-the-transformers-trainer)"],
        ["BERT-Base training step, one H200",
         f"{base['seq_per_s'] / hf['base-128']:.2f}× `transformers`' sequences a second at 128 tokens "
         f"({min(case_ratios):.1f}× to {max(case_ratios):.1f}× over lengths and step modes)",
         f"[tables]({m}the-training-step-against-transformers)"],
        ["`bertctl embed` against sentence-transformers' `encode`",
         f"on an H200 (fp16) {gpu_embed['speedup_median']:.1f}× on SST-2's sentences, "
         f"{passages['speedup_median']:.1f}× on ~180-token passages, {long['speedup_median']:.1f}× on ~330-token texts "
         f"(medians; {min(passages['sentence_transformers_encode_s']) / passages['bertctl_median_s']:.1f}× and "
         f"{min(long['sentence_transformers_encode_s']) / long['bertctl_median_s']:.1f}× against its faster run); "
         f"{min(cpu_embed):.1f}× to {max(cpu_embed):.1f}× on the 2-core CPU",
         f"[tables]({m}bertctl-embed-against-sentence-transformers)"],
        [f"pretraining for {conv['settings']['minutes']} minutes on one H200",
         f"fine-tuned gaps over random initialisation: {gaps} points",
         f"[tables]({m}pretraining-that-works-benchmarksconvergencerunpy), [method](docs/pretraining.md)"],
    ]
    return [README_START, ""] + table(["what", "result", "evidence"], rows, right_from=3) + [README_END]


def readme_with_summary(readme: str) -> str:
    start, end = readme.index(README_START), readme.index(README_END) + len(README_END)
    return readme[:start] + "\n".join(readme_summary()) + readme[end:]


SECTIONS = [model_step, padding_free, mixed_step, model_history, model_scaling, trajectory, finetune_quality, finetune_speed, finetune_graphs, finetune_gpus, finetune_restarts, embed_vs_st, default_job, convergence, convergence_runs, convergence_race, presets, fused_ops, data_path]


def render() -> str:
    lines = ["<!-- Generated by docs/generate.py from benchmarks/results/; edit the script, not this file. -->",
             "", "# Measured", "",
             "Every table here is generated from the result files in [`benchmarks/results/`]"
             "(../benchmarks/results/); each names its device, versions, date and commit, and "
             "[the index](../benchmarks/results/INDEX.md) says what every file is and what made it; "
             "[what the studies found](findings.md) says their conclusions in words. GPU figures are from "
             "one NVIDIA H200 or H100 as named; CPU figures from the project's 2-core x86-64 machine.", ""]
    for section in SECTIONS:
        lines += section()
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the generated pages are out of date")
    args = ap.parse_args(argv)
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    pages = {OUTPUT: render(), README: readme_with_summary(readme)}
    if args.check:
        stale = []
        for path, text in pages.items():
            with open(path, encoding="utf-8") as f:
                if f.read() != text:
                    stale.append(os.path.relpath(path, ROOT))
        if stale:
            print(f"{', '.join(stale)} out of date: run python docs/generate.py", file=sys.stderr)
            return 1
        return 0
    for path, text in pages.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
