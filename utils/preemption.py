"""SIGTERM (preemption, pod eviction, `docker stop`): checkpoint, then exit 143 on every rank.

The orchestrator sends SIGTERM to one replica or to all of them, and SIGKILLs after a grace period
(30 s by default on Kubernetes). What the job does with it depends on where it is:

- before training and after it (data, model, evaluation, upload), there is nothing worth saving that
  the last checkpoint does not hold: the signal raises `Preempted` at once;
- during training, the handler only records the request. At the end of every optimizer step all
  ranks agree (one all-reduce of a flag) whether any of them was asked to stop; if so they all save
  a checkpoint at that same step, stop, and raise `Preempted`. A replica signalled alone thus takes
  its peers with it at a step boundary, instead of leaving them in a collective with a dead peer.

transformers' `enable_jit_checkpoint` was not used: it decides per rank (one signalled rank saves alone
while its peers wait in the next all-reduce), waits 3 s before acting, and returns from `train()` as
if training had finished, so the run would go on to publish a half-trained model.

This module imports nothing heavy: main.py installs the handler before torch is imported (a container's
PID 1 ignores SIGTERM unless a handler is installed).
"""

from __future__ import annotations

import logging
import signal
from contextlib import contextmanager
from typing import Iterator

from utils.errors import Preempted

log = logging.getLogger(__name__)


class Preemption:
    """The SIGTERM handler's state: asked to stop, and whether the training loop will act on it itself."""

    def __init__(self) -> None:
        self.requested = False
        self._deferred = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True
        if not self._deferred:
            raise Preempted("SIGTERM received outside the training loop; a restart continues from what is on the volume (checkpoints, model/)")

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """While inside, SIGTERM only sets `requested`; the training loop checkpoints and stops."""
        self._deferred = True
        try:
            if self.requested:  # signalled before the loop started: stop at the first step boundary
                log.warning("SIGTERM arrived before training started; stopping after the first step")
            yield
        finally:
            self._deferred = False


PREEMPTION = Preemption()


def stop_on_preemption_callback(any_rank):
    """A TrainerCallback that saves and stops at the first step where any rank got SIGTERM.

    `any_rank(flag) -> bool` is the all-reduce (utils.distributed.any_rank) that makes every rank take
    the same decision at the same step. transformers is imported here, not at the top: main.py imports
    this module before the heavy imports.
    """
    from transformers import TrainerCallback

    class StopOnPreemption(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if any_rank(PREEMPTION.requested):
                log.warning("SIGTERM: saving a checkpoint at step %d and stopping", state.global_step)
                control.should_save = True
                control.should_training_stop = True

    return StopOnPreemption()
