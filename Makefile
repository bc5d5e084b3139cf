# The two commands the README promises: `make demo` and `make test`. Both set everything up themselves,
# idempotently: a .venv with the pinned torch (on these machines the local CPU wheel of that version), the project and
# its extras, and the Fashion-MNIST files.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
STAMP := $(VENV)/.installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
CHROMIUM := /usr/bin/chromium
KUBECTL := /usr/bin/kubectl
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DEMO_RUN ?= runs/demo
DEMO_BUNDLE ?= bundles/demo
DEMO_DECODER ?= runs/demo-rcdm28
DEMO_DECODER_STEPS ?= 20000
DEMO_DECODER_MINUTES ?= 10
DEMO_PORT ?= 8000
DEMO_APP_PORT ?= 7860

.PHONY: setup data debian demo demo-controls test lint clean

setup: $(STAMP) debian

$(STAMP): pyproject.toml constraints.txt
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt torch==2.13.0 -e '.[train,serve,viz,dev,milvus]'
	@touch $@

data: debian

# The Debian packages both commands need, installed with one `apt-get update` for whatever is missing: the
# Fashion-MNIST files; chromium for the visualizer's browser tests (playwright drives it; `playwright install` cannot
# download); kubectl 1.20 with its built-in kustomize, which tests/deploy uses to render deploy/k8s offline.
debian:
	@missing=""; \
	[ -e $(FMNIST) ] || missing="$$missing dataset-fashion-mnist"; \
	[ -x $(CHROMIUM) ] || missing="$$missing chromium"; \
	[ -x $(KUBECTL) ] || missing="$$missing kubernetes-client"; \
	if [ -n "$$missing" ]; then \
		echo "apt-get install$$missing"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $$missing; \
	fi

# msn-eval COMMAND on the demo bundle, its figures also written to runs/demo/eval/COMMAND-NAME.json (what
# benchmarks/results/demo_controls/ keeps and docs/results.md renders).
DEMO_EVAL = $(VENV)/bin/msn-eval $(1) --bundle $(DEMO_BUNDLE) --data fashion-mnist --no-progress \
	--json $(DEMO_RUN)/eval/$(1)-$(2).json
SHOTS := --shots 1 2 5 --splits 3
PAPER_CLS := --backend torch --feature cls_pre_norm
# Expanded here, so that `make -n demo` does not run the demo's recipe: a recipe line that names the MAKE variable
# runs even under -n.
DEMO_MAKE := $(MAKE)

# Pretrain for 10 minutes (resumes, so a second `make demo` does not train again), export, start the service, then
# train a small RCDM decoder on the bundle for at most DEMO_DECODER_MINUTES (resumed: a second `make demo` trains it
# further, up to DEMO_DECODER_STEPS) in the background while the visualizer app is up; when the decoder's minutes are
# over, the same background job measures the controls (`demo-controls`) and prints them. They come after the decoder
# so that neither slows the other's timed minutes, and the app opens without waiting for ten evaluations.
demo: setup data
	$(VENV)/bin/torchrun --standalone --nproc_per_node=1 training/pretrain.py \
		--config configs/fmnist_vit_tiny.yaml --output-dir $(DEMO_RUN) --resume
	$(VENV)/bin/msn-export --checkpoint $(DEMO_RUN)/checkpoint.pt --out $(DEMO_BUNDLE)
	$(PY) -m training.examples --out $(DEMO_RUN)/example.png --folder $(DEMO_RUN)/unlabelled --count 500
	@# The service first, then the decoder training and the controls in one background job and at once the visualizer
	@# in the foreground: masks and neighbours work right away, sampling from the decoder's first checkpoint on, and
	@# each new checkpoint is loaded as it lands. Ctrl-C stops the app, and the EXIT trap stops the service and the
	@# background job, whose TERM trap stops whichever child it is waiting on (background jobs ignore SIGINT in a
	@# non-interactive shell).
	@$(VENV)/bin/msn-serve --bundle $(DEMO_BUNDLE) --data-dir $(DEMO_RUN)/serve-data --host 127.0.0.1 \
		--port $(DEMO_PORT) > $(DEMO_RUN)/serve.log 2>&1 & serve=$$!; background=; \
	trap 'kill $$serve $$background 2>/dev/null' EXIT; \
	ready=0; for i in $$(seq 300); do kill -0 $$serve 2>/dev/null || break; \
		$(PY) -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$(DEMO_PORT)/readyz', timeout=2)" \
		2>/dev/null && { ready=1; break; }; sleep 1; done; \
	[ $$ready = 1 ] || { echo "msn-serve did not become ready:"; tail -20 $(DEMO_RUN)/serve.log; exit 1; }; \
	echo "Serving $(DEMO_BUNDLE) on http://127.0.0.1:$(DEMO_PORT) (API docs at /docs; log $(DEMO_RUN)/serve.log). Try:"; \
	echo "  curl -F image=@$(DEMO_RUN)/example.png localhost:$(DEMO_PORT)/embed"; \
	echo "  curl -F image=@$(DEMO_RUN)/example.png -F 'mask={\"ratio\": 0.7, \"seed\": 1}' localhost:$(DEMO_PORT)/embed"; \
	( child=; trap 'kill $$child 2>/dev/null; wait $$child; exit 143' TERM; \
	  $(VENV)/bin/msn-visualize train --bundle $(DEMO_BUNDLE) --data fashion-mnist --config configs/rcdm_fmnist_28.yaml \
		--output-dir $(DEMO_DECODER)/cls --resume --set optim.max_steps=$(DEMO_DECODER_STEPS) \
		--set optim.max_minutes=$(DEMO_DECODER_MINUTES) --set run.progress_bar=false \
		> $(DEMO_RUN)/decoder.log 2>&1 & child=$$!; wait $$child; \
	  echo; echo "The decoder's $(DEMO_DECODER_MINUTES) minutes are over ($(DEMO_RUN)/decoder.log); the controls now:"; \
	  $(DEMO_MAKE) --no-print-directory demo-controls & child=$$!; wait $$child ) & background=$$!; \
	echo; \
	echo "Visualizer (mask an image, sample from the decoder): http://127.0.0.1:$(DEMO_APP_PORT)"; \
	echo "  the decoder trains for $(DEMO_DECODER_MINUTES) minutes meanwhile (log $(DEMO_RUN)/decoder.log): sampling"; \
	echo "  works from its first checkpoint on, and the page loads each new one by itself; then the low-shot and"; \
	echo "  kNN controls (trained, untrained, raw pixels) are measured and printed here ($(DEMO_RUN)/eval/;"; \
	echo "  \`make demo-controls\` measures them again)"; \
	echo "  its Labelling tab: folder $(DEMO_RUN)/unlabelled, classes e.g. top, trouser, dress, coat, shoe, bag"; \
	echo "Serving $(DEMO_BUNDLE) on http://127.0.0.1:$(DEMO_PORT); Ctrl-C stops both."; \
	$(VENV)/bin/msn-visualize app --bundle $(DEMO_BUNDLE) --decoder $(DEMO_DECODER)/cls --decoder $(DEMO_DECODER) \
		--port $(DEMO_APP_PORT) --serve-url http://127.0.0.1:$(DEMO_PORT)

# The demo bundle's low-shot and kNN accuracy, each beside the same network untrained (msn-eval --untrained: random
# init, seed 0, same architecture and preprocessing, so the difference is what MSN's training added), for the served
# feature and the paper's CLS, and the raw-pixel baseline; `make demo` runs it after its decoder's minutes.
demo-controls:
	@echo "== MSN, the feature the service serves (msn.json's feature):"
	$(call DEMO_EVAL,lowshot,served-trained) $(SHOTS)
	$(call DEMO_EVAL,knn,served-trained)
	@echo "== The same network untrained (random init, seed 0; same architecture, preprocessing and served feature):"
	@echo "   what MSN's training added is the difference from the rows above"
	$(call DEMO_EVAL,lowshot,served-untrained) $(SHOTS) --untrained 0
	$(call DEMO_EVAL,knn,served-untrained) --untrained 0
	@echo "== MSN, the paper's protocol (last block's CLS before the final norm):"
	$(call DEMO_EVAL,lowshot,cls-trained) $(SHOTS) $(PAPER_CLS)
	$(call DEMO_EVAL,knn,cls-trained) $(PAPER_CLS)
	@echo "== The same network untrained, the paper's CLS (random init, seed 0): the difference is MSN's training"
	$(call DEMO_EVAL,lowshot,cls-untrained) $(SHOTS) $(PAPER_CLS) --untrained 0
	$(call DEMO_EVAL,knn,cls-untrained) $(PAPER_CLS) --untrained 0
	@echo "== The baseline to beat, raw pixels (same protocol):"
	$(call DEMO_EVAL,lowshot,pixels) $(SHOTS) --backend pixels
	$(call DEMO_EVAL,knn,pixels) --backend pixels

# The suite on every core, at most 4 workers (each imports torch; more add memory, not speed, to a small machine).
# A module's tests stay on one worker, in order (--dist loadscope): they share its server and what earlier tests made.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")

test: setup data
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

lint: setup
	$(VENV)/bin/ruff check msn_core training msn_serve visualizer tests benchmarks

clean:
	rm -rf $(VENV) runs bundles .pytest_cache
