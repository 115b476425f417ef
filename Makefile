# Two commands on a fresh machine:  `make run` (the embedded default) and `make test`.
PY ?= python3
PIP ?= $(PY) -m pip
# The CPU wheel first, so that nothing resolves torch to a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install system-deps run test test-fast bench-quick proto proto-check clean

system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null 2>&1 || \
	  (sudo apt-get update -qq && sudo apt-get install -y -qq redis-server) >/dev/null; }

install: system-deps
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"

run: install
	strata generate "def fibonacci(n):" --max-tokens 96

test: install
	$(PY) -m pytest -q tests

test-fast:
	$(PY) -m pytest -q -x tests/unit

bench-quick:
	$(PY) benchmarks/engine_throughput.py --quick

proto:
	$(PY) scripts/gen_proto.py

proto-check:
	$(PY) scripts/gen_proto.py --check

clean:
	rm -rf build dist *.egg-info .pytest_cache
