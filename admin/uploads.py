"""Uploads over HTTP (adapters, Medusa heads): multipart bodies capped before they are buffered, parts spooled
to a temporary directory that is always removed, client file names checked, never trusted."""
from __future__ import annotations

import shutil
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Request
from starlette.datastructures import UploadFile

from loramux.adapters.formats.medusa import MEDUSA_CONFIG, MEDUSA_WEIGHTS
from loramux.adapters.formats.validation import ALLOWED_FILENAMES
from loramux.services.adapters import UploadError

CONFIG_FIELD, WEIGHTS_FIELD = "adapter_config", "adapter_model"
FIELD_NAMES = {CONFIG_FIELD: ALLOWED_FILENAMES[0], WEIGHTS_FIELD: ALLOWED_FILENAMES[1]}
ADAPTER_HINT = ("the adapter", "the fields tenant_id, name, adapter_config (adapter_config.json) and adapter_model "
                "(adapter_model.safetensors)")
MEDUSA_FIELD_NAMES = {"medusa_config": MEDUSA_CONFIG, "medusa_heads": MEDUSA_WEIGHTS}
MEDUSA_HINT = ("Medusa heads", "the files medusa_config (medusa_config.json) and medusa_heads "
               "(medusa_heads.safetensors), and optionally the fields tenant_id, adapter and version")
_SUSPICIOUS = ("/", "\\", "..", "\x00")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


@asynccontextmanager
async def receive_upload(request: Request, max_body_bytes: int, file_fields: dict[str, str] = FIELD_NAMES,
                         hint: tuple[str, str] = ADAPTER_HINT):
    """Yield (fields, files) of a multipart upload: `files` maps the file name to validate (the canonical one
    `file_fields` gives its form field, or the client's when it is suspicious, so validation refuses it by
    name) to a temp path. `hint`: (what is uploaded, the fields it takes), for the 415 answer."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise UploadError(413, f"the upload is {int(declared)} bytes; this server accepts at most {max_body_bytes}")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise UploadError(415, f"send {hint[0]} as multipart/form-data with {hint[1]}")
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
                if key not in file_fields:
                    raise UploadError(400, f"unexpected file field {key[:64]!r}: send {' and '.join(file_fields)}")
                if key in {f for f, _ in files.values()}:
                    raise UploadError(400, f"file field {key!r} given twice")
                client_name = value.filename or file_fields[key]
                bad = any(s in client_name for s in _SUSPICIOUS) or client_name.lower().endswith(_PICKLE_SUFFIXES)
                name = client_name if bad else file_fields[key]
                path = tmp / f"part-{len(files)}"
                with open(path, "wb") as out:
                    shutil.copyfileobj(value.file, out, 1 << 20)
                files[name] = (key, path)
            else:
                fields[key] = value
        for key in file_fields:
            if key not in {f for f, _ in files.values()}:
                raise UploadError(400, f"missing file field {key!r} ({file_fields[key]})")
        yield fields, {name: path for name, (_, path) in files.items()}
    finally:
        if form is not None:
            await form.close()
        shutil.rmtree(tmp, ignore_errors=True)
