"""``bertctl export onnx``: a checkpoint directory to one ONNX file, checked under ONNX Runtime."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from bertctl.runtime import EXPORTABLE_ATTENTION

export_app = typer.Typer(name="export", help="Export a model for serving (ONNX).", no_args_is_help=True)


@export_app.command("onnx")
def onnx(
    model: Path = typer.Option(..., "--model", help="Checkpoint directory (bertctl's or Hugging Face's).",
                               show_default=False),
    output: Path = typer.Option(..., "--output", "-o", help="The .onnx file to write.", show_default=False),
    architecture: str = typer.Option(None, "--architecture", show_default="config.json's architectures",
                                     help="BertModel (the encoder) or the task head to export."),
    hidden_states: bool = typer.Option(False, "--hidden-states",
                                       help="Encoder only: also output every layer as hidden_states (L+1, B, S, H)."),
    attn: str = typer.Option("sdpa", "--attn", help=f"Attention graph: {' or '.join(EXPORTABLE_ATTENTION)}."),
    opset: int = typer.Option(18, "--opset", help="ONNX opset (17 or later)."),
) -> None:
    """Export the encoder or a task head with dynamic batch and sequence axes; the file is written only
    after ONNX Runtime reproduces PyTorch within 1e-4.  The report (outputs, max abs diff) goes to stdout."""
    from bertctl.inference.onnx_export import export_onnx
    from bertctl.inference.sentence_transformers import encoder_dir

    # A sentence-transformers checkpoint's encoder: the directory itself, or its 0_Transformer/.
    report = export_onnx(encoder_dir(model) or model, output, architecture=architecture, hidden_states=hidden_states,
                         attn_implementation=attn, opset=opset)
    typer.echo(json.dumps(report, indent=2))


def register(app: typer.Typer) -> None:
    app.add_typer(export_app, name="export")
