"""The size limit of a request's body, as ASGI middleware around make serve's application: a body declared
(Content-Length) or found (counted as its chunks arrive, for a body sent with Transfer-Encoding: chunked) to be
larger than the limit is refused before the application reads any of it, so no request holds more than the limit
in memory. A body within it is handed on whole, as one message."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]
# the refusal, an ASGI application of its own (a Starlette Response) made from its one-line message
Refusal = Callable[[str], ASGIApp]


class BodyLimit:
    """``app`` with request bodies of at most ``max_bytes``; a larger one is answered by ``refuse(message)``."""

    def __init__(self, app: ASGIApp, max_bytes: int, refuse: Refusal, hint: str) -> None:
        self.app, self.max_bytes, self.refuse, self.hint = app, max_bytes, refuse, hint

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self.refuse(f"a body of {int(declared)} bytes; {self.hint}")(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":  # the client went away: nobody to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self.refuse(f"a body of more than {self.max_bytes} bytes (sent in chunks); {self.hint}")(
                    scope, receive, send
                )
                return
            if not message.get("more_body", False):
                break
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal whole
            if whole is None:  # after the body: what the server says next (a disconnect)
                return await receive()
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)
