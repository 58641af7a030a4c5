"""The sweeps reuse the parity tests' comparisons (tests/parity/test_tokenizer.py, test_sentencepiece.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
