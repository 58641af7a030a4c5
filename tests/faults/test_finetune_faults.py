"""Faults at every phase of fine-tuning, every task: each run resumes to the uninterrupted run's results."""
from __future__ import annotations

import pytest

from matrix import FAULTS, PHASES, check, check_file_size_limit

TASKS = ("finetune-glue", "finetune-squad", "finetune-ner", "finetune-swag")


@pytest.mark.parametrize("kind", FAULTS)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("name", TASKS)
def test_a_fault_loses_no_fine_tuning_run(reference, name, phase, kind, tmp_path):
    check(reference(name), phase, kind, tmp_path / "out")


def test_a_real_file_size_limit_loses_no_fine_tuning_run(reference, tmp_path):
    check_file_size_limit(reference("finetune-glue"), tmp_path / "out")
