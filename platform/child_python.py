"""The command line that starts this interpreter in a child process (workers, the CLI in tests)."""
from __future__ import annotations

import sys

# -P keeps the child's working directory off its sys.path. Started in a checkout of this repo (`make serve`,
# the tests), that directory's kernels/ folder would be found as `kernels`, the name of a transformers
# dependency; kernels/__init__.py hands such an import over, but a child should not depend on that. Python 3.10
# has no -P, and no transformers release that needs `kernels`.
SAFE_PATH: tuple[str, ...] = ("-P",) if sys.version_info >= (3, 11) else ()


def python_command(*args: str) -> list[str]:
    """[this interpreter, -P, *args], e.g. python_command("-m", "loramux.engine.structured.compile_worker")."""
    return [sys.executable, *SAFE_PATH, *args]
