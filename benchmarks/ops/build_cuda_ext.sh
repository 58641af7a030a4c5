#!/usr/bin/env bash
# Builds the CUDA extension on a machine without a GPU, for a GPU machine whose Python and torch are known, so
# that the GPU machine's time goes to tests and timings instead of nvcc. Needs nvcc (CUDA 13 here) and network
# access to PyPI. Run from the repo root:
#   benchmarks/ops/build_cuda_ext.sh [OUT.tar.xz]      (default .device/so.tar.xz, what finetune/vs_hf.sh loads)
# PYTHON (default python3.12) and TORCH (default torch==2.11.0, whose PyPI wheel is the +cu130 build) must match
# the GPU machine's; the venv (4.7 GB, torch's CUDA libraries included) is kept in BUILD_ENV
# (default ~/.cache/bertctl-cuda-build) for the next build. The CPU kernels' instruction set is this machine's
# (BERTCTL_CPU_ISA, see setup.py): set it to the GPU machine's where they differ (the H200 hosts seen: avx512). The tree is built from a copy in $BUILD_ENV/tree, so
# the checkout's own CPU build stays as it is. On a 2-core machine a build takes minutes (the .cu files compile
# two at a time).
set -euo pipefail
out=${1:-.device/so.tar.xz}
env_dir=${BUILD_ENV:-$HOME/.cache/bertctl-cuda-build}
py=${PYTHON:-python3.12}
torch_req=${TORCH:-torch==2.11.0}
mkdir -p "$env_dir"
if [ ! -x "$env_dir/venv/bin/python" ]; then
  "$py" -m venv "$env_dir/venv"
  "$env_dir/venv/bin/pip" install -q --upgrade pip
  "$env_dir/venv/bin/pip" install -q "$torch_req" ninja pybind11 setuptools wheel numpy
fi
. "$env_dir/venv/bin/activate"
python -c "import torch; assert torch.version.cuda, 'not a CUDA build of torch: ' + torch.__version__"
# torch's CUDA headers and libcudart come with its pip packages (nvidia/cu13); a bare toolkit may lack them.
nv=$(python -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13'))")
mkdir -p "$env_dir/lib" && ln -sfn "$nv/lib/libcudart.so.13" "$env_dir/lib/libcudart.so"
mkdir -p "$env_dir/tree"
git ls-files -z bertctl csrc setup.py pyproject.toml README.md | xargs -0 cp -p --parents -t "$env_dir/tree"
cd "$env_dir/tree"
CPATH="$nv/include" NVCC_APPEND_FLAGS="-I$nv/include" LIBRARY_PATH="$env_dir/lib" BERTCTL_CUDA=1 \
  MAX_JOBS=${MAX_JOBS:-$(nproc)} python setup.py build_ext --inplace > build.log 2>&1 \
  || { grep -E "error|Error" build.log | head -20; exit 1; }
so=$(ls bertctl/_C.cpython-*-x86_64-linux-gnu.so)
python -c "import torch, bertctl.ops as o; assert o.fused_available()"
cd - > /dev/null
mkdir -p "$(dirname "$out")"
tar cJf "$out" -C "$env_dir/tree" "$so"
echo "built $so from $(git rev-parse --short HEAD)$( [ -n "$(git status --porcelain -- csrc setup.py)" ] && echo -dirty ) into $out ($(du -h "$out" | cut -f1))"
