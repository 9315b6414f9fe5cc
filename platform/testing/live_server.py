"""A real uvicorn server on 127.0.0.1 in a background thread, for tests and benches that talk HTTP like a client."""
from __future__ import annotations

import threading

from loramux.testing.ports import free_port


class LiveServer:
    """`with LiveServer(app) as server:` serves `app` (its lifespan included) at `server.url` until the block
    ends; `server.services` is the app's Services once the lifespan has built them."""

    def __init__(self, app):
        import uvicorn

        port = free_port()
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
            raise RuntimeError("the server did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    @property
    def services(self):
        return self.app.state.services
