"""The Python the project says it supports is the one its code needs: pyproject's requires-python, ruff's
target and every regular expression in the package agree (possessive quantifiers and atomic groups are
Python 3.11+; the package supports 3.10)."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("platform", "adapters", "kernels", "admin")
RE_FUNCTIONS = {"compile", "match", "fullmatch", "search", "sub", "subn", "split", "findall", "finditer"}


def pyproject_value(key: str) -> str:
    """A top-level string setting of pyproject.toml (read as text: tomllib is 3.11+ itself)."""
    (value,) = re.findall(rf'^{re.escape(key)}\s*=\s*"([^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    return value


def minimum_python() -> tuple[int, int]:
    spec = pyproject_value("requires-python")
    found = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert found, f"requires-python {spec!r} is not of the form '>=3.N'"
    return 3, int(found.group(1))


def test_ruff_targets_the_minimum_python():
    major, minor = minimum_python()
    assert pyproject_value("target-version") == f"py{major}{minor}"


def regex_literals() -> list[tuple[str, int, str | bytes]]:
    """(file, line, pattern) of every constant pattern passed to a `re` function in the package."""
    found = []
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                        and node.func.attr in RE_FUNCTIONS and node.args
                        and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, (str, bytes))):
                    found.append((str(path.relative_to(ROOT)), node.lineno, node.args[0].value))
    return found


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the 3.11 parser is what knows the newer syntax")
def test_no_regex_needs_a_newer_python_than_requires_python_allows():
    from re import _constants, _parser

    newer = {_constants.POSSESSIVE_REPEAT, _constants.ATOMIC_GROUP}  # added in 3.11

    def opcodes(parsed):
        for op, arg in parsed:
            yield op
            for item in arg if isinstance(arg, (list, tuple)) else [arg]:
                if isinstance(item, _parser.SubPattern):
                    yield from opcodes(item)
                elif isinstance(item, (list, tuple)):
                    for sub in item:
                        if isinstance(sub, _parser.SubPattern):
                            yield from opcodes(sub)

    literals = regex_literals()
    assert len(literals) > 3  # the scan finds the package's patterns
    if minimum_python() >= (3, 11):
        return
    offending = [(f, line) for f, line, pattern in literals if newer & set(opcodes(_parser.parse(pattern)))]
    assert offending == []


def test_the_json_string_scan_matches_the_possessive_one_it_replaced():
    """The non-possessive pattern in the ingress depth scan finds the same strings (random bodies)."""
    import random

    from loramux.server.http.ingress import _JSON_STRING

    possessive = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.S)
    rng = random.Random(7)
    for _ in range(2000):
        body = bytes(rng.choice(b'"\\[]{}ab \n') for _ in range(rng.randint(0, 40)))
        assert _JSON_STRING.sub(b"", body) == possessive.sub(b"", body), body
    hostile = b'"' + b"\\a" * 200_000 + b'\\'  # an unterminated string of escapes, ending in a lone backslash
    assert _JSON_STRING.sub(b"", hostile) == b"\\"
