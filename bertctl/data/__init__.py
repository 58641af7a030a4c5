"""Pretraining data: raw text -> sentences -> instances -> shards (``build_data``) -> batches (``PretrainingData``).

``from bertctl.data import build_data, DataConfig, PretrainingData``.
"""
from .build import build_data
from .config import DataConfig
from .loader import PretrainingData

__all__ = ["build_data", "DataConfig", "PretrainingData"]
