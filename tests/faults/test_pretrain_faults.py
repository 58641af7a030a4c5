"""Faults at every phase of pretraining: each run resumes to the uninterrupted run's results."""
from __future__ import annotations

import pytest

from matrix import FAULTS, PHASES, check, check_file_size_limit


@pytest.mark.parametrize("kind", FAULTS)
@pytest.mark.parametrize("phase", PHASES)
def test_a_fault_loses_no_pretraining_run(reference, phase, kind, tmp_path):
    check(reference("pretrain"), phase, kind, tmp_path / "out")


def test_a_real_file_size_limit_loses_no_pretraining_run(reference, tmp_path):
    check_file_size_limit(reference("pretrain"), tmp_path / "out")
