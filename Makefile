# One command surface for humans, hooks and CI (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: setup build demo test fmt-check test-rust test-python lint stubtest bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.7,<2" "numpy>=1.24" "pytest>=7" "mypy>=1.8" "psutil>=5" "typing_extensions>=4.12"

setup: $(PY) build

build: $(PY)
	$(VENV)/bin/maturin develop --release -q

demo: setup
	$(PY) benchmarks/demo.py

test: setup fmt-check test-rust test-python stubtest

fmt-check:
	cargo fmt --all --check

test-rust:
	cargo test --workspace --exclude opbridge-python -q

test-python: $(PY)
	$(PY) -m pytest -q

stubtest: $(PY)
	$(PY) -m mypy.stubtest opbridge._native --allowlist .ci/stubtest-allowlist.txt

lint:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -q -- -D warnings

bench: setup
	$(PY) benchmarks/bench_vector_add.py
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) benchmarks/bench_matmul.py
	$(PY) benchmarks/bench_ops.py
	$(PY) benchmarks/bench_small_calls.py
	$(PY) benchmarks/bench_plugin.py
	$(PY) benchmarks/bench_bindings.py
	cargo bench -p opbridge-runtime --bench pool

clean:
	rm -rf $(VENV) target benchmarks/_build
