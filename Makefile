# The two commands of the README's Quick start. Each creates or refreshes the project's virtual environment
# (.venv) and installs everything it needs; nothing else must be on the machine but Python 3.11 (and, for CPU
# runs, the local torch 2.13.0 wheel that `pip install torch==2.13.0` finds).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hetu_installed
NPROC ?= 4
DEMO_DIR := runs/demo

.PHONY: demo test test-fast venv clean

venv: $(STAMP)

# One line per step, then pip's own progress (a few minutes on a fresh clone, mostly torch and DeepSpeed).
$(STAMP): setup.py Makefile
	@echo "venv [1/4]: creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "venv [2/4]: upgrading pip"
	$(PY) -m pip install --upgrade pip
	@echo "venv [3/4]: torch 2.13.0 (the CPU wheel on a machine without CUDA)"
	$(PY) -m pip install "torch==2.13.0"
	@echo "venv [4/4]: hetu_ext with its extras: megatron-core, deepspeed, diffusers, peft, test and plot tools"
	$(PY) -m pip install -e ".[megatron,megatron-lm,deepspeed,dev,plot,diffusion,lora]"
	touch $(STAMP)
	@echo "venv ready: $(VENV) (run tools as $(PY) ..., or source $(VENV)/bin/activate)"

# The main job: pretrain_gpt.py on NPROC CPU ranks with an emulated straggler, Megatron's uniform plan vs
# hetu_ext's online re-planning; writes runs/demo/throughput.png.
demo: venv
	OMP_NUM_THREADS=1 bash launch/demo.sh $(NPROC) $(DEMO_DIR)

# Two passes: every test but the `serial` ones on two pytest-xdist workers (whole modules per worker, so module
# fixtures are built once, test_readme's blocks by page; the longest modules first), then the `serial` ones one at a time: they judge wall-clock
# time (the demo, the elastic launcher), which a second test on the same cores would push past its deadlines
# (tests/conftest.py, SERIAL_MODULES). Bytecode goes to .venv/pycache, so that modules of read-only folders (a
# Megatron-LM checkout) and runs with PYTHONDONTWRITEBYTECODE set are compiled once, not in every process.
# A test's own time limits catch hangs, not slowness: two tests side by side get twice as long.
TEST_ENV := OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/$(VENV)/pycache \
	HETU_TEST_TIMEOUT_SCALE=2
test: venv
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist loadgroup -m "not serial"
	$(TEST_ENV) $(PY) -m pytest -m serial

# Every test not marked gold, e2e or faults (markers assigned in tests/conftest.py; docs/testing.md): pure tests,
# small multi-process tests and the launchers' one-line errors, a few minutes on 2 cores.
test-fast: venv
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist loadgroup -m "not gold and not e2e and not faults"

clean:
	rm -rf $(VENV) runs
