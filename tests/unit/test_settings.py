"""One Settings: every LORAMUX_* variable is read there, taken by the engine's configuration under the same
name, and a setting that cannot work stops `loramux serve` with one line that names it. (That
docs/configuration.md lists every setting: tests/unit/test_docs.py.)"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from loramux.cli import main
from loramux.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
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


def test_every_engine_config_field_named_like_a_setting_takes_its_value_from_it():
    import dataclasses

    from loramux.engine.config import EngineConfig

    shared = [f for f in dataclasses.fields(EngineConfig) if f.name in Settings.model_fields]
    # Only the engine's own knobs lack a setting: a knob renamed on one side only shows up here.
    assert {f.name for f in dataclasses.fields(EngineConfig)} - {f.name for f in shared} == {"num_blocks",
                                                                                          "async_adapter_loads"}
    unlike = {}  # a value for each shared field that differs from the engine's default, so a copy shows
    strings = {"lora_impl": "torch", "speculative_methods": "medusa"}  # a valid value of each text setting
    for f in shared:
        default = f.default
        unlike[f.name] = strings[f.name] if isinstance(default, str) else \
            {bool: lambda v: not v, int: lambda v: v + 3, float: lambda v: v + 0.5}[type(default)](default)
    config = EngineConfig.from_settings(Settings(**unlike))
    assert {name: getattr(config, name) for name in unlike} == unlike
    # The engine's own knobs keep their defaults.
    assert config.num_blocks is None and config.async_adapter_loads is True
