#!/usr/bin/env bash
# Builds, with nvcc and no GPU, the FlashInfer modules tests/gpu needs (check_steps.py modules) for Hopper (sm_90a) in
# one ninja, and packs their libraries into bench/gpu/prebuilt/flashinfer-<version>-sm90a.tar.xz, which check.sh
# unpacks into FlashInfer's AOT folder on the GPU machine. Run it again when the FlashInfer pin or a kernel's
# variants change; it says whether wheels + archive + the tracked tree fit the 64 MiB a GPU run may carry.
#
#   PYTHON=.venv-image-torch/bin/python MAX_JOBS=2 bench/gpu/make_prebuilt.sh    (about an hour on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE=${PREBUILT_WORKSPACE:-/tmp/fi-prebuilt}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
NVCC=$(readlink -f "$(command -v nvcc)")
if [ -z "${CUDA_HOME:-}" ]; then  # nvcc may be a wrapper script: take the toolkit it runs
    real=$(grep -Io '/[^ ]*/bin/nvcc' "$NVCC" 2>/dev/null | head -1 || true)
    CUDA_HOME=$(dirname "$(dirname "${real:-$NVCC}")")
fi
export CUDA_HOME
SCRATCH=$FLASHINFER_WORKSPACE_BASE/toolchain
mkdir -p "$SCRATCH"
# FlashInfer links with -lcuda: without a driver or CUDA's stubs, an empty stand-in with the driver's soname.
if ! ls "$CUDA_HOME"/lib64/libcuda.so "$CUDA_HOME"/lib64/stubs/libcuda.so >/dev/null 2>&1; then
    cc -shared -Wl,-soname,libcuda.so.1 -o "$SCRATCH/libcuda.so" -x c /dev/null
    export FLASHINFER_EXTRA_LDFLAGS="-L$SCRATCH"
fi
# Its norm module includes cublasLt.h: a toolkit without cuBLAS's headers takes torch's CUDA wheels' ones.
if [ ! -f "$CUDA_HOME/include/cublasLt.h" ]; then
    headers=$($PY -c "import nvidia, pathlib; print(next(p.parent for r in nvidia.__path__ for p in
        pathlib.Path(r).glob('*/include/cublasLt.h')))")
    export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $headers"
fi
version=$($PY -c "import flashinfer; print(flashinfer.__version__)")
start=$(date +%s)
$PY bench/gpu/check_steps.py build
echo "built in $(($(date +%s) - start)) s with MAX_JOBS=$MAX_JOBS"
rm -f bench/gpu/prebuilt/*.tar.xz
$PY bench/gpu/check_steps.py pack "bench/gpu/prebuilt/flashinfer-$version-sm90a.tar.xz"
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$(du -cb bench/gpu/wheels/*.whl bench/gpu/prebuilt/*.tar.xz 2>/dev/null | tail -1 | cut -f1)
echo "carried: $(((tree + carried) / 1024 / 1024)) MiB of 64 (tracked tree $((tree / 1024)) KiB)"
[ $((tree + carried)) -le $((64 * 1024 * 1024)) ] || { echo "over the 64 MiB a GPU run may carry" >&2; exit 1; }
