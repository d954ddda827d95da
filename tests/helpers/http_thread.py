"""A stdlib HTTP server answering on loopback from a thread of its own, for tests."""

from __future__ import annotations

import contextlib
import socketserver
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def in_thread(server: socketserver.BaseServer) -> Iterator[int]:
    """Serves `server` until the block ends, then shuts it down and closes its socket; yields
    the port it listens on."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
