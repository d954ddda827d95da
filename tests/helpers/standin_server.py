"""The stand-in model server on loopback, on an event loop of its own thread, for tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

from labkit.models import modelserver


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(
    settings: modelserver.Settings, hold: list[int] = (), *, loaded: bool = True
) -> Iterator[tuple[int, modelserver.ModelServer]]:
    """Yields (API port, server) while the stand-in answers on 127.0.0.1, and `hold` ports
    only accept. With `loaded` (and no load delay) it yields once the API port accepts; without,
    at once (the port opens when the stand-in has loaded, or never)."""
    port = free_port()
    loop = asyncio.new_event_loop()
    instance = modelserver.ModelServer(settings)
    loop.run_until_complete(instance.start("127.0.0.1", port, list(hold)))
    if loaded and not settings.load_delay and not modelserver.never_healthy(settings.image):
        loop.run_until_complete(asyncio.wait_for(instance.api_open.wait(), timeout=10))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port, instance
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        # Let open connections' handlers finish on a live loop before closing it.
        for listener in instance.servers:
            listener.close()
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()

        async def drain() -> None:
            # gather() inside the loop's own coroutine: called outside, it binds to whatever
            # loop is current in this thread (another test's, when the suite runs together).
            await asyncio.gather(*pending, return_exceptions=True)

        loop.run_until_complete(drain())
        loop.close()
