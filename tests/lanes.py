"""Test lanes: markers given at collection, and a time budget a lane can fail on (tests/conftest.py imports
these hooks; docs/development.md, "Test lanes", says how to run each lane).

A test's markers come from what it uses, so that a new test lands in the right lane without being told:

- `real_model`: the embedded SmolLM2 (its `tokenizer` or `smol_dir` fixture, converted from GGUF on first use;
  `tiny_dir` and everything built on it need its tokenizer), or an explicit `@pytest.mark.real_model`.
- `postgres`: a PostgreSQL database (the `postgresql` parameter of `database_url`, or `postgres_server_url`).
- `ray`: the session's Ray cluster (`ray_cluster`).
- `browser`: chromium through Playwright (the `browser` fixture).
- `subprocess`: starts a Python or CLI process, in the test or in one of its fixtures, or through a helper of
  its own module (found in their source: `subprocess.`, `Popen`, `sys.executable`, `create_subprocess_exec`).
- `slow`: measured above a few seconds (setup included) on the 2-core VM: SLOW below, by node id prefix.
"""
from __future__ import annotations

import inspect
import re
import sysconfig
import time

import pytest

INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")})

MARKER_FIXTURES = {
    "real_model": {"smol_dir", "tokenizer"},
    "postgres": {"postgres_server_url"},
    "ray": {"ray_cluster"},
    "browser": {"browser"},
}

# Node id prefixes of the tests (or whole files, or parametrisations) measured above ~3 s with setup, on the
# 2-core VM, that no fixture above already sends out of the fast lane. Re-measure with
# `pytest -m "not slow" --durations=30` when the fast lane nears its budget.
SLOW = (
)

STARTS_A_PROCESS = re.compile(r"\bsubprocess\.|\bPopen\(|\bsys\.executable\b|\bcreate_subprocess_exec\b")


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


_module_spawners: dict[str, frozenset[str]] = {}


def _spawners(module) -> frozenset[str]:
    """Names of the module's own functions and classes whose source starts a process."""
    if module.__name__ not in _module_spawners:
        names = set()
        for name, obj in vars(module).items():
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == \
                    module.__name__ and STARTS_A_PROCESS.search(_source(obj)):
                names.add(name)
        _module_spawners[module.__name__] = frozenset(names)
    return _module_spawners[module.__name__]


def _starts_a_process(func) -> bool:
    if str(inspect.getsourcefile(func) or "").startswith(INSTALLED):
        return False  # pytest's and plugins' own fixtures (tmp_path, capfd, ...)
    source = _source(func)
    if STARTS_A_PROCESS.search(source):
        return True
    module = inspect.getmodule(func)
    return module is not None and any(re.search(rf"\b{name}\b", source) for name in _spawners(module))


def lane_markers(item) -> set[str]:
    """The lane markers `item` gets from its fixtures, its parameters, its source and SLOW."""
    names = set(getattr(item, "fixturenames", ()))
    markers = {marker for marker, fixtures in MARKER_FIXTURES.items() if names & fixtures}
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("database_url") == "postgresql":
        markers.add("postgres")
    funcs = [getattr(item, "function", None)]
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    for defs in fixtureinfo.name2fixturedefs.values() if fixtureinfo is not None else ():
        funcs.extend(d.func for d in defs)
    if any(f is not None and _starts_a_process(f) for f in funcs):
        markers.add("subprocess")
    if item.nodeid.startswith(SLOW):
        markers.add("slow")
    return markers


def pytest_addoption(parser):
    parser.addoption("--lane-budget", type=float, default=None, metavar="SECONDS",
                     help="fail the session when it takes longer than this, collection included (make test-fast)")


def pytest_configure(config):  # the markers themselves are registered in pyproject.toml
    config.stash[_started] = time.monotonic()


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in sorted(lane_markers(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(marker)


_started = pytest.StashKey[float]()
_overrun = pytest.StashKey[str]()


def over_budget(elapsed_s: float, budget_s: float | None) -> str | None:
    """The failure message when a session of `elapsed_s` exceeded its `--lane-budget`, else None."""
    if budget_s is None or elapsed_s <= budget_s:
        return None
    return (f"this lane took {elapsed_s:.1f} s, over its budget of {budget_s:.0f} s: mark what grew `slow` "
            "(tests/lanes.py SLOW; --durations=20 lists the slowest)")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    message = over_budget(time.monotonic() - config.stash[_started], config.getoption("--lane-budget"))
    if message is not None:
        config.stash[_overrun] = message
        if exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    if _overrun in config.stash:
        terminalreporter.write_line(f"FAILED lane budget: {config.stash[_overrun]}", red=True, bold=True)
