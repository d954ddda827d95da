"""What the lab's loopback and namespace rehearsals (routing, router hop, P/D) do to the servers they
start on this machine: read a page, ask a status, end a process group. One home, so a timeout or a
"no answer" means the same everywhere."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import urllib.error
import urllib.request

NO_ANSWER = 0  # http_status's value for a refused, reset or timed-out connection


def http_get(url: str, timeout: float = 10) -> str:
    """A page's body (raises on an HTTP error or no answer)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def http_status(url: str, timeout: float = 2) -> int:
    """The HTTP status `url` answers with, an error status included; NO_ANSWER when none comes."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return NO_ANSWER


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process group a `start_new_session=True` process leads, then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)
