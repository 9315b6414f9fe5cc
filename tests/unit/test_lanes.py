"""The test lanes (tests/lanes.py): the markers a test gets from what it uses, and the lane budget that fails
a session which took too long."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lanes import SLOW, over_budget

ROOT = Path(__file__).resolve().parents[2]

pytest_plugins = ["pytester"]

USES = '''
import subprocess
import sys

import pytest


@pytest.fixture
def tokenizer():
    return None


@pytest.fixture
def tiny_dir(tokenizer):
    return None


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request):
    return request.param


@pytest.fixture
def ray_cluster():
    return None


@pytest.fixture
def browser():
    return None


@pytest.fixture
def cli_output():
    return subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True).stdout


@pytest.fixture
def gguf_tokenizer():
    return {"gguf_file=": "model.gguf"}  # what AutoTokenizer.from_pretrained(..., gguf_file=...) reads


def start_server():
    return subprocess.Popen([sys.executable, "-c", "pass"])


def test_plain():
    assert True


def test_tiny_model(tiny_dir):
    assert True


def test_sql(database_url):
    assert True


def test_ray(ray_cluster):
    assert True


def test_browser(browser):
    assert True


def test_fixture_runs_the_cli(cli_output):
    assert True


def test_helper_starts_a_server():
    start_server().wait()


def test_reads_the_gguf(gguf_tokenizer):
    assert True


@pytest.mark.real_model
def test_marked_by_hand():
    assert True
'''


def test_markers_come_from_fixtures_parameters_and_source(pytester):
    pytester.makepyfile(test_uses=USES)
    result = pytester.inline_run("--collect-only", "-p", "lanes", "-W", "ignore::pytest.PytestAssertRewriteWarning")
    items = result.getcalls("pytest_collection_finish")[0].session.items
    lanes = {"slow", "ray", "browser", "subprocess", "postgres", "real_model"}
    markers = {item.name: {m.name for m in item.iter_markers()} & lanes for item in items}
    assert markers == {
        "test_plain": set(),
        "test_tiny_model": {"real_model"},  # tiny_dir needs the real tokenizer
        "test_sql[sqlite]": set(),
        "test_sql[postgresql]": {"postgres"},
        "test_ray": {"ray"},
        "test_browser": {"browser"},
        "test_fixture_runs_the_cli": {"subprocess"},
        "test_helper_starts_a_server": {"subprocess"},
        "test_reads_the_gguf": {"real_model"},
        "test_marked_by_hand": {"real_model"},
    }


RAY_TEST = """
import pytest


@pytest.fixture
def ray_cluster():
    return None


def test_uses_ray(ray_cluster):
    assert True
"""


def test_ray_tests_in_two_modules_are_a_usage_error(pytester):
    """`make test`'s xdist workers take whole modules (--dist loadfile): Ray tests in a second module could run
    beside the first, two Ray clusters at once."""
    lanes = ("-p", "lanes", "-W", "ignore::pytest.PytestAssertRewriteWarning", "--collect-only")
    pytester.makepyfile(test_ray_one=RAY_TEST)
    assert pytester.runpytest_inprocess(*lanes).ret == pytest.ExitCode.OK
    pytester.makepyfile(test_ray_two=RAY_TEST, test_plain="def test_plain():\n    assert True\n")
    split = pytester.runpytest_inprocess(*lanes)
    assert split.ret == pytest.ExitCode.USAGE_ERROR
    split.stderr.fnmatch_lines(["*the `ray` tests must share one module*they are in test_ray_one.py, test_ray_two.py"])


def test_a_session_over_its_lane_budget_fails(pytester):
    pytester.makepyfile(test_quick="def test_passes():\n    assert True\n")
    lanes = ("-p", "lanes", "-W", "ignore::pytest.PytestAssertRewriteWarning")
    over = pytester.runpytest_inprocess(*lanes, "--lane-budget", "0")
    assert over.ret == pytest.ExitCode.TESTS_FAILED
    over.stdout.fnmatch_lines(["FAILED lane budget: this lane took * s, over its budget of 0 s*", "*1 passed*"])
    within = pytester.runpytest_inprocess(*lanes, "--lane-budget", "600")
    assert within.ret == pytest.ExitCode.OK
    assert "lane budget" not in within.stdout.str()
    unbounded = pytester.runpytest_inprocess(*lanes)
    assert unbounded.ret == pytest.ExitCode.OK


def test_over_budget_names_the_time_and_the_budget():
    assert over_budget(179.0, 180.0) is None
    assert over_budget(500.0, None) is None
    message = over_budget(181.4, 180.0)
    assert message is not None and message.startswith("this lane took 181.4 s, over its budget of 180 s")


def test_every_slow_entry_names_a_test_that_exists():
    """A SLOW prefix that matches nothing (a test renamed or moved) would quietly put a slow test back in the fast
    lane."""
    for entry in SLOW:
        path, _, name = entry.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert name.split("[")[0] in functions, entry
