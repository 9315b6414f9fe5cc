"""The package installs as a wheel, imports from anywhere, and never shadows the stdlib `platform`."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from loramux.child_python import python_command

ROOT = Path(__file__).resolve().parents[2]


def setuptools_config() -> dict:
    """pyproject's [tool.setuptools], read by setuptools itself (tomllib is 3.11+)."""
    from setuptools.config.pyprojecttoml import read_configuration

    return read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]


def source_modules() -> set[str]:
    """Every module of the source folders, named as the wheel holds it (package-dir maps the folders)."""
    return {f"{package.replace('.', '/')}/{path.relative_to(ROOT / folder).as_posix()}"
            for package, folder in setuptools_config()["package-dir"].items()
            for path in (ROOT / folder).rglob("*.py")}


def test_every_package_folder_is_listed_in_pyproject():
    # An unlisted subpackage is missing from the strict editable install's link tree (ImportError in
    # development) and setuptools warns that it will be left out of wheels.
    config = setuptools_config()
    folders = {".".join([package, *init.parent.relative_to(ROOT / folder).parts])
               for package, folder in config["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    assert sorted(folders - set(config["packages"])) == []


def test_stdlib_platform_wins_from_the_repo_root():
    code = "import platform, loramux.engine.engine; print(platform.__file__); print(platform.system())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0].startswith(sysconfig.get_paths()["stdlib"])
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_wheel_contains_every_package_and_runs_from_elsewhere(tmp_path):
    subprocess.run(python_command("-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                                  "-w", str(tmp_path / "dist"), str(ROOT)), check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("loramux-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("loramux/cli.py", "loramux/engine/engine.py", "loramux/model/llama.py",
                   "loramux/server/app.py", "loramux/kernels/__init__.py", "loramux/adapters/__init__.py",
                   "loramux/admin/__init__.py", "loramux/db/models.py", "loramux/migrations/env.py",
                   "loramux/migrations/script.py.mako", "loramux/migrations/versions/0006_tier_max_choices.py"):
        assert module in names, module
    # A subpackage missing from pyproject's `packages` list would be missing here.
    assert sorted(source_modules() - set(names)) == []
    assert not any(n.startswith(("platform/", "tests/")) for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # The unpacked wheel comes first on the path, ahead of the editable install.
    code = ("import loramux.cli, loramux.engine.engine as e, platform; "
            f"assert e.__file__.startswith({str(site)!r}), e.__file__; print(platform.system())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    cli = subprocess.run([sys.executable, "-m", "loramux.cli", "plan", "--config", str(ROOT / "tests" / "data" /
                          "llama2-7b-config.json"), "--dtype", "bf16", "--context-len", "1024", "--batch-size", "2",
                          "--memory", "24GiB"], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert cli.returncode == 0 and "fits" in cli.stdout, cli.stderr
    db = tmp_path / "wheel.db"
    migrate = subprocess.run([sys.executable, "-m", "loramux.cli", "db", "upgrade", "--url", f"sqlite:///{db}"],
                             cwd=tmp_path, capture_output=True, text=True,
                             env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert migrate.returncode == 0 and "revision 0014" in migrate.stdout, migrate.stderr  # migrations ship
