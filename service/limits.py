"""The ASGI middleware limiting request bodies (size, JSON content type, time to arrive) before any route reads them."""

from __future__ import annotations

import asyncio

from service.errors import problem
from service.tracing import CLIENT


class BodyLimitMiddleware:
    """Refuse bodies over ``max_body_bytes`` (413) and bodies that are not declared JSON (415), as problem+json.

    A body without a ``Content-Type`` is refused with 415 too (it would otherwise reach validation
    as a confusing 422).

    The size check reads the declared Content-Length and also counts the bytes of a chunked body as
    they arrive, so an undeclared body cannot exceed the limit either. A body that has not arrived whole
    ``body_timeout_s`` seconds after the request started (a slow sender, or fewer bytes than its
    Content-Length) is answered 408 and the connection's reading ends.

    Every HTTP request runs with :data:`service.tracing.CLIENT` set to the peer's address, the client whose
    share of the trace queue a never-seen configuration takes (:class:`service.tracing.BackgroundTracer`).
    """

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            CLIENT.set((scope.get("client") or ("unknown",))[0])
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await problem(413, f"body must be at most {self.max_body_bytes} bytes")(scope, receive, send)
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        has_body = length not in (None, "0") or "chunked" in headers.get("transfer-encoding", "")
        if (ctype or has_body) and ctype != "application/json" and not ctype.endswith("+json"):
            got = repr(ctype) if ctype else "no content-type"
            return await problem(415, f"content-type must be application/json, got {got}")(scope, receive, send)
        seen = 0
        limit = self.max_body_bytes
        responded = False
        timeout_s = self.body_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        body_done = False

        async def guarded_receive():
            nonlocal seen, responded, body_done
            if responded:
                return {"type": "http.disconnect"}
            if body_done:  # after the body: waiting for a disconnect is not bounded here
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                responded = True
                await problem(
                    408,
                    f"body: not received whole within {timeout_s:g} s (allowed: the whole body, "
                    f"as long as its Content-Length says, within {timeout_s:g} s; "
                    "MEMFIT_BODY_TIMEOUT_S)",
                    headers={"Connection": "close"},
                )(scope, receive, send)
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                seen += len(message.get("body", b""))
                if seen > limit and not responded:
                    # answer now and tell the app the client went away: it stops reading, and
                    # whatever it tries to send afterwards is dropped below
                    responded = True
                    await problem(413, f"body must be at most {limit} bytes")(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not responded:
                await send(message)

        await self.app(scope, guarded_receive, guarded_send)
