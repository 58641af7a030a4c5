"""Pretraining data: raw text -> sentences -> instances -> shards (``build_data``) -> batches (``PretrainingData``).

``from bertctl.data import build_data, DataConfig, PretrainingData``.  Each is imported on first use:
building data does not load torch (the dataset needs it), and ``bertctl.data.batching``, which
``embed`` imports, loads neither the builder nor the dataset.
"""
__all__ = ["build_data", "DataConfig", "PretrainingData"]


def __getattr__(name: str):
    if name == "build_data":
        from .build import build_data

        return build_data
    if name == "DataConfig":
        from .config import DataConfig

        return DataConfig
    if name == "PretrainingData":
        from .dataset import PretrainingData

        return PretrainingData
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
