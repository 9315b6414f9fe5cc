"""No test orders events with a sleep: it hopes the other side got there in time, which a busy machine
breaks. Tests wait on state (`polling.wait_until`, events) or inject a clock; a sleep may only sit inside
the named helpers below, each one a poll or a fake that must be slow."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parents[1]

# (file, innermost enclosing function) -> why a sleep is right there.
ALLOWED = {
    ("polling.py", "wait_until"): "the polling helper: sleeps between checks of the awaited state",
    ("polling.py", "wait_until_async"): "the polling helper, inside an event loop",
    ("conftest.py", "start_redis_server"): "polls redis-server until it answers a ping",
    ("unit/test_ledger_durability.py", "slow_sync"): "a slow disk is the condition under test: records that arrive "
                                                "during one fsync share the next",
}
SLEEPY_MODULES = {"time", "asyncio", "anyio", "trio"}


def sleep_calls(tree: ast.AST) -> list[tuple[int, str | None]]:
    """(line, innermost enclosing function or None) of every call to a module's `sleep` in `tree`: `time.sleep`,
    `asyncio.sleep` (also under an `import ... as` name), and `sleep` however it was imported."""
    modules = set(SLEEPY_MODULES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.asname and a.name in SLEEPY_MODULES)
    sleep_names = {"sleep"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in SLEEPY_MODULES:
            sleep_names.update(a.asname or a.name for a in node.names if a.name == "sleep")

    found: list[tuple[int, str | None]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Name) and func.id in sleep_names) or (
                    isinstance(func, ast.Attribute) and func.attr == "sleep"
                    and isinstance(func.value, ast.Name) and func.value.id in modules):
                found.append((node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def test_sleeps_sit_only_in_the_named_polling_helpers_and_slow_fakes():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        name = str(path.relative_to(TESTS))
        for line, function in sleep_calls(ast.parse(path.read_text(), filename=name)):
            if (name, function) not in ALLOWED:
                offenders.append(f"{name}:{line} (in {function or 'module level'})")
    assert offenders == [], ("sleeps that order events; wait on state with polling.wait_until (or an event, or an "
                             "injected clock), or name a slow fake in ALLOWED with the reason: " + ", ".join(offenders))


def test_the_check_finds_every_spelling_of_a_sleep():
    source = """
import time, asyncio as aio
from time import sleep as nap
from asyncio import sleep

def helper():
    time.sleep(1)

async def other():
    await aio.sleep(0)
    await sleep(1)
    def inner():
        nap(2)

time.sleep(3)
event.wait(1)
thing.sleep(1)
"""
    assert sleep_calls(ast.parse(source)) == [(7, "helper"), (10, "other"), (11, "other"), (13, "inner"), (15, None)]
