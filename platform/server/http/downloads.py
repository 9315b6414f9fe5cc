"""Files streamed to the client from a worker thread, read as the client takes the chunks."""
from __future__ import annotations

from collections.abc import Iterator

from fastapi.concurrency import iterate_in_threadpool
from fastapi.responses import StreamingResponse


def download_response(chunks: Iterator[bytes], filename: str, media_type: str) -> StreamingResponse:
    """`chunks` (a blocking iterator, e.g. database reads) streamed as the attachment `filename`."""
    return StreamingResponse(iterate_in_threadpool(chunks), media_type=media_type,
                             headers={"Content-Disposition": f'attachment; filename="{filename}"'})
