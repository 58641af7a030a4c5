"""benchmarks/finetune/vs_hf.py's check that both sides fine-tuned one checkpoint: the weights' digest each run
records, and the summaries' warning when runs disagree or predate it."""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("finetune_vs_hf", ROOT / "benchmarks" / "finetune" / "vs_hf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _save(folder: Path, state: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_the_digest_is_the_weights_not_the_file(minilm_dir, tmp_path):
    """MiniLM saved again with its tensors in reverse order has the same digest, equal to sha256 over name, dtype,
    shape and bytes in name order computed here with numpy; widened back from fp16 it has another."""
    fvh = _module()
    state = load_file(str(minilm_dir / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    expected = h.hexdigest()[:16]
    assert fvh.model_digest(minilm_dir) == expected
    reordered = _save(tmp_path / "reordered", {k: state[k] for k in sorted(state, reverse=True)})
    assert fvh.model_digest(reordered) == expected
    widened = _save(tmp_path / "widened", {k: v.half().float() if v.is_floating_point() else v
                                           for k, v in state.items()})
    assert fvh.model_digest(widened) != expected


def _run(side: str, seed: int, digest: str | None, mcc: float) -> dict:
    r = {"task": "acceptability", "mode": "quality", "side": side, "seed": seed, "rc": 0, "concurrent_runs": 8,
         "environment": {"device": "cpu", "commit": "x"}, "seconds_to_metrics": 1.0,
         "settings": {"recipe": {}, "side": {}}, "metrics": {"matthews_corrcoef": mcc, "accuracy": 70.0}}
    if digest is not None:
        r["model_sha256"] = digest
    return r


def test_summaries_warn_when_the_sides_weights_differ_or_are_unrecorded():
    fvh = _module()
    same = [_run(side, seed, "a" * 16, 40.0 + seed) for side in ("bertctl", "hf") for seed in range(5)]
    assert "weights_warning" not in fvh.summarise_quality("acceptability", same)
    mixed = [_run("bertctl", s, "a" * 16, 40.0) for s in range(5)] + [_run("hf", s, "b" * 16, 40.0) for s in range(5)]
    assert "different weights" in fvh.summarise_quality("acceptability", mixed)["weights_warning"]
    old = [_run("bertctl", s, "a" * 16, 40.0) for s in range(5)] + [_run("hf", s, None, 40.0) for s in range(5)]
    assert fvh.summarise_quality("acceptability", old)["weights_warning"].startswith("5 of 10 runs predate")
    speed = [dict(r, mode="speed", concurrent_runs=1, seconds_to_exit=1.5, metrics={"matthews_corrcoef": 40.0})
             for r in mixed]
    assert "different weights" in fvh.summarise_speed("acceptability", speed)["weights_warning"]
