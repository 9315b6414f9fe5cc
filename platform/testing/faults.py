"""A TCP proxy that injects network faults between a client (boto3) and a real server (moto).

Modes: "pass" forwards bytes both ways; "blackhole" accepts connections and never answers (a server
slower than any timeout); "refuse" closes each connection at once (an unreachable service). Switching
mode affects new connections; `close_all()` also drops the open ones (boto3 keeps connections alive).
"""
from __future__ import annotations

import socket
import threading


class FaultyProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.mode = "pass"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "blackhole", "refuse")
        self.mode = mode
        self.close_all()

    def close_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.close_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "refuse":
                client.close()
                continue
            with self._lock:
                self._conns.append(client)
            if self.mode == "blackhole":
                continue  # held open, never answered, until close_all()
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.append(upstream)
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
