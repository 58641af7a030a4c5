"""``bertctl embed``: sentence features from any checkpoint directory."""
from __future__ import annotations

from pathlib import Path

import typer

from bertctl.cli import options as opt
from bertctl.workers import usable_cpus
from bertctl.inference.backends import BACKEND_CHOICES
from bertctl.inference.embed import OUTPUT_SUFFIXES
from bertctl.inference.pooling import LAYER_CHOICES, POOLING_CHOICES


def register(app: typer.Typer) -> None:
    @app.command("embed")
    def embed(
        inputs: list[Path] = typer.Argument(..., help="Text files (one text per line) or JSONL files."),
        model: Path = typer.Option(..., "--model", help="Checkpoint directory (bertctl's or Hugging Face's)."),
        output: Path = typer.Option(..., "--output", "-o", help=f"Output file: {', '.join(OUTPUT_SUFFIXES)}."),
        pooling: str = typer.Option(None, show_default="the checkpoint's sentence-transformers pooling, else mean",
                                    help=f"Token pooling: {', '.join(POOLING_CHOICES)}, or several joined by ',' "
                                         "(their vectors concatenated)."),
        layers: str = typer.Option(None, show_default="last",
                                   help=f"Hidden states to use: {', '.join(LAYER_CHOICES)}. --pooling or --layers "
                                        "skips a sentence-transformers checkpoint's Dense modules."),
        normalize: bool = typer.Option(None, "--normalize/--no-normalize",
                                       show_default="as the checkpoint's sentence-transformers modules, else no",
                                       help="L2-normalise each embedding."),
        prompt: str = typer.Option(None, "--prompt",
                                   show_default="a sentence-transformers checkpoint's default prompt, else none",
                                   help="Text put before every input (e.g. 'query: '), as encode(prompt=...)."),
        prompt_name: str = typer.Option(None, "--prompt-name", show_default=False,
                                        help="One of a sentence-transformers checkpoint's named prompts "
                                             "(config_sentence_transformers.json), as encode(prompt_name=...)."),
        field: str = typer.Option(None, "--field", help="JSONL field holding the text (default 'text')."),
        batch_size: int = typer.Option(None, "--batch-size", show_default="no limit: --batch-tokens decides",
                                       help="Texts per forward pass, at most."),
        batch_tokens: int = typer.Option(None, "--batch-tokens", show_default="1024 on the CPU, 65536 on a GPU",
                                         help="Padded tokens (texts x longest) per forward pass, at most; texts are "
                                              "sorted by length first, so short ones go many to a batch."),
        max_seq_length: int = typer.Option(None, "--max-seq-length",
                                           show_default="a sentence-transformers checkpoint's max_seq_length, else "
                                                        "the model's max_position_embeddings (the upper bound)",
                                           help="Truncate longer texts to N tokens, [CLS]/[SEP] included; at least 2."),
        precision: str = typer.Option("fp32", "--precision", help="fp32, bf16 or fp16 (the weights cast once; fp16 "
                                      "on a GPU only), or auto (bf16 on a GPU, fp32 on the CPU). fp32 gives the "
                                      "checkpoint's vectors; against them fp16 kept cosine >= 0.99999 and bf16 0.9998 "
                                      "(MiniLM, SST-2, H100)."),
        device: str = typer.Option("auto", help="cpu, cuda, cuda:N or auto."),
        backend: str = typer.Option("auto", "--backend",
                                    help=f"{', '.join(BACKEND_CHOICES)}: auto runs native on a GPU (bertctl's "
                                         "own CUDA encoder, built with the CUDA kernels: packed tokens, no torch "
                                         "loaded) where it runs the model, onnxruntime on the CPU in fp32 when "
                                         "installed (faster there), torch otherwise. The ONNX export of the "
                                         "encoder (and a copy with fused attention and GELU) is cached on first "
                                         "use."),
        onnx: Path = typer.Option(None, "--onnx", show_default=False,
                                  help="An exported encoder (.onnx) to run under onnxruntime instead of the cache."),
        workers: int = opt.WORKERS,
        no_progress: bool = opt.NO_PROGRESS,
    ) -> None:
        """Embed texts (the paper's feature-based approach); one float32 row per input line, in input order.

        A sentence-transformers checkpoint (modules.json) embeds as its encode() does unless flags say otherwise."""
        import numpy as np

        from bertctl.checkpoints.hf import load_config
        from bertctl.inference.backends import open_encoder
        from bertctl.inference.embed import (Tokenizing, checkpoint_config, embed_texts, prepare_texts, read_texts,
                                             token_limit, write_embeddings)
        from bertctl.errors import BertctlError
        from bertctl.io import check_writable
        from bertctl.progress import stderr
        from bertctl.text import load_tokenizer

        config, encoder_dir, st = checkpoint_config(
            model, pooling=pooling, layers=layers, normalize=normalize, prompt=prompt, prompt_name=prompt_name,
            max_length=max_seq_length, batch_size=batch_size,
            batch_tokens=batch_tokens, precision=precision, device=device, backend=backend,
            workers=workers or usable_cpus())
        if output.suffix not in OUTPUT_SUFFIXES:
            raise BertctlError(f"--output {output}: suffix must be one of {', '.join(OUTPUT_SUFFIXES)}")
        check_writable(output)  # before the model runs, not after
        texts = [t for path in inputs for t in read_texts(path, field)]
        tokenizer = load_tokenizer(encoder_dir)
        if st is not None:
            skipped = (" (its Dense modules skipped: --pooling or --layers given)"
                       if st.dense and not config.dense else "")
            stderr.print(f"{model}: a sentence-transformers checkpoint: {st.describe()}{skipped}; flags override")
        # Tokenising starts before CUDA or torch loads (its workers fork from a small process) and runs
        # while the device and the model load. Starting the native encoder's CUDA context before the fork
        # made the whole run slower (benchmarks/results/embed-vs-st-h200-fp16-40c77c7.json).
        limit = token_limit(config, load_config(encoder_dir).max_position_embeddings)
        with Tokenizing(tokenizer, prepare_texts(texts, config), limit, config.workers) as tokenizing:
            encoder = open_encoder(encoder_dir, config, onnx, lengths=lambda: tokenizing.result()[1])
            array = embed_texts(encoder, tokenizer, texts, config, progress=not no_progress, summary=True,
                                tokenizing=tokenizing)
        write_embeddings(array.astype(np.float32, copy=False), output)
        typer.echo(str(output))
