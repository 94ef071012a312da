#!/usr/bin/env bash
# Downloads into bench/gpu/wheels/ the wheels that bench/gpu/check.sh installs on an offline GPU machine:
# the flashinfer-python, apache-tvm-ffi and fla-core pins of requirements-cuda.txt, for CPython 3.12 on x86-64 Linux
# (about 10 MiB). Everything else FlashInfer needs at run time (torch, nvcc, ninja, numpy, einops,
# nvidia-ml-py, ...) is expected on a CUDA PyTorch machine; its big optional deps (cudnn-frontend,
# cutlass-dsl) are not needed by the kernels this engine calls.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
PYVER=${WHEEL_PYTHON_VERSION:-3.12}
REQ=../../requirements-cuda.txt
mkdir -p wheels
pins=$(grep -E '^(flashinfer-python|apache-tvm-ffi|fla-core)==' "$REQ")
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
# shellcheck disable=SC2086
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d wheels $pins
ls -la wheels
total=$(du -cb wheels/*.whl | tail -1 | cut -f1)
echo "wheels: $((total / 1024 / 1024)) MiB"
if [ "$total" -gt $((64 * 1024 * 1024)) ]; then
    echo "the wheels exceed 64 MiB, too big to carry to the GPU machine" >&2
    exit 1
fi
