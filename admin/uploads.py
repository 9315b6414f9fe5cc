"""Adapter uploads over HTTP: multipart bodies capped before they are buffered, parts spooled to a
temporary directory that is always removed, client file names checked, never trusted."""
from __future__ import annotations

import shutil
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Request
from starlette.datastructures import UploadFile

from loramux.adapters.validation import ALLOWED_FILENAMES
from loramux.services.adapters import UploadError

CONFIG_FIELD, WEIGHTS_FIELD = "adapter_config", "adapter_model"
FIELD_NAMES = {CONFIG_FIELD: ALLOWED_FILENAMES[0], WEIGHTS_FIELD: ALLOWED_FILENAMES[1]}
_SUSPICIOUS = ("/", "\\", "..", "\x00")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


@asynccontextmanager
async def receive_upload(request: Request, max_body_bytes: int):
    """Yield (fields, files) of a multipart adapter upload: `files` maps the file name to validate (the
    canonical one, or the client's when it is suspicious, so validation refuses it by name) to a temp path."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise UploadError(413, f"the upload is {int(declared)} bytes; this server accepts at most {max_body_bytes}")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise UploadError(415, "send the adapter as multipart/form-data with the fields tenant_id, name, "
                               "adapter_config (adapter_config.json) and adapter_model (adapter_model.safetensors)")
    received = 0
    upstream = request.receive

    async def capped_receive():
        nonlocal received
        message = await upstream()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_body_bytes:  # a chunked body without (or lying about) its length
                raise UploadError(413, f"the upload is larger than this server's limit of {max_body_bytes} bytes")
        return message

    limited = Request(request.scope, capped_receive)
    tmp = Path(tempfile.mkdtemp(prefix="loramux-upload-"))
    form = None
    try:
        try:
            form = await limited.form(max_files=4, max_fields=16)
        except UploadError:
            raise
        except Exception as exc:  # noqa: BLE001 - the parser's errors (malformed multipart, too many parts) are 400s
            raise UploadError(400, f"could not read the multipart body: {exc}") from None
        fields, files = {}, {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key not in FIELD_NAMES:
                    raise UploadError(400, f"unexpected file field {key!r}: send adapter_config and adapter_model")
                if key in {f for f, _ in files.values()}:
                    raise UploadError(400, f"file field {key!r} given twice")
                client_name = value.filename or FIELD_NAMES[key]
                bad = any(s in client_name for s in _SUSPICIOUS) or client_name.lower().endswith(_PICKLE_SUFFIXES)
                name = client_name if bad else FIELD_NAMES[key]
                path = tmp / f"part-{len(files)}"
                with open(path, "wb") as out:
                    shutil.copyfileobj(value.file, out, 1 << 20)
                files[name] = (key, path)
            else:
                fields[key] = value
        for key in FIELD_NAMES:
            if key not in {f for f, _ in files.values()}:
                raise UploadError(400, f"missing file field {key!r} ({FIELD_NAMES[key]})")
        yield fields, {name: path for name, (_, path) in files.items()}
    finally:
        if form is not None:
            await form.close()
        shutil.rmtree(tmp, ignore_errors=True)
