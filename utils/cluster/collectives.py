"""The job's process group: `rendezvous` meets the other ranks, compares their settings and returns a `Collectives`
(a single process's has no group), which lives until `leave`. Why not torch.distributed's or Accelerate's own:
docs/development.md.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as td

from utils.common.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, BadInput, JobError, Preempted
from utils.common.threads import Heartbeat, ended_when, watchdog
from utils.config.distributed import DistEnv
from utils.config.identity import agreement_refusal

T = TypeVar("T")

AGREEMENT_KEY = "job/agree/{rank}"
VERDICT_KEY = "job/verdict"
READ_KEY = "job/verdict-read"  # how many ranks have read the verdict
READ_SECONDS = 5.0  # rank 0, holding the store, stays this long at most for its peers to read its last word
BEAT_KEY = "job/beat/{rank}"
BEAT_SECONDS = 1.0  # each rank bumps its counter in the store this often while it is in the job
BEAT_CALL_SECONDS = 5.0  # the most one beat waits on a store that does not answer (rank 0 stopped)
PROBE_SECONDS = 3.0  # a peer whose counter did not move for this long has died or stopped
WATCHDOG_GRACE = 5  # seconds past RENDEZVOUS_TIMEOUT after which a rank stuck in native code is ended


class Collectives:
    """This process's share of the job's process group; every collective bounded by `timeout_s`."""

    def __init__(self, dist: DistEnv, timeout_s: int, beat_store=None, control=None, pulse=None):
        self.dist = dist
        self.timeout_s = timeout_s
        self._beat_store = beat_store  # a client of rank 0's store: the peers' heartbeats (None: no group)
        self._control = control  # the gloo group for small control messages on NCCL jobs (None: the default group)
        self._heartbeat = None  # beats through `pulse`, a client with a BEAT_CALL_SECONDS timeout
        if pulse is not None:
            self._heartbeat = Heartbeat(
                lambda: _beat(pulse, BEAT_KEY.format(rank=dist.rank)), BEAT_SECONDS, "heartbeat"
            )

    def leave(self) -> None:
        """Stop the heartbeat and drop the group locally (no collective), so rank 0 can merge and upload for as long
        as it needs; also on an error's way out: a heartbeat in a store call at shutdown makes the exit SIGABRT."""
        if self._heartbeat is not None:
            self._heartbeat.stop(wait=BEAT_CALL_SECONDS + BEAT_SECONDS)
        if td.is_available() and td.is_initialized():
            td.destroy_process_group()

    def _broadcast(self, value: object) -> object:
        box = [value]
        td.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """The block runs on rank 0 first (it fills the shared cache), then on the others. Unlike Accelerate's
        `main_process_first` (a barrier), a failure on rank 0 stops every rank at once with its code and message."""
        if not self.dist.is_distributed:
            yield
        elif self.dist.is_main:
            try:
                yield
            except (JobError, Preempted) as exc:
                self._broadcast((exc.code, exc.message))
                raise
            except BaseException as exc:
                self._broadcast((1, f"rank 0 failed: {type(exc).__name__}"))
                raise
            self._broadcast(None)
        else:
            if (outcome := self._broadcast(None)) is not None:
                raise JobError(*outcome)
            yield

    def run_on_main(self, step: Callable[[], T]) -> T | None:
        """`step` on rank 0 only, the others waiting for its outcome: its result on rank 0, None elsewhere."""
        with self.main_first():
            return step() if self.dist.is_main else None

    def decide_on_main(self, step: Callable[[], T]) -> T:
        """Run `step` on rank 0 only and give its result to every rank (a JobError on rank 0 stops all)."""
        result = self.run_on_main(step)
        return self._broadcast(result) if self.dist.is_distributed else result

    @contextmanager
    def agreed(self) -> Iterator[None]:
        """The block runs on every rank; if it fails with a JobError on any rank, all stop with the first one's."""
        if not self.dist.is_distributed:
            yield
            return
        outcome = None
        try:
            yield
        except JobError as exc:
            outcome = (exc.code, exc.message)
        outcomes: list = [None] * self.dist.world_size
        td.all_gather_object(outcomes, outcome)
        failed = [o for o in outcomes if o is not None]
        if failed:
            raise JobError(*failed[0])

    def max_over_ranks(self, value: int) -> int:
        """The largest of every rank's `value`, on every rank."""
        if not self.dist.is_distributed:
            return value
        tensor = torch.tensor([int(value)], dtype=torch.int32)
        td.all_reduce(tensor, op=td.ReduceOp.MAX, group=self._control)
        return int(tensor.item())

    def barrier(self) -> None:
        if self.dist.is_distributed:
            td.barrier(group=self._control)

    def is_lost_peer(self, exc: BaseException) -> bool:
        """Whether `exc` means a peer died, stopped answering or was cut off. gloo reports a lost peer as a plain
        RuntimeError, like a real crash, so the heartbeat decides those: a peer's beat that stood still for
        PROBE_SECONDS, or a store gone. Anything else is a crash, exit 1, which is rightly not restarted for ever."""
        if not self.dist.is_distributed:
            return False
        if isinstance(exc, (td.DistNetworkError, td.DistStoreError, TimeoutError)):
            return True
        if isinstance(exc, (torch.AcceleratorError, torch.OutOfMemoryError)) or not isinstance(exc, RuntimeError):
            return False
        try:
            keys = [BEAT_KEY.format(rank=r) for r in range(self.dist.world_size) if r != self.dist.rank]
            before = [self._beat_store.add(key, 0) for key in keys]
            time.sleep(PROBE_SECONDS)
            after = [self._beat_store.add(key, 0) for key in keys]
        except Exception:
            return True
        return any(a == b for a, b in zip(before, after, strict=True))

    @contextmanager
    def peers_watched(self, resume_hint: Callable[[], str]) -> Iterator[None]:
        """A failure caused by a lost peer as one error line and exit 143: as after SIGTERM, the cure is to restart
        every replica and resume (with exit 1, `restartPolicy: ExitCode` would end the job at the first lost node)."""
        try:
            yield
        except JobError:
            raise
        except Exception as exc:
            lost, replicas = f"rank {self.dist.rank} lost contact with", f"restart all {self.dist.world_size} replicas"
            # The probe asks rank 0's store, which, rank 0 stopped, never answers: past its timeout, in native code.
            silent = f"{lost} rank 0, whose store stopped answering; {replicas}"
            with watchdog(PROBE_SECONDS + BEAT_CALL_SECONDS + WATCHDOG_GRACE, silent, EXIT_PREEMPTED):
                if not self.is_lost_peer(exc):
                    raise
            raise JobError(
                EXIT_PREEMPTED,
                f"{lost} its peers ({type(exc).__name__}): a replica was killed, stopped or cut off, or did not answer "
                f"within RENDEZVOUS_TIMEOUT={self.timeout_s}s; {replicas}: {resume_hint()}",
            ) from None


def _beat(pulse, key: str) -> None:
    try:
        pulse.add(key, 1)
    except Exception:  # rank 0 gone or silent: the main thread finds out; a slow store gets the next beat
        pass


def rendezvous(
    dist: DistEnv,
    timeout_s: int,
    cuda: bool,
    agreement: dict,
    on_main: Callable[[], None] | None = None,
    finished: Callable[[], bool] | None = None,
) -> Collectives:
    """Meet the other ranks, check that they run the same job, and create the process group, all within
    RENDEZVOUS_TIMEOUT. Rank 0 compares every rank's `agreement`, runs `on_main` (the OUTPUT_DIR lock) and posts one
    verdict all follow: replicas with other settings all stop with exit 2 naming what differs. `finished`: whether
    the run ended without this rank (restarted as the others saved model/): it exits 0 then, not at the timeout.
    The group shares the store's timeout, which bounds every collective (ddp_timeout is ignored on gloo).
    """
    if not dist.is_distributed:
        if on_main is not None:
            on_main()
        return Collectives(dist, timeout_s)
    timeout = timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    stuck = (
        f"rank {dist.rank} could not meet its {dist.world_size - 1} peers at {dist.master_addr}:{dist.master_port} "
        f"within RENDEZVOUS_TIMEOUT={timeout_s}s; check that all {dist.world_size} replicas started with the same "
        "WORLD_SIZE and that MASTER_ADDR/MASTER_PORT point at rank 0"
    )
    outcome = nullcontext()
    if finished is not None and not dist.is_main:
        outcome = ended_when(finished, f"rank {dist.rank}: the run finished while this rank was away (exit 0)", 0)
    with watchdog(timeout_s + WATCHDOG_GRACE, stuck, 1), outcome:
        if not dist.is_main:
            _wait_for_rank0(dist, timeout_s, deadline)
        store = None
        try:
            store = td.TCPStore(
                dist.master_addr, dist.master_port, None, dist.is_main, timeout, wait_for_workers=False
            )
            beat_store = td.TCPStore(dist.master_addr, dist.master_port, None, False, timeout)
            pulse = td.TCPStore(dist.master_addr, dist.master_port, None, False, timedelta(seconds=BEAT_CALL_SECONDS))
            _agree(dist, store, agreement, timeout_s, deadline, on_main)
        except (td.DistError, RuntimeError) as exc:
            if dist.is_main and store is None:
                _refuse_port_taken(dist)
            raise JobError(1, f"{stuck} ({type(exc).__name__})") from None
        if cuda:
            torch.cuda.set_device(dist.local_rank)
        td.init_process_group(
            backend="nccl" if cuda else "gloo",
            store=store,
            rank=dist.rank,
            world_size=dist.world_size,
            timeout=timeout,
        )
        # Control messages (the stop flag, barriers) over gloo: on NCCL they would sync the GPU stream every step.
        control = td.new_group(backend="gloo", timeout=timeout) if td.get_backend() != "gloo" else None
    return Collectives(dist, timeout_s, beat_store, control, pulse)


def _agree(
    dist: DistEnv, store, agreement: dict, timeout_s: int, deadline: float, on_main: Callable[[], None] | None
) -> None:
    """Post this rank's `agreement` and follow rank 0's verdict: the same JobError on every rank, or none."""
    mine = json.dumps(agreement, sort_keys=True, default=str)
    store.set(AGREEMENT_KEY.format(rank=dist.rank), mine)
    if dist.is_main:
        # As the others see it, through JSON.
        verdict = _judge(dist, store, json.loads(mine), timeout_s, deadline, on_main)
        store.set(VERDICT_KEY, json.dumps(verdict))
        if verdict is not None:
            # The store lives in this process: the ranks that joined read the verdict before it closes.
            joined = sum(store.check([AGREEMENT_KEY.format(rank=rank)]) for rank in range(1, dist.world_size))
            read_by = time.monotonic() + READ_SECONDS
            try:
                while store.add(READ_KEY, 0) < joined and time.monotonic() < read_by:
                    time.sleep(0.05)
            except (td.DistError, RuntimeError):
                pass  # a peer gone meanwhile: nothing left to wait for
    else:
        store.wait([VERDICT_KEY], timedelta(seconds=max(1.0, deadline - time.monotonic())))
        verdict = json.loads(store.get(VERDICT_KEY))
        theirs = json.loads(store.get(AGREEMENT_KEY.format(rank=0)))
        store.add(READ_KEY, 1)
        # A rank that rank 0 did not wait for (it counts fewer ranks) compares for itself.
        if verdict is None and (refusal := agreement_refusal(theirs, {dist.rank: json.loads(mine)})):
            verdict = [EXIT_BAD_INPUT, refusal]
    if verdict is not None:
        raise JobError(*verdict)


def _judge(
    dist: DistEnv, store, agreement: dict, timeout_s: int, deadline: float, on_main: Callable[[], None] | None
) -> list | None:
    """Rank 0: every rank's agreement compared with its own, then `on_main`; None when all is well."""
    keys = [AGREEMENT_KEY.format(rank=rank) for rank in range(1, dist.world_size)]
    try:
        store.wait(keys, timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except td.DistError:
        missing = [rank for rank, key in enumerate(keys, start=1) if not store.check([key])]
        return [
            1,
            f"ranks {missing} did not join rank 0 at {dist.master_addr}:{dist.master_port} within RENDEZVOUS_TIMEOUT={timeout_s}s; "
            f"check that all {dist.world_size} replicas started and that MASTER_ADDR/MASTER_PORT point at rank 0",
        ]
    others = {rank: json.loads(store.get(key)) for rank, key in enumerate(keys, start=1)}
    if refusal := agreement_refusal(agreement, others):
        return [EXIT_BAD_INPUT, refusal]
    if on_main is not None:
        try:
            on_main()
        except JobError as exc:
            return [exc.code, exc.message]
    return None


def _refuse_port_taken(dist: DistEnv) -> None:
    """Rank 0 could not open the store: a MASTER_PORT it cannot bind is bad input, told by the errno of a bind."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: a port in TIME_WAIT is free
        try:
            probe.bind(("", dist.master_port))
        except OSError as exc:
            raise BadInput(
                f"rank 0 cannot listen on MASTER_PORT={dist.master_port} on its host ({dist.master_addr}:{dist.master_port}: "
                f"{exc.strerror or exc}); another process holds that port (an earlier run still ending, another job): "
                "set MASTER_PORT to a free port, the same on every replica",
            ) from None


def _wait_for_rank0(dist: DistEnv, timeout_s: int, deadline: float) -> None:
    """Wait until rank 0's port answers, at most until `deadline`: torch's store client backs off past its own
    timeout (seen: 15 s failing after 41 s). A name that does not resolve yet (a new pod's DNS) is retried too."""
    while True:
        try:
            with socket.create_connection(
                (dist.master_addr, dist.master_port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))
            ):
                return
        except OSError as exc:
            resolved = not isinstance(exc, socket.gaierror)
        if time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if not resolved:
        raise BadInput(
            f"MASTER_ADDR={dist.master_addr} did not resolve to an address within RENDEZVOUS_TIMEOUT={timeout_s}s; "
            "set MASTER_ADDR to the host name or IP of the rank-0 replica",
        )
    raise JobError(
        1,
        f"rank {dist.rank} found no rank 0 listening at {dist.master_addr}:{dist.master_port} within RENDEZVOUS_TIMEOUT={timeout_s}s; "
        "check that the rank-0 replica started and that MASTER_ADDR/MASTER_PORT point at it",
    )
