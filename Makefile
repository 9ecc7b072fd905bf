# Two commands for a newcomer on a fresh machine (both idempotent):
#   make demo   create .venv if missing, install the package, run the main job
#   make test   same .venv, install the test extras, mypy, the whole test suite
#               (the suite runs ruff itself: tests/test_package.py), in parallel
#               on every core (pytest-xdist; TEST_WORKERS=0 for one process)
#   make test-fast   the suite without tests marked slow (about 2 min on 2 idle cores), for iterating
#   make notebooks   regenerate tutorials/*.ipynb from tutorials/*.py
# pip (not uv): pip takes the torch builds cached on this machine.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# extra pytest arguments, e.g. make test-fast PYTEST_ARGS="--durations=15 -x"
PYTEST_ARGS ?=
# pytest-xdist workers: auto = one per core; 0 = no workers, one process.
# loadgroup: tests spread one by one, except those marked
# @pytest.mark.xdist_group(name), which share one worker (and its fixtures).
TEST_WORKERS ?= auto
XDIST := -n $(TEST_WORKERS) --dist loadgroup

.PHONY: demo test test-fast lint bench notebooks clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml setup.cfg | $(PY)
	$(PIP) install --quiet -e ".[sevennet]"
	touch $@

$(VENV)/.installed-test: pyproject.toml setup.cfg | $(PY)
	$(PIP) install --quiet -e ".[test,sevennet,d3,mace]"
	touch $@ $(VENV)/.installed

# mace-torch pins e3nn==0.4.4, sevenn needs e3nn>=0.5: its other requirements come
# with the [mace] extra above, mace-torch itself without its pin (runs on e3nn 0.6).
MACE_TORCH := mace-torch==0.3.15
$(VENV)/.installed-mace: $(VENV)/.installed-test
	$(PIP) install --quiet --no-deps "$(MACE_TORCH)"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m nvalchemi_ase demo

test: $(VENV)/.installed-mace
	$(PY) -m mypy
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: $(VENV)/.installed-mace
	$(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

bench: $(VENV)/.installed-mace
	$(PY) -m benchmarks

# the tutorials' notebooks from their scripts (tests/test_tutorials.py checks they agree)
notebooks: $(VENV)/.installed-test
	$(VENV)/bin/jupytext --to ipynb --set-kernel python3 tutorials/[0-9][0-9]_*.py

lint: $(VENV)/.installed-test
	$(PY) -m ruff check nvalchemi_ase tests tutorials benchmarks
	$(PY) -m ruff format --check nvalchemi_ase tests tutorials benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache
