#!/usr/bin/env bash
# The one GPU check, for an offline CUDA machine with PyTorch, nvcc and ninja (an H100 or H200, 16 cores).
#
# Expected device time: about 8 minutes in all, under the 9 a run may take: the machine's start (1-2 min) and this
# script's CHECK_BUDGET_S (390 s): wheels and carried kernels ~20 s, the test groups 90 + 120 + 120 s, the benchmark
# with what is left. Nothing compiles when bench/gpu/prebuilt carries what tests/gpu needs; whatever it lacks is
# built first, in one parallel ninja (JIT_LIMIT_S), never inside a test.
#
#   bench/gpu/fetch_wheels.sh                 # once, where the package index is reachable: bench/gpu/wheels (~10 MiB)
#   bench/gpu/make_prebuilt.sh                # once per FlashInfer pin, with nvcc (no GPU): bench/gpu/prebuilt
#   bench/gpu/check.sh OUTDIR                 # on the GPU machine, carrying bench/gpu/wheels and bench/gpu/prebuilt
#   CHECK_DRY_RUN=1 PYTHON=... bench/gpu/check.sh OUTDIR   # without CUDA: every step up to the GPU ones
#
# Steps, each under a time limit so that the whole run ends before a deadline:
#   1. install the carried wheels (flashinfer-python, apache-tvm-ffi, fla-core) into a private --target folder;
#      versions and device (env.json)
#   2. unpack the carried modules into FlashInfer's AOT folder (loaded as they are: no ninja, no nvcc), on sm_90
#   3. the plan: what tests/gpu needs against what is carried; the rest built in one ninja (dry run: listed only)
#   4. pytest, the highest-risk files first, each group under its own `timeout -s INT` (pytest then still writes
#      its junit file): risk (linear attention, MoE, MXFP4, block FP8), graphs (CUDA graphs, hybrid graphs,
#      end-to-end), rest (every other file of tests/gpu); the dry run collects them in this order (--collect-only)
#   5. bench/gpu/bench.py all with the time left
# results.json is written whatever happens (an EXIT trap): every step's status, what timed out, the junit counts.
# Where only a few files can come back: cp OUTDIR/results.json "$DEST"; tar czf "$DEST/check.tgz" -C OUTDIR .
set -uo pipefail
OUT=${1:?usage: bench/gpu/check.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
export PY=${PYTHON:-python3}
DRY=${CHECK_DRY_RUN:-0}
T0=$(date +%s)
DEADLINE=$((T0 + ${CHECK_BUDGET_S:-390}))
export PYTHONUNBUFFERED=1
log() { echo "[check +$(($(date +%s) - T0))s] $*" | tee -a "$OUT/check.log"; }
limit() {  # limit SECONDS: SECONDS, or less when the deadline is nearer (at least 1)
    local want=$1 rest=$((DEADLINE - $(date +%s)))
    [ "$rest" -lt "$want" ] && want=$rest
    [ "$want" -lt 1 ] && want=1
    echo "$want"
}
declare -A STATUS
write_results() {
    local status_json
    status_json=$(for k in "${!STATUS[@]}"; do printf '"%s": %s, ' "$k" "${STATUS[$k]}"; done)
    $PY bench/gpu/check_steps.py results "$OUT" "{${status_json%, }}" "$(($(date +%s) - T0))" >/dev/null \
        || echo "{\"wall_s\": $(($(date +%s) - T0)), \"results_step_failed\": true}" >"$OUT/results.json"
    log "done in $(($(date +%s) - T0))s: $OUT/results.json"
}
trap write_results EXIT
rm -f "$OUT"/pytest-*.xml "$OUT"/results.json

# 1. wheels into a private folder (the dry run checks them for the GPU machine's Python, 3.12, not this one's)
SITE=${CHECK_SITE:-/tmp/fi-site}
rm -rf "$SITE"
if ! ls bench/gpu/wheels/*.whl >/dev/null 2>&1; then
    log "no wheels in bench/gpu/wheels: run bench/gpu/fetch_wheels.sh first (and carry that folder)"
    STATUS[wheels]=2
    exit 2
fi
target_python=()
[ "$DRY" = 1 ] && target_python=(--python-version "${WHEEL_PYTHON_VERSION:-3.12}" --only-binary=:all:)
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    ${target_python[@]+"${target_python[@]}"} \
    bench/gpu/wheels/*.whl >>"$OUT/check.log" 2>&1
STATUS[wheels]=$?
[ "${STATUS[wheels]}" -ne 0 ] && { log "wheel install failed"; exit 2; }
export CHECK_AOT_DIR="$SITE/flashinfer/data/aot"  # FlashInfer's FLASHINFER_AOT_DIR for the package in $SITE
if [ "$DRY" = 1 ] && ! PYTHONPATH="$SITE" $PY -c "import flashinfer" >/dev/null 2>&1; then
    log "dry run: the wheels are for another Python; the steps use this Python's own flashinfer"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
log "wheels: $(ls bench/gpu/wheels/*.whl | xargs -n1 basename | tr '\n' ' ')"

# The toolchain FlashInfer's JIT would use for anything not carried: nvcc, and -lcudart -lcuda where it links.
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$NVCC" ]; then
    real=$(grep -Io '/[^ ]*/bin/nvcc' "$(readlink -f "$NVCC")" 2>/dev/null | head -1 || true)  # a wrapper's toolkit
    export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "${real:-$NVCC}")")")}
    export PATH="$CUDA_HOME/bin:$PATH"
    SHIM=/tmp/fi-ldshim
    mkdir -p "$SHIM"
    if ! ls "$CUDA_HOME"/lib64/libcudart.so >/dev/null 2>&1; then
        cudart=$(ls "$CUDA_HOME"/lib*/libcudart.so* 2>/dev/null | head -1)
        [ -n "$cudart" ] && ln -sf "$cudart" "$SHIM/libcudart.so"
    fi
    if ! ls "$CUDA_HOME"/lib64/stubs/libcuda.so "$CUDA_HOME"/lib64/libcuda.so >/dev/null 2>&1; then
        libcuda=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
        [ -n "$libcuda" ] && ln -sf "$libcuda" "$SHIM/libcuda.so"
    fi
    export FLASHINFER_EXTRA_LDFLAGS="-L$SHIM"
fi
export FLASHINFER_WORKSPACE_BASE=/tmp/fi-jit  # the JIT cache for what is not carried: empty at the start
rm -rf "$FLASHINFER_WORKSPACE_BASE"
# On a GPU FlashInfer names the arch after it (90a on an H100 / H200); without one it must be told (the carried one).
[ "$DRY" = 1 ] && export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
log "CUDA_HOME=${CUDA_HOME:-none} MAX_JOBS=$MAX_JOBS arch ${FLASHINFER_CUDA_ARCH_LIST:-from the GPU}" \
    "${NVCC:+$("$NVCC" --version | tail -1)}"

if [ "$DRY" != 1 ]; then
    timeout "$(limit 120)" $PY bench/gpu/check_steps.py env >"$OUT/env.json" 2>>"$OUT/check.log"
    STATUS[env]=$?
    log "env: $(tr -d '\n' <"$OUT/env.json")"
fi

# 2. the carried modules: built for sm_90a, so only on a Hopper GPU (another compiles what it needs in step 3)
ARCHIVE=$(ls bench/gpu/prebuilt/*.tar.xz 2>/dev/null | head -1)
capability=$(grep -o '"capability": \[[0-9], [0-9]\]' "$OUT/env.json" 2>/dev/null || true)
if [ "$DRY" != 1 ] && [ "$capability" != '"capability": [9, 0]' ]; then
    log "the GPU is not sm_90 (${capability:-no capability in env.json}): the carried sm_90a modules are not used"
elif [ -n "$ARCHIVE" ]; then
    timeout "$(limit 60)" $PY bench/gpu/check_steps.py unpack "$ARCHIVE" >"$OUT/unpack.log" 2>&1
    STATUS[unpack]=$?
    log "unpack $(basename "$ARCHIVE") ($(du -k "$ARCHIVE" | cut -f1) KiB): status ${STATUS[unpack]}"
else
    log "no carried modules in bench/gpu/prebuilt (bench/gpu/make_prebuilt.sh makes them)"
fi

# 3. needed against carried; the rest in one parallel ninja before any test
timeout "$(limit 120)" $PY bench/gpu/check_steps.py plan >"$OUT/plan.log" 2>&1
STATUS[plan]=$?
missing=$($PY -c "import json, sys; print(len(json.loads(open(sys.argv[1]).read().splitlines()[-1])['missing']))" \
    "$OUT/plan.log" 2>/dev/null || echo "?")
log "plan: status ${STATUS[plan]}, $missing of the modules tests/gpu needs neither carried nor built"
if [ "$missing" != 0 ] && [ "$DRY" != 1 ]; then
    log "JIT compile of the missing modules, one ninja (limit $(limit ${JIT_LIMIT_S:-240})s)"
    timeout -s INT -k 10 "$(limit "${JIT_LIMIT_S:-240}")" $PY bench/gpu/check_steps.py build --missing \
        >"$OUT/jit.log" 2>&1
    STATUS[jit]=$?
    log "JIT compile: status ${STATUS[jit]}: $(tail -c 300 "$OUT/jit.log")"
fi

# 4. the tests, highest risk first
RISK="tests/gpu/test_gpu_linear_attention.py tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_mxfp4.py
      tests/gpu/test_gpu_fp8_block.py"
GRAPHS="tests/gpu/test_gpu_graphs.py tests/gpu/test_gpu_hybrid_graphs.py tests/gpu/test_gpu_end_to_end.py"
# shellcheck disable=SC2086
REST=$(ls tests/gpu/test_gpu_*.py | grep -v -x -F -f <(printf '%s\n' $RISK $GRAPHS))
if [ "$DRY" = 1 ]; then
    # shellcheck disable=SC2086
    timeout "$(limit 120)" $PY -m pytest --collect-only -q -p no:cacheprovider $RISK $GRAPHS $REST \
        >"$OUT/collect-raw.log" 2>&1
    STATUS[collect]=$?
    $PY - "$OUT" <<'EOF' >"$OUT/collect.log"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
ids = [line for line in (out / "collect-raw.log").read_text().splitlines() if "::" in line]
files = list(dict.fromkeys(i.split("::")[0] for i in ids))
print(json.dumps({"tests": len(ids), "files_in_order": files}))
EOF
    log "dry run: collected $(grep -c '::' "$OUT/collect-raw.log") tests in the planned order" \
        "(status ${STATUS[collect]})"
    exit 0
fi

run_group() {  # run_group NAME SECONDS FILES...: one pytest under SIGINT at its limit, its own junit file
    local name=$1 seconds=$2
    shift 2
    log "pytest $name (limit $(limit "$seconds")s)"
    timeout -s INT -k 15 "$(limit "$seconds")" $PY -m pytest "$@" -p no:cacheprovider -q -rs \
        --junitxml="$OUT/pytest-$name.xml" >"$OUT/pytest-$name.log" 2>&1
    STATUS[pytest_$name]=$?
    log "pytest $name: status ${STATUS[pytest_$name]}: $(tail -1 "$OUT/pytest-$name.log")"
}
# shellcheck disable=SC2086
run_group risk 90 $RISK
# shellcheck disable=SC2086
run_group graphs 120 $GRAPHS
# shellcheck disable=SC2086
run_group rest 120 $REST

# 5. the benchmark with the time left (each measurement in its own process; partial results survive a time-out)
if [ $((DEADLINE - $(date +%s))) -gt 30 ]; then
    log "bench (limit $(limit 600)s)"
    timeout -s INT -k 10 "$(limit 600)" $PY bench/gpu/bench.py all --out "$OUT/bench" >"$OUT/bench.log" 2>&1
    STATUS[bench]=$?
    log "bench: status ${STATUS[bench]}"
fi
