"""SIGTERM (preemption, pod eviction, `docker stop`) and SIGINT (Ctrl-C): checkpoint, then exit 143 (130) on every rank.

The orchestrator sends SIGTERM to one replica or to all of them, then SIGKILL after a grace period:

- before training and after it (data, model, evaluation, upload), there is nothing worth saving that
  the last checkpoint does not hold: the signal raises `Preempted` at once;
- during training, the handler only records the request. At the end of every optimizer step all
  ranks agree (one all-reduce of a flag) whether any of them was asked to stop; if so they all save
  a checkpoint at that same step, stop, and raise `Preempted`. A replica signalled alone thus takes
  its peers with it at a step boundary, instead of leaving them in a collective with a dead peer.

transformers' `enable_jit_checkpoint` was not used: it decides per rank (one signalled rank saves alone
while its peers wait in the next all-reduce), waits 3 s before acting, and returns from `train()` as
if training had finished, so the run would go on to publish a half-trained model.

main.py installs the handler before torch is imported (a container's PID 1 ignores SIGTERM unless a handler is
installed), so this module imports nothing heavy.
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

# After a stop signal, the seconds a rank has to leave on its own before it is ended with the same code:
# a rank waiting in native code (a store or gloo wait, the Rust tokenizer) never runs the Python handler.
# Outside training there is nothing to save, so little; in training, time for the agreed checkpoint.
# Both well inside Kubernetes' default 30 s grace period before SIGKILL.
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
        # Python runs signal handlers only between bytecodes of the main thread. The wake-up socket gets
        # a byte from the C-level handler at once, and a watcher thread ends the process if the main
        # thread does not leave within the grace period.
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
        """Take the stop all ranks agreed on as this rank's own: a rank stopped by its peer leaves with the peer's code.
        No lock: the handler takes it on this same (main) thread, and would wait for ever for a lock held here."""
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
