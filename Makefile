# Everything a newcomer needs: `make probe` and `make test` each create .venv, install the
# package (which compiles the native shim with cffi) and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# probing needs only the package's own requirements (cffi, numpy, numba): a fresh machine probes
# in well under 2 minutes; the extras (torch, Ray, transformers, ...) come with `setup` and `test`
CORE_STAMP := $(VENV)/.installed-core
STAMP := $(VENV)/.installed
# the tests also need the engine's Triton kernels (run by its interpreter); probing does not
TEST_STAMP := $(VENV)/.installed-kernels

.PHONY: setup probe test bench gpu-check clean

$(CORE_STAMP): pyproject.toml setup.py constraints.txt $(wildcard native/*.c native/*.h native/*.py)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[torch,plot,sweep,test,engine]'
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[torch,plot,sweep,test,engine,kernels]'
	touch $(TEST_STAMP)

# the venv is not on PATH, and the README's commands use the bare name `odma-hw`
ON_PATH := @echo "odma-hw is $(BIN)/odma-hw: run '. $(BIN)/activate' to put it on PATH"

setup: $(STAMP)
	$(ON_PATH)

probe: $(CORE_STAMP)
	$(BIN)/odma-hw probe
	$(ON_PATH)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest tests

bench: $(TEST_STAMP)
	$(BIN)/python -m pytest bench --benchmark-only --benchmark-columns=min,median,max

# on a GPU machine without network: engine --check, the speed runs, calibrate and simulate, the
# kernel benchmark and the CUDA tests in one deadline (bench/gpu_check.sh says what it needs
# beside the checkout)
gpu-check:
	OUT=$${OUT:-gpu-results} bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info odma_hw/_native*.so
