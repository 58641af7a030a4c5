"""``bertctl env``: versions, devices, which compiled kernels loaded where, and embed's native encoder."""
from __future__ import annotations

import json
import platform

import typer


def environment() -> dict:
    import torch

    import bertctl
    from bertctl import allocator
    from bertctl._ext import compiled, kernels_loaded

    info = {
        "bertctl": bertctl.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_allocator": allocator.status(),
        "devices": ["cpu"] + [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "compiled_module": getattr(compiled(), "__file__", None),
        "kernels": kernels_loaded(),
    }
    if compiled() is not None and hasattr(compiled(), "build_info"):
        info["build"] = compiled().build_info()
    from bertctl.inference.backends.native import _load

    encoder, why = _load()  # embed's own CUDA encoder (bertctl.inference.backends.native), built with the CUDA kernels
    info["native_encoder"] = encoder.__file__ if encoder is not None else f"unavailable: {why}"
    return info


def register(app: typer.Typer) -> None:
    @app.command("env")
    def env(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
        """Print versions, devices, and which compiled kernels loaded for which device."""
        info = environment()
        if as_json:
            typer.echo(json.dumps(info, indent=2))
            return
        width = max(map(len, info))
        for key, value in info.items():
            if key == "kernels":
                value = ", ".join(f"{op}[{'/'.join(keys) or '-'}]" for op, keys in value.items()) or "none (plain PyTorch)"
            elif key == "cpu_allocator":
                value = (f"{'tuned by bertctl' if value['bertctl_tuned'] else 'as found'}; THP_MEM_ALLOC_ENABLE="
                         f"{value['thp_mem_alloc_enable']}, kernel THP mode {value['kernel_thp']}")
            typer.echo(f"{key:<{width}}  {value}")
