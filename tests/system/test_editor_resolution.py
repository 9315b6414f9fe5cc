"""Editors and type checkers resolve `loramux` to the sources: the development install (setuptools' strict
editable mode, `make install`) is a tree of links that pyright, the engine of VS Code's Pylance, follows.
The default editable mode's import hook is invisible to it ("could not be resolved")."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[2]
LANGSERVER = Path(sys.executable).parent / "basedpyright-langserver"
PROBE = """\
from loramux.engine.engine import LLMEngine
from loramux.adapters.storage.registry import AdapterRegistry
"""


class LanguageServer:
    """basedpyright's language server over stdio, driven as an editor would (only what the test needs)."""

    def __init__(self, workspace: Path):
        self.process = subprocess.Popen([str(LANGSERVER), "--stdio"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        # A server that never answers ends the test with a failure, not a hang.
        self.watchdog = threading.Timer(120, self.process.kill)
        self.watchdog.start()
        self.next_id = 0
        self.request("initialize", {
            "processId": None, "rootUri": workspace.as_uri(),
            "workspaceFolders": [{"uri": workspace.as_uri(), "name": "probe"}],
            "capabilities": {"workspace": {"configuration": True, "workspaceFolders": True}},
        })
        self.notify("initialized", {})

    def _send(self, message: dict) -> None:
        body = json.dumps({"jsonrpc": "2.0", **message}).encode()
        self.process.stdin.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.process.stdin.flush()

    def _receive(self) -> dict:
        length = None
        while line := self.process.stdout.readline().strip():
            name, _, value = line.decode().partition(": ")
            if name == "Content-Length":
                length = int(value)
        assert length is not None, "the language server stopped answering"
        return json.loads(self.process.stdout.read(length))

    def notify(self, method: str, params: dict) -> None:
        self._send({"method": method, "params": params})

    def request(self, method: str, params: dict | None):
        self.next_id += 1
        self._send({"id": self.next_id, "method": method, "params": params})
        while True:
            message = self._receive()
            if "method" not in message and message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]
            if "method" in message and "id" in message:  # the server asks: answer as an editor would
                self._send({"id": message["id"], "result": self._answer(message)})

    @staticmethod
    def _answer(message: dict):
        if message["method"] != "workspace/configuration":
            return None
        # As VS Code does: the interpreter the user picked, here the one running the tests (.venv).
        return [{"pythonPath": sys.executable} if item.get("section") == "python" else {}
                for item in message["params"]["items"]]

    def close(self) -> None:
        try:
            self.request("shutdown", None)
            self.notify("exit", {})
            self.process.wait(30)
        finally:
            self.watchdog.cancel()
            self.process.kill()


def test_pyright_resolves_loramux_to_the_source_files(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    server = LanguageServer(tmp_path)
    try:
        server.notify("textDocument/didOpen", {"textDocument": {
            "uri": probe.as_uri(), "languageId": "python", "version": 1, "text": PROBE}})
        found = {}
        for line_number, line in enumerate(PROBE.splitlines()):
            name = line.rsplit(" ", 1)[1]
            definitions = server.request("textDocument/definition", {
                "textDocument": {"uri": probe.as_uri()},
                "position": {"line": line_number, "character": line.rindex(name) + 1}})
            assert definitions, f"pyright cannot resolve {line!r}"
            (definition,) = definitions
            path = Path(unquote(urlparse(definition["uri"]).path))
            start = definition["range"]["start"]["line"]
            assert path.read_text().splitlines()[start].startswith(f"class {name}"), (path, start)
            # The link tree's file is a link to the source, so a jump to the definition edits the source.
            found[name] = path.resolve().relative_to(ROOT).as_posix()
    finally:
        server.close()
    assert found == {"LLMEngine": "platform/engine/engine.py", "AdapterRegistry": "adapters/storage/registry.py"}
