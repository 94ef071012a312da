#!/usr/bin/env bash
# The one GPU check, for an offline CUDA machine with PyTorch, nvcc and ninja (an H200: under 8 minutes).
#
#   bench/gpu/fetch_wheels.sh          # once, where PyPI is reachable: bench/gpu/wheels/*.whl (~10 MiB)
#   bench/gpu/check.sh OUTDIR          # on the GPU machine, from a checkout that carries bench/gpu/wheels
#
# Steps, each under a time limit so that the whole run ends before a deadline (CHECK_BUDGET_S, 470 s):
#   1. install the carried wheels (flashinfer-python, apache-tvm-ffi) into a private --target folder
#   2. JIT-compile, into an empty cache and timed, the attention kernels of both model shapes, RMSNorm and
#      SiLU-and-mul; then start compiling the slow RoPE module in the background
#   3. pytest tests/gpu (not slow)
#   4. bench/gpu/bench.py all (copy bandwidth; engine and transformers on both model shapes)
#   5. with the time left: the slow GPU tests (RoPE, float16), once the background build is done
# Writes into OUTDIR: check.log, env.json, jit.log, jit-slow.log, pytest.log, pytest.xml, pytest-slow.log,
# pytest-slow.xml, bench.log, bench/*.json and results.json (all of it in one object, with what was cut).
# Where only a few files can come back from the GPU machine:
#   bench/gpu/check.sh /tmp/check; cp /tmp/check/results.json "$DEST"; tar czf "$DEST/check.tgz" -C /tmp check
set -uo pipefail
OUT=${1:?usage: bench/gpu/check.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
export PY=${PYTHON:-python3}
T0=$(date +%s)
DEADLINE=$((T0 + ${CHECK_BUDGET_S:-470}))
export PYTHONUNBUFFERED=1
log() { echo "[check +$(($(date +%s) - T0))s] $*" | tee -a "$OUT/check.log"; }
limit() {  # limit SECONDS: SECONDS, or less when the deadline is nearer (at least 1)
    local want=$1 rest=$((DEADLINE - $(date +%s)))
    [ "$rest" -lt "$want" ] && want=$rest
    [ "$want" -lt 1 ] && want=1
    echo "$want"
}
declare -A STATUS

# 1. wheels, and the toolchain FlashInfer's JIT needs
SITE=/tmp/fi-site
rm -rf "$SITE"
if ! ls bench/gpu/wheels/*.whl >/dev/null 2>&1; then
    log "no wheels in bench/gpu/wheels: run bench/gpu/fetch_wheels.sh first (and carry that folder)"
    exit 2
fi
if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        bench/gpu/wheels/*.whl >>"$OUT/check.log" 2>&1; then
    log "wheel install failed"
    exit 2
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -z "$NVCC" ]; then
    log "nvcc not found: FlashInfer cannot JIT-compile"
    exit 2
fi
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
export PATH="$CUDA_HOME/bin:$PATH"
# FlashInfer links with -L$CUDA_HOME/lib64 -lcudart -lcuda; pip-style CUDA trees lack those names.
SHIM=/tmp/fi-ldshim
mkdir -p "$SHIM"
if ! ls "$CUDA_HOME"/lib64/libcudart.so >/dev/null 2>&1; then
    cudart=$(ls "$CUDA_HOME"/lib*/libcudart.so* 2>/dev/null | head -1)
    [ -n "$cudart" ] && ln -sf "$cudart" "$SHIM/libcudart.so"
fi
if ! ls "$CUDA_HOME"/lib64/stubs/libcuda.so "$CUDA_HOME"/lib64/libcuda.so >/dev/null 2>&1; then
    libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
    [ -z "$libcuda" ] && libcuda=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 \
        2>/dev/null | head -1)
    [ -n "$libcuda" ] && ln -sf "$libcuda" "$SHIM/libcuda.so"
fi
export FLASHINFER_EXTRA_LDFLAGS="-L$SHIM"
export FLASHINFER_WORKSPACE_BASE=/tmp/fi-jit  # an empty JIT cache: step 2 measures the full compile
rm -rf "$FLASHINFER_WORKSPACE_BASE"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
log "CUDA_HOME=$CUDA_HOME MAX_JOBS=$MAX_JOBS $("$NVCC" --version | tail -1)"

timeout "$(limit 120)" $PY bench/gpu/check_steps.py env >"$OUT/env.json" 2>>"$OUT/check.log"
STATUS[env]=$?
log "env: $(tr -d '\n' <"$OUT/env.json")"

# 2. the kernels every run needs, compiled in parallel into the empty cache; the slow ones behind
log "JIT compile (limit $(limit 200)s)"
timeout "$(limit 200)" $PY bench/gpu/check_steps.py precompile attention norm activation >"$OUT/jit.log" 2>&1
STATUS[jit]=$?
log "JIT compile: status ${STATUS[jit]}: $(tail -c 300 "$OUT/jit.log")"
MAX_JOBS=4 nice -n 19 timeout "$(limit 400)" $PY bench/gpu/check_steps.py precompile rope \
    >"$OUT/jit-slow.log" 2>&1 &
SLOW_JIT=$!

# 3. the GPU tests
log "pytest tests/gpu (limit $(limit 170)s)"
timeout "$(limit 170)" $PY -m pytest tests/gpu -p no:cacheprovider -q -rs --junitxml="$OUT/pytest.xml" \
    >"$OUT/pytest.log" 2>&1
STATUS[pytest]=$?
log "pytest: status ${STATUS[pytest]}: $(tail -1 "$OUT/pytest.log")"

# 4. the benchmark (each measurement in its own process; partial results survive a time-out)
log "bench (limit $(limit 600)s)"
timeout "$(limit 600)" $PY bench/gpu/bench.py all --out "$OUT/bench" >"$OUT/bench.log" 2>&1
STATUS[bench]=$?
log "bench: status ${STATUS[bench]}"

# 5. the slow GPU tests, if the background build is done in time
wait "$SLOW_JIT"
STATUS[jit_slow]=$?
if [ "${STATUS[jit_slow]}" -eq 0 ]; then
    log "pytest -m slow tests/gpu (limit $(limit 120)s)"
    timeout "$(limit 120)" $PY -m pytest tests/gpu -m slow -p no:cacheprovider -q -rs \
        --junitxml="$OUT/pytest-slow.xml" >"$OUT/pytest-slow.log" 2>&1
    STATUS[pytest_slow]=$?
    log "pytest slow: status ${STATUS[pytest_slow]}: $(tail -1 "$OUT/pytest-slow.log")"
else
    log "the RoPE build failed or did not finish in time: slow tests not run"
fi

status_json=$(for k in "${!STATUS[@]}"; do printf '"%s": %s, ' "$k" "${STATUS[$k]}"; done)
$PY bench/gpu/check_steps.py results "$OUT" "{${status_json%, }}" "$(($(date +%s) - T0))" >/dev/null
log "done in $(($(date +%s) - T0))s: $OUT/results.json"
