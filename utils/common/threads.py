"""The job's background threads: a call given a deadline (`within`), watchdogs over the main thread, a heartbeat.
Daemon threads, so one stuck in a call that never returns never holds the process's exit. Standard library only.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class Deadline(TimeoutError):
    """A call did not return within its deadline; it was left running in its thread, to end with the process."""


def in_background(call: Callable[[], object], name: str) -> threading.Event:
    """Set once `call()`, run in a daemon thread, has returned or raised."""
    ended = threading.Event()

    def target() -> None:
        try:
            call()
        finally:
            ended.set()

    threading.Thread(target=target, daemon=True, name=name).start()
    return ended


def within(seconds: float, call: Callable[[], T], name: str = "deadline") -> T:
    """`call()`'s result (or exception), or Deadline after `seconds`: for library calls that can wait for ever."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # raised in the caller's thread
            box["error"] = exc

    if not in_background(target, name).wait(max(0.0, seconds)):
        raise Deadline(f"no answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def end_process(message: str, code: int) -> None:
    """Say `message` on stderr and end the process with `code` at once, from any thread."""
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()
    os._exit(code)


@contextmanager
def watchdog(seconds: float, message: str, code: int) -> Iterator[None]:
    """End the process with `code` and `error: message` if the block has not finished after `seconds`: torch's
    store calls to a stopped rank 0 wait in native code past their own timeouts (seen: 100 s on a 20 s one)."""
    done = threading.Event()

    def expire() -> None:
        if not done.wait(seconds):
            end_process(f"error: {message}", code)

    in_background(expire, "watchdog")
    try:
        yield
    finally:
        done.set()


@contextmanager
def ended_when(condition: Callable[[], bool], message: str, code: int, every: float = 2.0) -> Iterator[None]:
    """End the process with `code` (saying `message`) as soon as `condition()` holds, checked every `every` seconds
    while the block runs: a native wait that another process's outcome makes pointless."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(every):
            try:
                met = condition()
            except OSError:  # a volume that does not answer now may later; the block's own bound still holds
                continue
            if met:
                end_process(message, code)

    in_background(watch, "ended-when")
    try:
        yield
    finally:
        done.set()


class Heartbeat:
    """`beat()` every `seconds` until `stop`; `beat` handles its own failures: a missed beat must not end the job."""

    def __init__(self, beat: Callable[[], None], seconds: float, name: str):
        self._stopping = threading.Event()

        def beating() -> None:
            while not self._stopping.wait(seconds):
                beat()

        self._stopped = in_background(beating, name)

    def stop(self, wait: float) -> None:
        """Stop, and wait up to `wait` seconds for a beat in flight: one in a native call at shutdown is SIGABRT."""
        self._stopping.set()
        self._stopped.wait(wait)
