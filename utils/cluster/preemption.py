"""SIGTERM (preemption, eviction) and SIGINT (Ctrl-C): checkpoint, then exit 143 (130) on every rank.

Outside training the signal raises `Preempted` at once: the last checkpoint holds all worth saving. In training
the handler only records it; after every optimizer step all ranks agree (one all-reduce) whether any was asked to
stop, and then all checkpoint at that step and stop, so a replica signalled alone takes its peers with it.
Not transformers' `enable_jit_checkpoint`: it decides per rank and returns from `train()` as if finished, so a
half-trained model would be published. Imports nothing heavy: main.py installs the handler before torch.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from utils.common.errors import Preempted

log = logging.getLogger(__name__)

# Seconds a rank has to leave after a stop signal before it is ended with the same code (one in native code never
# runs the handler): in training, time for the agreed checkpoint; both inside Kubernetes' 30 s grace period.
STOP_GRACE = {False: 3.0, True: 20.0}
SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT (Ctrl-C)"}


class Preemption:
    """The stop-signal handler's state: which signal asked to stop, and whether the training loop acts on it."""

    def __init__(self) -> None:
        self.signum = 0  # 0: no stop asked; else SIGTERM (15) or SIGINT (2)
        self._deferred = False
        self._lock = threading.Lock()

    def install(self) -> None:
        for signum in SIGNALS:
            signal.signal(signum, self._on_signal)
        # Python handlers run only between the main thread's bytecodes: the C-level handler writes the wake-up
        # socket at once, and a watcher ends the process if the main thread does not leave within the grace.
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)
        threading.Thread(target=self._watch, args=(reader,), daemon=True, name="stop-signal-watcher").start()

    def _on_signal(self, signum, frame) -> None:
        with self._lock:
            self.signum = max(self.signum, signum)
        if not self._deferred:
            raise Preempted(
                f"{SIGNALS[signum]} received outside the training loop; a restart continues from what is on the volume (checkpoints, model/)",
                code=128 + signum,
            )

    def _watch(self, reader: socket.socket) -> None:
        while True:
            signum = max((byte for byte in reader.recv(16) if byte in SIGNALS), default=0)
            if not signum:
                continue
            grace = STOP_GRACE[self._deferred]
            threading.Event().wait(grace)
            # Still here: the main thread is stuck where the handler cannot run. Leave as it would have.
            sys.stderr.write(
                f"preempted: {SIGNALS[signum]} and no exit within {grace:.0f} s (waiting in native code); exit {128 + signum}\n"
            )
            sys.stderr.flush()
            os._exit(128 + signum)

    def follow(self, signum: int) -> None:
        """Take the stop all ranks agreed on as this rank's own (the peer's code). No lock: the handler runs on this
        same thread, and would wait for ever for a lock held here."""
        self.signum = max(self.signum, signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """While inside, a stop signal only records itself; the training loop checkpoints and stops."""
        self._deferred = True
        try:
            if self.signum:  # signalled before the loop started: stop at the first step boundary
                log.warning("%s arrived before training started; stopping after the first step", SIGNALS[self.signum])
            yield
        finally:
            self._deferred = False
