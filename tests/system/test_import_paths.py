"""The repo's kernels/ folder never stands in for Hugging Face's `kernels` (a transformers dependency):
not under the test runner as the Makefile starts it, not in the children the product and the tests start,
and not when a user runs `python -m loramux.cli` in the checkout."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from loramux.child_python import python_command
from loramux.testing import save_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(sysconfig.get_paths()["purelib"]).resolve()


def env_without_safe_path() -> dict[str, str]:
    """This environment less PYTHONSAFEPATH, which would hide what a command line itself does."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}


def test_the_cli_runs_with_cwd_the_repo_root(tmp_path, tokenizer):
    # `python -m` puts the working directory first on sys.path. --help imports no transformers; generate
    # does (the tokenizer's load imports `kernels`), so it is the run that would fail.
    help_ = subprocess.run([sys.executable, "-m", "loramux.cli", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env=env_without_safe_path())
    assert help_.returncode == 0 and "generate" in help_.stdout, help_.stderr
    save_tiny_hf_model(tmp_path, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(tmp_path)
    generate = subprocess.run([sys.executable, "-m", "loramux.cli", "generate", "--model", str(tmp_path),
                               "--max-tokens", "2", "Hello"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=env_without_safe_path())
    assert generate.returncode == 0, generate.stderr
    assert generate.stdout.strip(), generate.stderr


def test_kernels_resolves_to_hugging_face_even_with_the_repo_root_on_sys_path():
    code = ("import sys, transformers.activations, kernels; "
            "assert sys.path[0] == '', sys.path[0]; print(kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=env_without_safe_path())
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve().is_relative_to(SITE), out.stdout


def test_without_hugging_faces_kernels_the_import_fails_as_if_the_folder_were_not_there():
    # -S: no site-packages, so the only `kernels` on sys.path is this repo's folder.
    code = ("import sys\n"
            "try:\n    import kernels\nexcept ModuleNotFoundError as e:\n"
            "    print(e.name, 'kernels' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=env_without_safe_path())
    assert out.returncode == 0 and out.stdout.split() == ["kernels", "False"], (out.stdout, out.stderr)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P is Python 3.11+")
def test_children_started_with_python_command_leave_the_working_directory_off_sys_path():
    code = "import os, sys; print([p for p in sys.path if os.path.realpath(p or os.curdir) == os.getcwd()])"
    out = subprocess.run(python_command("-c", code), cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=env_without_safe_path())
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


PROBE = f'''
import os
import sys
from pathlib import Path

ROOT = Path({str(ROOT)!r})


def test_the_runner_leaves_the_repo_root_off_sys_path_and_imports_hugging_faces_kernels():
    assert [p for p in sys.path if Path(os.path.realpath(p or os.curdir)) == ROOT] == []
    import transformers.activations  # noqa: F401 - imports `kernels`
    import kernels

    found = Path(kernels.__file__).resolve()
    assert found.parent != ROOT / "kernels" and found.is_relative_to(Path({str(SITE)!r})), found
'''


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_pytest_started_as_make_test_does_imports_hugging_faces_kernels(tmp_path):
    # The command `make test` runs (printed by make -n, with this interpreter's venv), on one generated test.
    plan = subprocess.run(["make", "-n", "-C", str(ROOT), "test", f"VENV={sys.prefix}"], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    command = [line for line in plan.splitlines() if "pytest" in line][-1]
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    run = subprocess.run(f"{command} -p no:cacheprovider {shlex.quote(str(probe))}", shell=True, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env_without_safe_path())
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
