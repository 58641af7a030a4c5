"""Pretraining data: raw text -> sentences -> instances -> shards (``build_data``) -> batches (``PretrainingData``).

``from bertctl.data import build_data, DataConfig, PretrainingData``.  The dataset
(which needs torch) is imported on first use, so building data does not load torch.
"""
from .build import build_data
from .config import DataConfig

__all__ = ["build_data", "DataConfig", "PretrainingData"]


def __getattr__(name: str):
    if name == "PretrainingData":
        from .dataset import PretrainingData

        return PretrainingData
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
