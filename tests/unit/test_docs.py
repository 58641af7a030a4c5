"""The documentation stays true to its sources: docs/measured.md is what docs/generate.py makes of
benchmarks/results/ (so a new or changed result file must regenerate it), the README stays short,
and every relative link in the README and docs/ points at a file or heading that exists."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def generator():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measured_is_the_generators_output():
    expected = generator().render()
    actual = (DOCS / "measured.md").read_text(encoding="utf-8")
    assert actual == expected, "docs/measured.md is out of date: run python docs/generate.py"


def test_the_generator_reads_the_result_files(tmp_path, monkeypatch):
    """A figure in a result file reaches the page: change one and the table changes with it."""
    gen = generator()
    results = tmp_path / "results"
    results.mkdir()
    for f in (ROOT / "benchmarks" / "results").glob("*.json"):
        (results / f.name).write_bytes(f.read_bytes())
    d = json.loads((results / "finetune-sst2.json").read_text())
    d["bertctl"]["accuracy"]["mean"] = 12.3456
    (results / "finetune-sst2.json").write_text(json.dumps(d))
    monkeypatch.setattr(gen, "RESULTS", str(results))
    page = gen.render()
    row = next(line for line in page.splitlines() if line.startswith("| SST-2 (MiniLM) |"))
    assert "| 12.35 ± 0.56 |" in row
    assert page != (DOCS / "measured.md").read_text(encoding="utf-8")


def test_readme_summary_is_the_generators_output():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert generator().readme_with_summary(readme) == readme, \
        "the README's summary table is out of date: run python docs/generate.py"


def test_check_flag_fails_on_a_stale_page(tmp_path, monkeypatch):
    gen = generator()
    stale, readme = tmp_path / "measured.md", tmp_path / "README.md"
    stale.write_text("# Measured\n")
    readme.write_text((ROOT / "README.md").read_text(encoding="utf-8"))
    monkeypatch.setattr(gen, "OUTPUT", str(stale))
    monkeypatch.setattr(gen, "README", str(readme))
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    assert stale.read_text(encoding="utf-8") == (DOCS / "measured.md").read_text(encoding="utf-8")
    # A stale summary table fails the check too.
    readme.write_text(readme.read_text(encoding="utf-8").replace("times shorter", "times longer"))
    assert gen.main(["--check"]) == 1


# A commit hash standing alone: not part of a result file's name (`model-h200-d2af69e.json`).
BARE_COMMIT = re.compile(r"(?<![0-9a-zA-Z_./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9a-zA-Z_-])")


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_commits_appear_only_in_generated_tables():
    """Figures and the commits they were measured at live in docs/measured.md, generated."""
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        if page.name == "measured.md":
            continue
        found = BARE_COMMIT.findall(page.read_text(encoding="utf-8"))
        assert not found, f"{page.relative_to(ROOT)} names commits: {found[:5]}"


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_named_repository_paths_exist():
    """A path the docs name in backticks (`benchmarks/convergence/run.py`) is a file or folder of the tree."""
    missing = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for path in re.findall(r"`((?:bertctl|benchmarks|tests|csrc|docs)/[^`\s]*)`", text):
            path = path.split("::")[0]
            if any(c in path for c in "*{}"):
                continue  # a pattern (`finetune-ddp-*.json`), not one path
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


# Flags of other programs the docs show beside bertctl's.
OTHER_PROGRAMS_FLAGS = {"--no-build-isolation": "pip", "--nproc-per-node": "torchrun", "--nnodes": "torchrun",
                        "--rdzv-backend": "torchrun", "--rdzv-endpoint": "torchrun", "--logdir": "tensorboard"}


def cli_flags() -> set[str]:
    """Every long option of every bertctl command, read from the application itself."""
    import typer

    from bertctl.cli.app import build_app

    flags: set[str] = set()

    def walk(command):
        for param in command.params:
            flags.update(o for o in [*param.opts, *getattr(param, "secondary_opts", [])] if o.startswith("--"))
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(build_app()))
    return flags


def test_documented_flags_exist():
    """A flag the README or docs name is one bertctl (or the benchmark script, or the program) has."""
    known = cli_flags() | set(OTHER_PROGRAMS_FLAGS)
    assert "--train-articles" in known and "--minutes" in known  # the walk reached the subcommands
    for script in (ROOT / "benchmarks").rglob("*.py"):
        known |= set(re.findall(r"--[a-z][a-z0-9-]*", script.read_text(encoding="utf-8")))
    unknown = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        if page.name == "measured.md":
            continue
        for flag in sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", page.read_text(encoding="utf-8")))):
            if flag not in known:
                unknown.append(f"{page.relative_to(ROOT)}: {flag}")
    assert not unknown, "\n".join(unknown)
