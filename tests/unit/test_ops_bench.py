"""``bertctl bench ops`` on tiny shapes: the report's structure and its arithmetic."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bertctl.bench import harness
from bertctl.bench.ops import Case, min_bytes
from bertctl.cli.app import app


def tiny_report(tmp_path, device: str, reps: int) -> dict:
    """`bertctl bench ops --tiny` for the fused and eager providers; the JSON report it wrote."""
    out = tmp_path / "ops.json"
    result = CliRunner().invoke(app, ["bench", "ops", "--device", device, "--tiny", "--reps", str(reps),
                                      "--provider", "fused", "--provider", "eager", "--output", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


@pytest.mark.usefixtures("fused_kernels")
def test_bench_ops_cli_writes_report(tmp_path):
    report = tiny_report(tmp_path, "cpu", reps=3)
    device = report["device"]
    for key in ("name", "torch", "cuda", "commit", "date", "copy_gbps"):
        assert key in device
    assert device["copy_gbps"] > 0
    rows = report["rows"]
    assert {(r["op"], r["mode"], r["provider"]) for r in rows} == {
        (op, mode, p) for op in ("softmax", "layer_norm", "bias_gelu", "bias_dropout_add_layer_norm", "cross_entropy")
        for mode in ("fwd", "fwdbwd") for p in ("fused", "eager")}
    for r in rows:
        assert r["median_ms"] > 0
        # GB/s is the minimal byte count over the median time; % is against the measured copy bandwidth.
        assert r["gbps"] == pytest.approx(r["min_bytes"] / (r["median_ms"] * 1e-3) / 1e9, rel=1e-2, abs=0.1)
        assert r["pct_of_copy_bw"] == pytest.approx(100 * r["gbps"] / device["copy_gbps"], rel=1e-2, abs=0.1)
    assert len(report["summary"]) == 10 and all("vs_eager" in s for s in report["summary"])


@pytest.mark.usefixtures("fused_kernels")
def test_bench_ops_separate_provider_times_the_ops_apart_where_there_are_some(tmp_path):
    """The separate provider (bertctl's ops one after another) runs for an op that fuses others, and is left out
    for the rest; the summary compares the fused op with it."""
    out = tmp_path / "ops.json"
    result = CliRunner().invoke(app, ["bench", "ops", "--device", "cpu", "--tiny", "--reps", "2", "--rounds", "1",
                                      "--op", "layer_norm", "--op", "bias_dropout_add_layer_norm",
                                      "--provider", "fused", "--provider", "separate", "--output", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {(r["op"], r["provider"]) for r in report["rows"]} == {
        ("layer_norm", "fused"), ("bias_dropout_add_layer_norm", "fused"), ("bias_dropout_add_layer_norm", "separate")}
    assert [("vs_separate" in s) for s in report["summary"]] == [False, False, True, True]


@pytest.mark.usefixtures("fused_kernels")
def test_bench_ops_cli_times_only_the_ops_asked_for(tmp_path):
    out = tmp_path / "ops.json"
    result = CliRunner().invoke(app, ["bench", "ops", "--device", "cpu", "--tiny", "--reps", "2", "--rounds", "2",
                                      "--op", "layer_norm", "--provider", "fused", "--output", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {(r["op"], r["mode"]) for r in report["rows"]} == {("layer_norm", "fwd"), ("layer_norm", "fwdbwd")}
    assert all(r["runs"] == 4 for r in report["rows"])  # 2 rounds x 2 calls
    assert report["config"]["rounds"] == 2
    for key in ("loadavg_before", "loadavg_after"):  # how busy the (shared) machine was
        assert len(report["device"][key]) == 3


def test_bench_ops_rejects_unknown_op():
    result = CliRunner().invoke(app, ["bench", "ops", "--device", "cpu", "--op", "attention"])
    assert result.exit_code == 2
    assert "--op" in result.output


def test_bench_ops_help_names_every_op():
    from bertctl.bench.ops import OPS

    result = CliRunner().invoke(app, ["bench", "ops", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert all(op in result.output for op in OPS)


def test_bench_ops_rejects_bad_device():
    result = CliRunner().invoke(app, ["bench", "ops", "--device", "tpu"])
    assert result.exit_code == 2
    assert "--device" in result.output


def test_min_bytes_counts_each_tensor_once():
    # LayerNorm fwd (no grad) on 4 x 8 fp32: x, residual, y (3 x 128 B) + weight, bias (2 x 32 B)
    assert min_bytes(Case("layer_norm", (4, 8), "t"), "fwd", 4) == 3 * 128 + 2 * 32
    # bias+dropout+residual+LayerNorm fwd+bwd on 4 x 8 fp32: x, residual, y; dy, x, residual, dresidual, dx
    # (8 x 128 B) + bias, weight, ln_bias, then bias, weight, dbias, dweight, dln_bias (8 x 32 B) + mean/rstd
    # written and read (2 x 32 B)
    assert min_bytes(Case("bias_dropout_add_layer_norm", (4, 8), "t"), "fwdbwd", 4) == 8 * 128 + 8 * 32 + 2 * 32
    # ... with the backward from the output: x, residual, y; dy, y, dresidual, dx (7 x 128 B) + bias, weight,
    # ln_bias, then bias, weight, ln_bias, dbias, dweight, dln_bias (9 x 32 B) + mean/rstd written, rstd read
    assert min_bytes(Case("bias_dropout_add_layer_norm", (4, 8), "t"), "fwdbwd", 4,
                     from_output=True) == 7 * 128 + 9 * 32 + 3 * 16
    # softmax fwd+bwd on (1, 1, 2, 4) bf16: x, y, dy, y, dx (5 x 16 B) + the (1, 4) mask
    assert min_bytes(Case("softmax", (1, 1, 2, 4), "t"), "fwdbwd", 2) == 5 * 16 + 4
    # cross-entropy fwd+bwd on (3, 5) bf16 logits: logits, logits, dlogits (3 x 30 B) + per row the label,
    # the fp32 loss and its gradient (16 B)
    assert min_bytes(Case("cross_entropy", (3, 5), "t"), "fwdbwd", 2) == 3 * 30 + 3 * 16
    assert harness.rotation_count(harness.CACHE_BYTES // 3) == 4


def test_call_spans_groups_device_work_between_sleep_markers():
    us = [  # (name, start, end) in microseconds, deliberately out of order
        ("ln_fwd_packed", 112.0, 122.0),
        ("at::cuda::spin_kernel(long)", 0.0, 100.0),
        ("warm-up kernel before any marker", -50.0, -40.0),
        ("at::cuda::spin_kernel(long)", 130.0, 230.0),
        ("ln_bwd_groups", 233.0, 260.0),
        ("column_sum_kernel", 250.0, 262.5),  # overlaps its predecessor (programmatic dependent launch)
        ("at::cuda::spin_kernel(long)", 270.0, 370.0),
        ("at::cuda::spin_kernel(long)", 371.0, 380.0),  # a call with no device work: skipped
        ("Memcpy DtoD", 381.0, 384.0),
    ]
    assert harness.call_spans(us) == [10.0, 29.5, 3.0]


@pytest.mark.cuda
@pytest.mark.usefixtures("fused_kernels")
def test_bench_ops_kernel_spans_on_cuda(tmp_path):
    report = tiny_report(tmp_path, "cuda", reps=5)
    for r in report["rows"]:
        # The profiler's span excludes the launch latency that the event pair includes.
        assert 0 < r["kernel_ms"] <= r["median_ms"] * 1.05
        assert r["kernel_pct_of_copy_bw"] == pytest.approx(
            100 * r["min_bytes"] / (r["kernel_ms"] * 1e-3) / 1e9 / report["device"]["copy_gbps"], rel=1e-2, abs=0.1)


def test_measure_interleaved_alternates_functions_in_rotated_rounds():
    calls: list[tuple[str, int]] = []
    fns = {name: (lambda x, name=name: calls.append((name, x))) for name in ("a", "b", "c")}
    timings = harness.measure_interleaved(fns, [(0,), (1,)], rounds=4, reps=3, warmup=2)
    assert {name: t.runs for name, t in timings.items()} == {"a": 12, "b": 12, "c": 12}
    timed = calls[3 * 2:]  # after each function's warm-up calls
    blocks = [timed[i][0] for i in range(0, len(timed), 3)]
    assert blocks == list("abc" "bca" "cab" "abc")  # each round starts one function later
    assert all(len({name for name, _ in timed[i:i + 3]}) == 1 for i in range(0, len(timed), 3))
    assert [x for _, x in timed[:3]] == [0, 1, 0]  # the input sets rotate within a block


def test_git_commit_marks_changes_only_under_the_paths_asked(tmp_path, monkeypatch):
    """A benchmark that writes its results into the tree asks about its code's paths only: a change
    elsewhere leaves its commit clean, one under those paths marks it '+dirty'."""
    import subprocess

    monkeypatch.delenv("BERTCTL_COMMIT", raising=False)
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "code").mkdir()
    (tmp_path / "results").mkdir()
    for name in ("code/a.py", "results/r.json"):
        (tmp_path / name).write_text("0\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "start")
    head = git("rev-parse", "HEAD").stdout.strip()
    (tmp_path / "results" / "r.json").write_text("1\n")
    assert harness.git_commit(tmp_path) == head + "+dirty"
    assert harness.git_commit(tmp_path, paths=("code",)) == head
    (tmp_path / "code" / "a.py").write_text("1\n")
    assert harness.git_commit(tmp_path, paths=("code",)) == head + "+dirty"
    monkeypatch.setenv("BERTCTL_COMMIT", "abc1234")
    assert harness.git_commit(tmp_path) == "abc1234"


def test_environment_names_the_device_versions_and_commit(monkeypatch):
    """The row a process-level benchmark records: device_block's fields without the copy bandwidth, and
    the versions of the packages asked for (None for one not installed)."""
    import importlib.metadata
    import platform

    import torch

    monkeypatch.setenv("BERTCTL_COMMIT", "abc1234")
    row = harness.environment("cpu", packages=("torch", "no-such-package-bertctl"))
    assert row["type"] == "cpu" and row["threads"] == torch.get_num_threads()
    assert row["torch"] == torch.__version__ and row["python"] == platform.python_version()
    assert row["commit"] == "abc1234"
    assert row["versions"] == {"torch": importlib.metadata.version("torch"), "no-such-package-bertctl": None}
    block = harness.device_block("cpu", copy_gbps=12.5)
    assert block["copy_gbps"] == 12.5 and {k: v for k, v in block.items() if k not in ("copy_gbps", "date")} == \
        {k: v for k, v in row.items() if k not in ("versions", "date")}
