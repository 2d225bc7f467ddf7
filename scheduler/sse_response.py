"""The server's streaming response (server-sent events): whatever ends it (its last event, a client gone away, the
server stopping), its generator is closed, its requests aborted and its generation slot freed."""
from __future__ import annotations

import asyncio

import anyio
from fastapi.responses import StreamingResponse

from scheduler.choices import Choices


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator, aborts its requests and frees its slot,
    whether it ended, the client went away (starlette cancels the send) or the server stopped."""

    def __init__(self, content, choices: Choices, slot, **kw) -> None:  # slot: server._Slot
        super().__init__(content, **kw)
        self._choices, self._slot = choices, slot

    async def __call__(self, scope, receive, send) -> None:
        async def receive_watching():
            # Starlette stops the stream on a disconnect by cancelling it, which never lands while
            # a token arrives every loop turn (a CPU forward): abort the requests, and the stream ends
            message = await receive()
            if message["type"] == "http.disconnect":
                await self._choices.abort()
            return message

        async def watch() -> None:
            while (await receive_watching())["type"] != "http.disconnect":
                pass

        # from ASGI 2.4 Starlette listens for no disconnect (a write to a gone client raises): a
        # stream still waiting for its first token would run on until it wrote one (regression)
        spec = tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))
        watcher = asyncio.ensure_future(watch()) if spec >= (2, 4) else None
        try:
            await super().__call__(scope, receive_watching, send)
        finally:
            if watcher is not None:
                watcher.cancel()
            try:
                with anyio.CancelScope(shield=True):
                    try:
                        await self.body_iterator.aclose()
                    finally:
                        await self._choices.close()
            finally:
                self._slot.release()
