"""Which backend ``embed --backend auto`` runs: the one with the least predicted time for the job.

A job's cost on a backend is modelled as

    seconds = start + per_batch * batches + per_text * inputs + per_dense * dense + per_attention * attention

with ``dense`` the projections' and feed-forward's work (24 L H^2 FLOP a token, in TFLOP) and
``attention`` the scores' and the weighted sum's (4 L H FLOP a token per token it attends to, in
TFLOP), counted over the tokens each backend computes: the padded (B, S) batches for torch and ONNX
Runtime, the real tokens for the native encoder, which packs them. ``start`` holds what a run pays
once (imports, the device, the weights), ``per_batch`` a forward pass's launches and host work,
``per_text`` the tokenising, pooling and writing a text costs on any backend.

The coefficients are fitted by ``benchmarks/embed/fit_costs.py`` to the whole-command measurements
its docstring lists, and written to ``bertctl/inference/cost_table.py`` with the workloads they were
fitted on (a test checks that they rank the backends as those runs did). They were measured in one
precision a device (fp16 on a GPU, fp32 on the CPU) and serve every precision: the choice compares
backends at the same precision, where their ratio is what matters.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bertctl.data.batching import length_batches

#: Backends that run padded (B, S) batches; the native encoder runs packed tokens.
PADDED = ("torch", "onnxruntime")
TERMS = ("start", "per_batch", "per_text", "per_dense", "per_attention")


@dataclass(frozen=True)
class Workload:
    """What a job asks of a backend: model inputs (texts, or windows of long texts), forward passes,
    and the dense and attention work, in TFLOP, over the real tokens and over the padded batches."""

    inputs: int
    batches: int
    tokens: int
    padded_tokens: int
    dense: float
    attention: float
    padded_dense: float
    padded_attention: float

    @classmethod
    def of(cls, lengths: np.ndarray, layers: int, hidden: int, batch_tokens: int,
           batch_size: int | None = None) -> "Workload":
        """The work of inputs of ``lengths`` tokens cut into embed's batches (``length_batches``) on a
        model of ``layers`` layers ``hidden`` wide."""
        lengths = np.asarray(lengths, dtype=np.int64)
        batches = length_batches(lengths, batch_size, batch_tokens) if len(lengths) else []
        widest = np.array([lengths[b[0]] for b in batches], dtype=np.float64)  # each batch's first is its longest
        rows = np.array([len(b) for b in batches], dtype=np.float64)
        real = lengths.astype(np.float64)
        dense, attention = 24.0 * layers * hidden ** 2 / 1e12, 4.0 * layers * hidden / 1e12
        return cls(inputs=len(lengths), batches=len(batches), tokens=int(real.sum()),
                   padded_tokens=int((rows * widest).sum()), dense=dense * real.sum(),
                   attention=attention * (real ** 2).sum(), padded_dense=dense * (rows * widest).sum(),
                   padded_attention=attention * (rows * widest ** 2).sum())

    def terms(self, backend: str) -> dict[str, float]:
        """The quantities ``backend``'s coefficients multiply."""
        padded = backend in PADDED
        return {"start": 1.0, "per_batch": float(self.batches), "per_text": float(self.inputs),
                "per_dense": self.padded_dense if padded else self.dense,
                "per_attention": self.padded_attention if padded else self.attention}


def predict(backend: str, work: Workload, device: str, table: dict | None = None) -> float:
    """Predicted seconds of the whole command for ``work`` on ``backend`` on a ``device`` type ("cpu", "cuda")."""
    coefficients = (table or _table())[device][backend]
    return sum(coefficients[name] * value for name, value in work.terms(backend).items())


def choose(available: list[str], work: Workload, device: str, table: dict | None = None) -> tuple[str, str]:
    """The backend of ``available`` with the least predicted time, and the reason, in words."""
    table = table or _table()
    known = [b for b in available if b in table.get(device, {})]
    if not known:  # no measurement of this device: the first available (the caller's order)
        return available[0], f"no measured costs for {device}; {available[0]} is the first available"
    times = {b: predict(b, work, device, table) for b in known}
    best = min(known, key=times.get)
    others = ", ".join(f"{b} {times[b]:.2f} s" for b in known if b != best)
    return best, (f"predicted {times[best]:.2f} s for {work.inputs:,} inputs of {work.tokens:,} tokens"
                  + (f", against {others}" if others else ", the only backend available"))


def _table() -> dict:
    from bertctl.inference.cost_table import COEFFICIENTS

    return COEFFICIENTS
