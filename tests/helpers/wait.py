"""Waiting for a condition in a test, instead of sleeping for a guessed time: poll until it
holds, bounded, and fail naming what did not happen and the last thing seen."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition a test waited for did not hold in time (an AssertionError: a test failure)."""


def wait_until(
    probe: Callable[[], T],
    *,
    what: str,
    timeout: float,
    interval: float = 0.05,
    done: Callable[[T], bool] = bool,
) -> T:
    """Call `probe` every `interval` seconds until `done` accepts its answer (by default: until
    the answer is truthy), and return that answer. Raises WaitTimeout naming `what` and the
    last answer when `timeout` seconds pass first. `probe` runs at least once, and once more at
    the deadline, so a slow probe cannot make the wait give up without a last look."""
    deadline = time.monotonic() + timeout
    while True:
        answer = probe()
        if done(answer):
            return answer
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WaitTimeout(f"{what}: not within {timeout:g} s (last seen: {answer!r})")
        time.sleep(min(interval, remaining))
