"""benchmarks/results/INDEX.md lists every result file (by name, or under a listed folder) and only files
that exist, each once: a figure's evidence can always be found from the index."""
from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# A list item whose first backticked word is a result file or folder (other backticked words are code).
ENTRY = re.compile(r"^\s*- `([^`]+(?:\.json|\.png|\.md|\.diff|/))`", re.M)


def listed() -> list[str]:
    return ENTRY.findall((RESULTS / "INDEX.md").read_text(encoding="utf-8"))


def test_every_listed_entry_exists_and_is_listed_once():
    names = listed()
    assert len(names) > 100  # the parser found the entries
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    assert [n for n in names if not (RESULTS / n).exists()] == []
    assert [n for n in names if n.endswith("/") != (RESULTS / n).is_dir()] == []


def test_every_result_file_is_listed():
    names = set(listed())
    folders = tuple(n for n in names if n.endswith("/"))
    files = [p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file()]
    unlisted = [f for f in files if f != "INDEX.md" and f not in names and not f.startswith(folders)]
    assert unlisted == []


def test_the_parser_reads_entries_and_skips_code(tmp_path):
    """The entry pattern takes a list item's leading file or folder name, not a command in backticks."""
    text = "- `a.json`: x\n  - `b-c.png`: y\n- `dir/`: z\n- `bertctl bench ops` made `d.json`\n- The `e.json`\n"
    assert ENTRY.findall(text) == ["a.json", "b-c.png", "dir/"]
