"""One Settings: every LORAMUX_* variable is read there, and a setting that cannot work stops `loramux serve`
with one line that names it. (That docs/configuration.md lists every setting: tests/test_docs.py.)"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from loramux.cli import main

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("platform", "adapters", "admin", "kernels")
ENV_READ = re.compile(r"os\.environ|getenv")


def test_environment_is_read_only_by_settings():
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "platform" / "settings.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if ENV_READ.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "read configuration through loramux.settings.Settings:\n" + "\n".join(offenders)


def test_the_check_above_can_fail():
    assert ENV_READ.search('impl = os.environ.get("LORAMUX_LORA_IMPL", "auto")')
    assert ENV_READ.search('os.getenv("LORAMUX_ADMIN_KEY")')


@pytest.mark.parametrize("variable,value,needle", [
    ("LORAMUX_ADMIN_KEY", "not-an-admin-key", "LORAMUX_ADMIN_KEY must start with 'lmxa-'"),
    ("LORAMUX_PORT", "eighty", "LORAMUX_PORT"),
    ("LORAMUX_LORA_IMPL", "cuda", "LORAMUX_LORA_IMPL"),
    ("LORAMUX_ADAPTERS", "oops", "name=/path/to/adapter"),
])
def test_bad_configuration_stops_serve_with_one_line(monkeypatch, capsys, variable, value, needle):
    monkeypatch.setenv(variable, value)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
