"""Waiting on state in tests: poll a condition until it holds, or fail after a deadline naming what was awaited.

These are the only waits tests may build on a sleep (`test_no_sleeps` enforces it): a sleep that orders
events hopes the other side got there in time, which a busy machine breaks; a poll of the state the test
needs holds on any machine, and its deadline only bounds how long a broken build takes to fail.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def _give_up(what: str, timeout_s: float, detail: Callable[[], object] | None) -> None:
    more = f" ({detail()})" if detail is not None else ""
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}{more}")


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = 30.0, poll_s: float = 0.01,
               detail: Callable[[], object] | None = None) -> T:
    """Call `condition()` until it returns something truthy, and return that. After `timeout_s` the test
    fails, saying it waited for `what` (and `detail()`, when given: the state that did not get there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            _give_up(what, timeout_s, detail)
        time.sleep(poll_s)


async def wait_until_async(condition: Callable[[], T], what: str, timeout_s: float = 30.0, poll_s: float = 0.005,
                           detail: Callable[[], object] | None = None, every: Callable[[], object] | None = None) -> T:
    """`wait_until` inside an event loop: the loop keeps running the code under test between polls.
    `every()`, when given, runs before each poll that finds the condition false (to drive the system on)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if every is not None:
            every()
        if time.monotonic() > deadline:
            _give_up(what, timeout_s, detail)
        await asyncio.sleep(poll_s)
