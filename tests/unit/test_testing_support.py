"""loramux.testing: the percentile's definition, and that importing it needs no test-only package."""
from __future__ import annotations

import math
import subprocess

import pytest

from loramux.child_python import python_command
from loramux.testing import percentile


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([], 50, math.nan),
    ([7.0], 99, 7.0),
    ([3, 1, 2], 0, 1),
    ([3, 1, 2], 50, 2),
    ([3, 1, 2], 100, 3),
    (list(range(1, 101)), 99, 99),  # nearest rank: ceil(0.99 * 100) = the 99th value
    (list(range(1, 101)), 50, 50),
    (list(range(1, 11)), 95, 10),  # ceil(9.5) = the 10th value: never interpolated
    (list(range(1, 11)), 25, 3),
])
def test_percentile_is_nearest_rank(values, q, expected):
    got = percentile(values, q)
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_importing_it_loads_no_test_only_package():
    code = ("import sys, loramux.testing; "
            "print(sorted(m for m in ('moto', 'boto3', 'redis', 'httpx', 'uvicorn', 'pytest') if m in sys.modules))")
    out = subprocess.run(python_command("-c", code), capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out
