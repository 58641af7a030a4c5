"""``bertctl embed``: sentence features from any checkpoint directory."""
from __future__ import annotations

from pathlib import Path

import typer

from bertctl.cli import options as opt
from bertctl.workers import usable_cpus
from bertctl.inference.backends import BACKEND_CHOICES
from bertctl.inference.embed import LONG_CHOICES, OUTPUT_SUFFIXES
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
                                           help="Model inputs of at most N tokens, [CLS]/[SEP] included; at "
                                                "least 2. Longer texts follow --long."),
        long: str = typer.Option("truncate", "--long",
                                 help=f"A text longer than the limit: {' or '.join(LONG_CHOICES)}. truncate keeps "
                                      "its first tokens (as sentence-transformers' encode() does) and says how many "
                                      "texts were cut; chunk embeds it whole: overlapping windows of the limit, "
                                      "each its own [CLS] ... [SEP] input, their vectors averaged (weighted by "
                                      "their tokens) into one."),
        stride: int = typer.Option(None, "--stride", show_default="a quarter of the window, rounded down",
                                   help="With --long chunk: tokens consecutive windows share (0 or more, less than "
                                        "the window: the limit less [CLS] and [SEP])."),
        precision: str = typer.Option("fp32", "--precision", help="fp32, bf16 or fp16 (the weights cast once; fp16 "
                                      "on a GPU only), or auto (bf16 on a GPU, fp32 on the CPU). fp32 gives the "
                                      "checkpoint's own vectors; the half precisions trade a little of their "
                                      "accuracy for speed."),
        device: str = typer.Option("auto", help="cpu, cuda, cuda:N or auto."),
        backend: str = typer.Option("auto", "--backend",
                                    help=f"{', '.join(BACKEND_CHOICES)}: auto takes, of the backends that can run "
                                         "here, the one with the least predicted time for these texts (a cost "
                                         "model fitted to measured runs: start-up, batches, tokens and attention), "
                                         "and says which and why. native is bertctl's own CUDA encoder (built "
                                         "with the CUDA kernels; packed tokens, no torch loaded), onnxruntime "
                                         "runs on the CPU in fp32 when installed, torch anywhere. The ONNX export "
                                         "of the encoder (and a copy with fused attention and GELU) is cached on "
                                         "first use."),
        onnx: Path = typer.Option(None, "--onnx", show_default=False,
                                  help="An exported encoder (.onnx) to run under onnxruntime instead of the cache."),
        workers: int = opt.WORKERS,
        overwrite: bool = opt.OVERWRITE,
        no_progress: bool = opt.NO_PROGRESS,
    ) -> None:
        """Embed texts (the paper's feature-based approach); one float32 row per input line, in input order.

        A sentence-transformers checkpoint (modules.json) embeds as its encode() does unless flags say otherwise."""
        from bertctl.inference.embed import run_embed

        run_embed(inputs, model, output, field=field, onnx=onnx, overwrite=overwrite, progress=not no_progress,
                  pooling=pooling, layers=layers, normalize=normalize, prompt=prompt, prompt_name=prompt_name,
                  max_length=max_seq_length, batch_size=batch_size, batch_tokens=batch_tokens, precision=precision,
                  device=device, backend=backend, workers=workers or usable_cpus(), long=long, stride=stride)
