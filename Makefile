# One command surface for humans, hooks and CI (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RUFF   := $(VENV)/bin/ruff
# The Python that ruff checks and formats: the package, its tests, benchmarks and tools.
PY_SRC := python tests benchmarks tools

.PHONY: setup build repository demo test test-rust test-python lint stubtest bench bench-plot bench-serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.7,<2" "numpy>=1.24" "pytest>=7" "mypy>=1.8" "psutil>=5" "typing_extensions>=4.12" \
		"ruff>=0.6,<1" "tritonclient[http,grpc]>=2.40" "pyyaml>=6" "matplotlib>=3.7"
	touch $(SERVE_DEPS)

# A venv made before the server's test clients (pyyaml, for the deployment manifests' test, and
# matplotlib, for `opbridge bench --plot`) joined the dev tools gets them here; a new stamp name
# makes older venvs install them again.
SERVE_DEPS := $(VENV)/.serve-test-deps-3
$(SERVE_DEPS): $(PY)
	$(PY) -m pip install -q "tritonclient[http,grpc]>=2.40" "pyyaml>=6" "matplotlib>=3.7"
	touch $(SERVE_DEPS)

# A venv made before ruff joined the dev tools gets it here.
$(RUFF): $(PY)
	$(PY) -m pip install -q "ruff>=0.6,<1"

setup: $(PY) build repository

# The extension module, and the server binary that `opbridge serve` runs (shipped in the package).
build: $(PY)
	$(VENV)/bin/maturin develop --release -q
	cargo build --release -q -p opbridge-serve
	mkdir -p python/opbridge/_bin
	cp target/release/opbridge-serve python/opbridge/_bin/opbridge-serve

# The example model repository's plugin libraries (one per version folder).
REPO_EXAMPLE := examples/repository/scale_add
repository: $(REPO_EXAMPLE)/1/libscale_add.so $(REPO_EXAMPLE)/2/libscale_add.so
$(REPO_EXAMPLE)/%/libscale_add.so: examples/plugins/c/scale_add.c python/opbridge/include/opbridge/plugin.h
	cc -O2 -shared -fPIC -I python/opbridge/include -DSCALE_ADD_VERSION=$* $< -o $@

demo: setup
	$(PY) benchmarks/demo.py

test: setup lint test-rust test-python stubtest

test-rust:
	cargo test --workspace --exclude opbridge-python -q

test-python: $(PY) $(SERVE_DEPS)
	$(PY) -m pytest -q

stubtest: $(PY)
	$(PY) -m mypy.stubtest opbridge._native --allowlist .ci/stubtest-allowlist.txt

# Rust: rustfmt, clippy and rustdoc, warnings denied (private items' docs first, then the public
# docs, which also catch public docs linking to private items; target/doc keeps the public ones).
# Python: ruff's linter and formatter (configured in pyproject.toml).
lint: $(RUFF)
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -q -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps -q --document-private-items
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps -q
	$(RUFF) check $(PY_SRC)
	$(RUFF) format --check $(PY_SRC)

bench: setup
	$(PY) benchmarks/bench_vector_add.py
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) benchmarks/bench_matmul.py
	$(PY) benchmarks/bench_ops.py
	$(PY) benchmarks/bench_small_calls.py
	$(PY) benchmarks/bench_plugin.py
	$(PY) benchmarks/bench_bindings.py
	$(PY) benchmarks/bench_profiler.py
	cargo bench -p opbridge-runtime --bench pool

# The plot the README shows: `opbridge bench` on this machine (run it on a quiet one).
bench-plot: setup $(SERVE_DEPS)
	$(PY) -m opbridge bench --json docs/bench-cpu.json --plot docs/bench-cpu.png

# opbridge serve against MLServer (installed into benchmarks/.venv-mlserver on first use), with
# tritonclient and the native load generator (benchmarks/loadgen). Not part of `bench`: it needs
# the network once, for MLServer.
bench-serve: build
	OPBRIDGE_SERVE_BIN=target/release/opbridge-serve $(PY) benchmarks/bench_serve.py

clean:
	rm -rf $(VENV) target benchmarks/_build benchmarks/.venv-mlserver
