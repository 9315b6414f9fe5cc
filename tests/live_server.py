"""A real uvicorn server on 127.0.0.1 in a background thread, for tests that talk HTTP like a client."""
from __future__ import annotations

import socket
import threading


class LiveServer:
    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.app = app
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                     lifespan="on", timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        ready = threading.Event()

        def poll():  # uvicorn sets `started` once the socket listens and the lifespan has run
            while not self._server.started and self._thread.is_alive():
                ready.wait(0.02)
            ready.set()

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        poller.join(timeout=120)
        if not self._server.started:
            raise RuntimeError("the test server did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    @property
    def services(self):
        return self.app.state.services
