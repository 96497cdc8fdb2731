"""Request bodies sent with `Content-Encoding: gzip`, inflated before the routes see them.

Ranks gzip large batches (chunk snapshots of big models compress about tenfold), which matters
once many nodes send to one dashboard over a network. The compressed bytes count against the
body limit as they arrive (the framework's limit, outside this middleware); the inflated body is
held to the same limit here, so a small "zip bomb" gets 413, not the server's memory.
"""

from __future__ import annotations

import zlib

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class GzipRequestBody:
    """ASGI middleware: inflate gzip request bodies, refuse other encodings (415).

    Args:
        app: the application.
        max_body_bytes: largest inflated body accepted (413 beyond).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding == b"identity":
            await self.app(scope, receive, send)
            return
        if encoding != b"gzip":
            response = JSONResponse(
                {
                    "detail": f"Content-Encoding {encoding.decode(errors='replace')!r} is not "
                    "supported: send gzip or nothing"
                },
                status_code=415,
            )
            await response(scope, receive, send)
            return
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        parts: list[bytes] = []
        size = 0
        more = True
        error: tuple[int, str] | None = None
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            more = message.get("more_body", False)
            if error is not None:
                continue  # read the rest, so the answer is not lost in a reset
            try:
                part = inflater.decompress(message.get("body", b""), self.max_body_bytes + 1 - size)
            except zlib.error as failure:
                error = (400, f"the gzip body is corrupt: {failure}")
                continue
            size += len(part)
            parts.append(part)
            if size > self.max_body_bytes or inflater.unconsumed_tail:
                error = (413, f"the inflated body is over the limit of {self.max_body_bytes} bytes")
        if error is None and not inflater.eof:
            error = (400, "the gzip body is truncated")
        if error is not None:
            await JSONResponse({"detail": error[1]}, status_code=error[0])(scope, receive, send)
            return
        body = b"".join(parts)
        scope = dict(scope)
        scope["headers"] = [
            (name, value)
            for name, value in scope["headers"]
            if name not in (b"content-encoding", b"content-length")
        ] + [(b"content-length", str(len(body)).encode())]
        delivered = False

        async def inflated() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, inflated, send)
