# Everything a newcomer needs: `make probe` and `make test` each create .venv, install the
# package (which compiles the native shim with cffi) and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup probe test bench clean

$(STAMP): pyproject.toml setup.py constraints.txt $(wildcard native/*.c native/*.h native/*.py)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[torch,plot,sweep,test,engine]'
	touch $(STAMP)

# the venv is not on PATH, and the README's commands use the bare name `odma-hw`
ON_PATH := @echo "odma-hw is $(BIN)/odma-hw: run '. $(BIN)/activate' to put it on PATH"

setup: $(STAMP)
	$(ON_PATH)

probe: $(STAMP)
	$(BIN)/odma-hw probe
	$(ON_PATH)

test: $(STAMP)
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python -m pytest bench --benchmark-only --benchmark-columns=min,median,max

clean:
	rm -rf $(VENV) build *.egg-info odma_hw/_native*.so
