"""``embed --backend auto``'s choice from measured costs (``bertctl.inference.costs``): the fitted
coefficients rank the backends as every committed run measured them, short sentences and ~180-token
passages go to the native encoder on a GPU, an unavailable backend is never chosen, and the command
says on one line which backend it took and why."""
from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.inference import backends, costs
from bertctl.inference.cost_table import COEFFICIENTS, RUNS, WORKLOADS
from bertctl.inference.embed import EmbedConfig

MINILM, BASE = (6, 384), (12, 768)


def workload(name: str) -> costs.Workload:
    return costs.Workload(**{k: v for k, v in WORKLOADS[name].items() if k in costs.Workload.__dataclass_fields__})


def test_workload_counts_the_padded_batches_by_hand():
    lengths = np.array([5, 9, 2, 9, 3, 7, 1])
    work = costs.Workload.of(lengths, layers=2, hidden=8, batch_tokens=20)
    # Longest first, each batch as many as fit 20 padded tokens: [9, 9], [7, 5], [3, 2, 1].
    batches = [[9, 9], [7, 5], [3, 2, 1]]
    assert work.batches == 3 and work.inputs == 7 and work.tokens == lengths.sum()
    assert work.padded_tokens == sum(len(b) * max(b) for b in batches)
    flop = 24 * 2 * 8 ** 2 / 1e12
    assert work.dense == pytest.approx(flop * lengths.sum())
    assert work.padded_dense == pytest.approx(flop * work.padded_tokens)
    assert work.attention == pytest.approx(4 * 2 * 8 / 1e12 * (lengths ** 2).sum())
    assert work.padded_attention == pytest.approx(4 * 2 * 8 / 1e12 * sum(len(b) * max(b) ** 2 for b in batches))
    assert work.terms("native")["per_dense"] == work.dense and work.terms("torch")["per_dense"] == work.padded_dense


def test_the_coefficients_rank_the_backends_as_every_committed_run_measured_them():
    """For each workload and result file measuring several backends (and each workload over all its
    files), the predicted order of the backends is the measured one."""
    whole = [r for r in RUNS if not r.get("outside_embedding")]
    groups = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in whole:
        groups[(r["workload"], r["source"])][r["backend"]].append(r["seconds"])
        groups[(r["workload"], "all files")][r["backend"]].append(r["seconds"])
    compared = 0
    for (name, source), measured in groups.items():
        if len(measured) < 2:
            continue
        device = WORKLOADS[name]["device"]
        predicted = {b: costs.predict(b, workload(name), device) for b in measured}
        assert sorted(measured, key=lambda b: np.mean(measured[b])) == sorted(measured, key=predicted.get), \
            (name, source, measured, predicted)
        compared += 1
    assert compared >= 6  # passages, long and SST-2 on a GPU in several files; SST-2 on the CPU
    for r in whole:  # and each run's wall within a factor of 2 of its prediction (the model is not a guess)
        if not r.get("embedding_only"):
            predicted = costs.predict(r["backend"], workload(r["workload"]), r["device"])
            assert 0.5 < predicted / r["seconds"] < 2, r


def test_every_coefficient_is_a_cost():
    for device, table in COEFFICIENTS.items():
        for backend, c in table.items():
            assert set(c) == set(costs.TERMS) and all(v >= 0 for v in c.values()), (device, backend, c)
    assert COEFFICIENTS["cuda"]["torch"]["start"] > COEFFICIENTS["cuda"]["native"]["start"]  # torch's import


@pytest.mark.parametrize("case, lengths, model", [
    ("short sentences (SST-2-like, ~14 tokens)", np.random.default_rng(0).integers(4, 30, 67_000), MINILM),
    ("a few short sentences", np.full(10, 12), MINILM),
    ("passages of ~180 tokens", np.random.default_rng(1).integers(150, 210, 20_000), MINILM),
    ("long texts of ~330 tokens", np.random.default_rng(2).integers(280, 380, 10_000), BASE),
])
def test_native_is_chosen_where_it_measured_faster(case, lengths, model):
    work = costs.Workload.of(lengths, *model, batch_tokens=65536)
    chosen, reason = costs.choose(["native", "torch"], work, "cuda")
    assert chosen == "native", (case, reason)
    assert "predicted" in reason and "against torch" in reason


def test_onnxruntime_is_chosen_on_the_cpu_where_it_measured_faster():
    for n in (2, 4000, 100_000):
        work = costs.Workload.of(np.full(n, 14), *MINILM, batch_tokens=1024)
        assert costs.choose(["onnxruntime", "torch"], work, "cpu")[0] == "onnxruntime"


def test_an_unavailable_backend_is_never_chosen():
    rng = np.random.default_rng(3)
    for device, names in (("cuda", ["native", "torch"]), ("cpu", ["onnxruntime", "torch"])):
        for k in (1, 2):
            for available in itertools.combinations(names, k):
                for lengths in (rng.integers(2, 20, 50), rng.integers(200, 512, 500)):
                    work = costs.Workload.of(lengths, *BASE, batch_tokens=65536)
                    assert costs.choose(list(available), work, device)[0] in available
    # a device without measurements: the first available, said so
    assert costs.choose(["torch"], costs.Workload.of(np.array([5]), 2, 8, 64), "mps") == \
        ("torch", "no measured costs for mps; torch is the first available")


def test_auto_on_this_machine_offers_only_what_runs(tmp_path, monkeypatch):
    """On a CPU: never native; onnxruntime only in fp32 and when installed; torch always. The choice
    is one stderr line naming the backend, the prediction and why the others cannot run."""
    from bertctl.inference import onnx_export
    from test_cli_edges import tiny_model

    model = tiny_model(tmp_path / "model")
    fp32, bf16 = EmbedConfig(), EmbedConfig(precision="bf16")
    assert backends.auto_candidates(model, fp32, "cpu", None)[0] == ["onnxruntime", "torch"]
    candidates, why = backends.auto_candidates(model, bf16, "cpu", None)
    assert candidates == ["torch"] and why == {"native": "it runs on a GPU", "onnxruntime": "it runs fp32"}
    monkeypatch.setattr(onnx_export, "onnx_missing", lambda export=True: ["onnxruntime"])
    assert backends.auto_candidates(model, fp32, "cpu", None)[0] == ["torch"]
    monkeypatch.undo()
    texts = tmp_path / "in.txt"
    texts.write_text("the cat sat\na dog ran\n", encoding="utf-8")
    for precision, chosen in (("fp32", "onnxruntime"), ("bf16", "torch")):
        r = CliRunner().invoke(app, ["embed", "--model", str(model), "--precision", precision, "--no-progress",
                                     "-o", str(tmp_path / f"{precision}.npy"), str(texts)])
        assert r.exit_code == 0, r.output
        lines = [line for line in r.stderr.splitlines() if "--backend auto" in line]
        assert len(lines) == 1 and lines[0].startswith(f"--backend auto: {chosen} ("), r.stderr
        assert f"({chosen})" in " ".join(r.stderr.split())  # the summary line names the backend that ran
