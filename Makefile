# The two commands of the README's Quick start. Each creates or refreshes the project's virtual environment
# (.venv) and installs everything it needs; nothing else must be on the machine but Python 3.11 (and, for CPU
# runs, the local torch 2.13.0 wheel that `pip install torch==2.13.0` finds).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hetu_installed
NPROC ?= 4
DEMO_DIR := runs/demo

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[megatron,deepspeed,dev,plot,diffusion]"
	touch $(STAMP)

# The main job: pretrain_gpt.py on NPROC CPU ranks with an emulated straggler, Megatron's uniform plan vs
# hetu_ext's online re-planning; writes runs/demo/throughput.png.
demo: venv
	OMP_NUM_THREADS=1 bash launch/demo.sh $(NPROC) $(DEMO_DIR)

test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest

clean:
	rm -rf $(VENV) runs
