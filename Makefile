# The two commands the README promises: `make demo` and `make test`. Both set everything up themselves,
# idempotently: a .venv with the pinned CPU torch, the project and its extras, and the Fashion-MNIST files.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DEMO_RUN ?= runs/demo
DEMO_BUNDLE ?= bundles/demo

.PHONY: setup data demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[train,serve,dev]'
	@touch $@

data: $(FMNIST)

$(FMNIST):
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq dataset-fashion-mnist

demo: setup data
	$(VENV)/bin/torchrun --standalone --nproc_per_node=1 training/pretrain.py \
		--config configs/fmnist_vit_tiny.yaml --output-dir $(DEMO_RUN) --resume
	$(VENV)/bin/msn-export --checkpoint $(DEMO_RUN)/checkpoint.pt --out $(DEMO_BUNDLE)
	@echo "Demo bundle written to $(DEMO_BUNDLE) (model.onnx, encoder.safetensors, msn.json)."

test: setup data
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check training msn_serve visualizer tests benchmarks

clean:
	rm -rf $(VENV) runs bundles .pytest_cache
