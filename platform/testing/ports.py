"""Local TCP ports for test and bench servers."""
from __future__ import annotations

import socket
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago (the OS picks it; another process may
    still take it before the caller binds, as with any such helper)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    """Return once something accepts connections on 127.0.0.1:`port`; RuntimeError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)  # polling a real condition: the server accepting connections
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")
