# The two commands a fresh machine needs:
#   make serve   set everything up, then run the gRPC service on the default model
#   make test    set everything up, then run the whole test suite
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTHON ?= python3
# CPU build of torch (fast to install here; see README "GPU" for a CUDA build).
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup serve test test-deps lint bench-offline bench-scheduling bench-serving compose-check clean

# The install generates the gRPC code from protos/ (setup.py), so a .proto edit re-runs it.
$(VENV)/.installed: pyproject.toml setup.py protos/inference.proto
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e '.[test]'
	$(PY) -c "import service.pb.inference_pb2"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/minivllm serve

# Test-only tools: a real Prometheus (promtool too), Alertmanager's amtool, nginx (the replica proxy),
# docker-compose and openssl (test certificates) from Debian, and the Node.js packages from npm.
test-deps:
	@if ! command -v promtool >/dev/null || ! command -v amtool >/dev/null || ! command -v docker-compose >/dev/null \
	    || ! command -v openssl >/dev/null || ! { command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; }; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	    prometheus prometheus-alertmanager nginx docker-compose openssl; \
	fi
	cd tests/node && npm ci --no-audit --no-fund --loglevel=error

test: setup test-deps
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

bench-offline: setup
	$(PY) -m bench.offline_throughput

bench-scheduling: setup
	$(PY) -m bench.scheduling

bench-serving: setup
	$(VENV)/bin/minivllm bench --help

compose-check:
	docker-compose config -q

clean:
	rm -rf $(VENV) tests/node/node_modules service/pb/*_pb2*.py service/pb/*_pb2*.pyi
