# One command each, on a fresh machine: `make demo` (the main job) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STACK ?= onprem

.PHONY: demo test lint venv clean lab

# The virtualenv is refreshed whenever requirements.txt changes.
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) scripts/demo.py

test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q

# The lab (root): up, check, down a stack in network namespaces. Needs iproute2, iputils-ping,
# iperf3, nginx, nftables, ufw (see README, Lab).
lab: venv
	$(PY) scripts/lab.py run $(STACK)

lint: venv
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
