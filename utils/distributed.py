"""Who this process is in the job, from whatever launched it. The only module that reads rank variables.

Launchers, first match wins (so torchrun inside a Slurm task or a PyTorchJob pod wins):

| source     | recognised by                          | gives                                                   |
| ---------- | -------------------------------------- | ------------------------------------------------------- |
| torchrun   | TORCHELASTIC_RUN_ID or LOCAL_WORLD_SIZE | RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_*      |
| pytorchjob | PET_NODE_RANK or PET_NNODES            | RANK = pod index, WORLD_SIZE, MASTER_* (no NODE_RANK)   |
| platform   | RANK and WORLD_SIZE                    | RANK, WORLD_SIZE, NODE_RANK, LOCAL_RANK (0: 1 GPU each) |
| slurm      | SLURM_PROCID and SLURM_NTASKS          | SLURM_PROCID/NTASKS/LOCALID/NODEID, first host of the node list |
| single     | none of the above                      | rank 0 of 1                                             |

The rendezvous (settings compared across ranks, a heartbeat) and the collectives the job needs outside
the Trainer (agreeing on an error, the stop flag, the final barrier) live here too. torch is imported
lazily: `--dry-run` uses `detect_env` without it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TypeVar

from utils.errors import EXIT_BAD_INPUT, EXIT_PREEMPTED, JobError

DEFAULT_PORT = 29500  # torch's own default, used when only the address is given
T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    source: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def as_dict(self) -> dict:
        return asdict(self)


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        if default is None:
            raise JobError(
                EXIT_BAD_INPUT,
                f"{name} is not set; the launcher must set it (or unset the other rank variables to run as one process)",
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise JobError(EXIT_BAD_INPUT, f"{name}={raw!r} is not an integer; set it to a whole number") from None


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu-[01-04,07],cpu1' -> 'gpu-01', 'rack[1-2]-node[01-04]' -> 'rack1-node01'.

    Slurm's own `scontrol show hostnames` where it is installed (it knows every syntax Slurm writes),
    else python-hostlist, a parser kept by a Slurm site (zero-padding, several bracket groups, suffixes).
    """
    nodelist = nodelist.strip()
    if shutil.which("scontrol"):
        try:
            shown = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10, check=False
            )
            hosts = shown.stdout.split() if shown.returncode == 0 else []
            if hosts:
                return hosts[0]
        except (OSError, subprocess.SubprocessError):
            pass  # a broken or hanging scontrol: the parser below reads the same syntax
    import hostlist  # python-hostlist: pure Python, nothing heavy for --dry-run

    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist:
        hosts = []
    if not hosts:
        raise JobError(
            EXIT_BAD_INPUT,
            f"SLURM_JOB_NODELIST={nodelist!r} is not a node list; set MASTER_ADDR to the first node's address",
        )
    return hosts[0]


def _refuse_partial_rank_variables(env: Mapping[str, str]) -> None:
    """No launcher was recognised, yet some rank variables are set: half a launcher's environment.

    Read as one process, each of N replicas would train alone into the same folder. What one process
    would have anyway (WORLD_SIZE=1, LOCAL_RANK=0, NODE_RANK=0) is accepted.
    """
    value = lambda name: env.get(name, "").strip()  # noqa: E731
    if value("WORLD_SIZE") and value("WORLD_SIZE") != "1" and not value("RANK"):
        raise JobError(
            EXIT_BAD_INPUT,
            f"WORLD_SIZE={value('WORLD_SIZE')} is set but RANK is not; set RANK (0..WORLD_SIZE-1) on every replica, "
            "or unset WORLD_SIZE to run as one process",
        )
    if value("RANK") and not value("WORLD_SIZE"):
        raise JobError(
            EXIT_BAD_INPUT,
            f"RANK={value('RANK')} is set but WORLD_SIZE is not; set WORLD_SIZE (the number of replicas) on every replica, "
            "or unset RANK to run as one process",
        )
    stray = [f"{name}={value(name)}" for name in ("NODE_RANK", "LOCAL_RANK") if value(name) not in ("", "0")]
    stray += [f"{name}={value(name)}" for name in ("MASTER_ADDR", "MASTER_PORT") if value(name)]
    if stray:
        raise JobError(
            EXIT_BAD_INPUT,
            f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} set but RANK and WORLD_SIZE are not, so this replica would train alone; "
            "set RANK and WORLD_SIZE as well (or start it with torchrun), or unset them to run as one process",
        )


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables into one checked DistEnv (bad values raise JobError, exit 2)."""
    env = os.environ if environ is None else environ
    has = lambda name: bool(env.get(name, "").strip())  # noqa: E731 - an empty variable counts as unset

    if has("TORCHELASTIC_RUN_ID") or has("LOCAL_WORLD_SIZE"):
        source = "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK")
        node_rank = _int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0))
        addr = env.get("MASTER_ADDR")
    elif has("PET_NODE_RANK") or has("PET_NNODES"):
        source = "pytorchjob"
        if not has("RANK"):  # Kubeflow Trainer v2 sets only torchrun's PET_* variables, never RANK
            raise JobError(
                EXIT_BAD_INPUT,
                "PET_NNODES/PET_NODE_RANK are set but RANK is not: under Kubeflow Trainer v2 (TrainJob) start the container "
                "with `torchrun main.py`, which turns PET_* into ranks (k8s/trainer-v2/trainjob.yaml)",
            )
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        nproc = env.get("PET_NPROC_PER_NODE", "1").strip() or "1"
        if nproc != "1":
            raise JobError(
                EXIT_BAD_INPUT,
                f"PET_NPROC_PER_NODE={nproc} but the pod started main.py without torchrun, so RANK is the pod index, "
                "not the process rank; start the container with `torchrun main.py` (k8s/multi-gpu-per-pod) or set nprocPerNode: 1",
            )
        local_rank = 0  # one process per pod
        node_rank = _int(env, "PET_NODE_RANK", rank)
        addr = env.get("MASTER_ADDR")
    elif has("RANK") and has("WORLD_SIZE"):
        source = "platform"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK", 0)  # one GPU per replica
        node_rank = _int(env, "NODE_RANK", rank)
        addr = env.get("MASTER_ADDR")
    elif has("SLURM_PROCID") and has("SLURM_NTASKS"):
        source = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID", 0)
        node_rank = _int(env, "SLURM_NODEID", 0)
        addr = env.get("MASTER_ADDR") or (first_host(env["SLURM_JOB_NODELIST"]) if has("SLURM_JOB_NODELIST") else None)
    else:
        _refuse_partial_rank_variables(env)
        return DistEnv(
            rank=0, local_rank=0, world_size=1, node_rank=0, master_addr=None, master_port=None, source="single"
        )

    if world < 1:
        raise JobError(EXIT_BAD_INPUT, f"world size is {world} ({source}); it must be at least 1")
    if not 0 <= rank < world:
        raise JobError(EXIT_BAD_INPUT, f"WORLD_SIZE={world} but RANK={rank} ({source}); RANK must be 0..{world - 1}")
    if local_rank < 0 or node_rank < 0:
        raise JobError(
            EXIT_BAD_INPUT, f"LOCAL_RANK={local_rank} and NODE_RANK={node_rank} ({source}) must not be negative"
        )
    addr = (addr or "").strip() or None
    if world == 1:
        return DistEnv(
            rank, local_rank, 1, node_rank, addr, _int(env, "MASTER_PORT", DEFAULT_PORT) if addr else None, source
        )
    if addr is None:
        raise JobError(
            EXIT_BAD_INPUT,
            f"WORLD_SIZE={world} ({source}) but MASTER_ADDR is not set; set MASTER_ADDR (and MASTER_PORT, default {DEFAULT_PORT}) "
            "to the address of the rank-0 replica, e.g. in the job's config_map",
        )
    port = _int(env, "MASTER_PORT", DEFAULT_PORT)
    if not 0 < port < 65536:
        raise JobError(EXIT_BAD_INPUT, f"MASTER_PORT={port} is not a TCP port; use 1..65535 (default {DEFAULT_PORT})")
    return DistEnv(rank, local_rank, world, node_rank, addr, port, source)


def launcher_options(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Training options a launcher put in the environment: `accelerate launch` exports its config file as
    ACCELERATE_* variables, which the Trainer would follow over the job's own settings (utils/strategy.py
    refuses the ones that disagree)."""
    env = os.environ if environ is None else environ
    flag = lambda name: env.get(name, "").strip().lower() in ("1", "true", "yes")  # noqa: E731
    return {
        "fsdp": flag("ACCELERATE_USE_FSDP"),
        "deepspeed": flag("ACCELERATE_USE_DEEPSPEED"),
        "mixed_precision": env.get("ACCELERATE_MIXED_PRECISION", "").strip().lower() or None,
    }


def export_env(dist: DistEnv) -> None:
    """Publish the resolved ranks under the names torch, Accelerate and the Trainer read (env://)."""
    values = {
        "RANK": dist.rank,
        "LOCAL_RANK": dist.local_rank,
        "WORLD_SIZE": dist.world_size,
        "NODE_RANK": dist.node_rank,
    }
    if dist.master_addr:
        values |= {"MASTER_ADDR": dist.master_addr, "MASTER_PORT": dist.master_port}
    if dist.is_distributed:
        os.environ.update({name: str(value) for name, value in values.items()})
    else:
        # A stray RANK="" or LOCAL_RANK="" makes the Trainer crash or wait for peers that never come.
        for name in values:
            if not os.environ.get(name, "").strip():
                os.environ.pop(name, None)


def masked_environ() -> dict[str, str]:
    """The launcher variables this rank saw, for its log; anything that looks like a secret is masked."""
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "PET_NODE_RANK",
        "PET_NNODES",
        "PET_NPROC_PER_NODE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_JOB_NODELIST",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "HF_TOKEN",
        "HF_TOKEN_PATH",
    )
    secret = re.compile("TOKEN|SECRET|PASSWORD|KEY", re.I)
    return {
        k: ("***" if secret.search(k) and k != "HF_TOKEN_PATH" else os.environ[k]) for k in keys if k in os.environ
    }


# ------------------------------------------------------------------------------- rendezvous
AGREEMENT_KEY = "job/agree/{rank}"
VERDICT_KEY = "job/verdict"
BEAT_KEY = "job/beat/{rank}"
BEAT_SECONDS = 1.0  # each rank bumps its counter in the store this often while it is in the job
PROBE_SECONDS = 3.0  # a peer whose counter did not move for this long has died or stopped
WATCHDOG_GRACE = 5  # seconds past RENDEZVOUS_TIMEOUT after which a rank stuck in native code is ended


class PeerTimeout(TimeoutError):
    """A peer did not answer within RENDEZVOUS_TIMEOUT."""


@dataclass
class _Group:
    """What this process holds of the job's group: the rendezvous store and the heartbeat beside it."""

    store: object
    beat_store: object
    control: object = None  # the gloo group for small control messages on NCCL jobs (None: the default group)
    stop: threading.Event = field(default_factory=threading.Event)


_GROUP: _Group | None = None


@contextmanager
def watchdog(seconds: float, message: str, code: int) -> Iterator[None]:
    """End the process with `code` if the block has not finished after `seconds`.

    torch's store and gloo calls wait in native code, where neither their own timeouts (seen: rank 0
    waiting 100 s on a 20 s timeout) nor a Python signal handler can always reach them.
    """
    done = threading.Event()

    def expire() -> None:
        if not done.wait(seconds):
            sys.stderr.write(f"error: {message}\n")
            sys.stderr.flush()
            os._exit(code)

    threading.Thread(target=expire, daemon=True, name="watchdog").start()
    try:
        yield
    finally:
        done.set()


def rendezvous(
    dist: DistEnv, timeout_s: int, cuda: bool, agreement: dict, on_main: Callable[[], None] | None = None
) -> None:
    """Meet the other ranks, check that they run the same job, and create the process group.

    Every rank posts `agreement` (world size, training settings, run name) in rank 0's TCP store; rank 0
    compares them all, then runs `on_main` (taking the OUTPUT_DIR lock) and posts one verdict that every
    rank follows: replicas started with other settings or another world size all stop with exit 2 and
    the names of what differs, instead of training different models. Everything is bounded by
    RENDEZVOUS_TIMEOUT on every rank. The process group is then created on the same store, so
    `TrainingArguments(ddp_timeout=...)`, ignored on gloo, is not needed: the timeout bounds every
    collective, DDP's gradient all-reduce included.
    """
    if not dist.is_distributed:
        if on_main is not None:
            on_main()
        return
    import torch
    import torch.distributed as td

    global _GROUP
    timeout = timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    where = f"{dist.master_addr}:{dist.master_port}"
    stuck = (
        f"rank {dist.rank} could not meet its {dist.world_size - 1} peers at {where} within RENDEZVOUS_TIMEOUT={timeout_s}s; "
        f"check that all {dist.world_size} replicas started with the same WORLD_SIZE and that MASTER_ADDR/MASTER_PORT point at rank 0"
    )
    with watchdog(timeout_s + WATCHDOG_GRACE, stuck, 1):
        if not dist.is_main:
            _wait_for_rank0(dist, timeout_s, deadline)
        try:
            store = td.TCPStore(
                dist.master_addr, dist.master_port, None, dist.is_main, timeout, wait_for_workers=False
            )
            beat_store = td.TCPStore(dist.master_addr, dist.master_port, None, False, timeout)
        except (td.DistError, RuntimeError) as exc:
            raise JobError(1, f"{stuck} ({type(exc).__name__})") from None
        _GROUP = _Group(store, beat_store)
        mine = json.dumps(agreement, sort_keys=True, default=str)
        store.set(AGREEMENT_KEY.format(rank=dist.rank), mine)
        try:
            if dist.is_main:
                verdict = _judge(dist, store, agreement, timeout_s, deadline, on_main)
                store.set(VERDICT_KEY, json.dumps(verdict))
            else:
                store.wait([VERDICT_KEY], timedelta(seconds=max(1.0, deadline - time.monotonic())))
                verdict = json.loads(store.get(VERDICT_KEY))
                theirs = json.loads(store.get(AGREEMENT_KEY.format(rank=0)))
                if verdict is None and theirs != json.loads(mine):  # a rank rank 0 did not wait for (it counts fewer)
                    verdict = [EXIT_BAD_INPUT, _mismatch(theirs, {dist.rank: json.loads(mine)})]
        except (td.DistError, RuntimeError) as exc:
            if isinstance(exc, JobError):
                raise
            raise JobError(1, f"{stuck} ({type(exc).__name__})") from None
        if verdict is not None:
            raise JobError(*verdict)
        if cuda:
            torch.cuda.set_device(dist.local_rank)
        td.init_process_group(
            backend="nccl" if cuda else "gloo",
            store=store,
            rank=dist.rank,
            world_size=dist.world_size,
            timeout=timeout,
        )
        # Small control messages (the stop flag, checkpoint barriers) go over gloo: on an NCCL job they
        # would otherwise sync the GPU stream at every step.
        _GROUP.control = td.new_group(backend="gloo", timeout=timeout) if td.get_backend() != "gloo" else None
    threading.Thread(target=_beat, args=(_GROUP, dist.rank), daemon=True, name="heartbeat").start()


def _judge(
    dist: DistEnv, store, agreement: dict, timeout_s: int, deadline: float, on_main: Callable[[], None] | None
) -> list | None:
    """Rank 0: every rank's agreement compared with its own, then `on_main`; None when all is well."""
    import torch.distributed as td

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
    mine = json.loads(json.dumps(agreement, sort_keys=True, default=str))  # as the others see it, through JSON
    differing = {rank: theirs for rank, theirs in others.items() if theirs != mine}
    if differing:
        return [EXIT_BAD_INPUT, _mismatch(mine, differing)]
    if on_main is not None:
        try:
            on_main()
        except JobError as exc:
            return [exc.code, exc.message]
    return None


def _mismatch(main: dict, others: dict[int, dict]) -> str:
    """'LEARNING_RATE: 0.0005 on rank 0, 0.9 on rank 1; ...' for the settings that differ."""
    parts = []
    for name in sorted(
        {name for theirs in others.values() for name in set(theirs) | set(main) if theirs.get(name) != main.get(name)}
    ):
        values = [f"{main.get(name)} on rank 0"] + [
            f"{theirs.get(name)} on rank {rank}"
            for rank, theirs in others.items()
            if theirs.get(name) != main.get(name)
        ]
        parts.append(f"{name.upper()}: {', '.join(values)}")
    return (
        f"the replicas were started with different settings ({'; '.join(parts)}); "
        "give every replica the same settings (one config_map / ConfigMap for all) and start them again"
    )


def _beat(group: _Group, rank: int) -> None:
    """Bump this rank's counter in the store until the group is left: how a peer tells alive from lost."""
    key = BEAT_KEY.format(rank=rank)
    while not group.stop.wait(BEAT_SECONDS):
        try:
            group.beat_store.add(key, 1)
        except Exception:  # rank 0, which holds the store, is gone: the main thread will find out
            return


def peer_lost(world_size: int, rank: int) -> bool:
    """Whether a peer died or stopped: its heartbeat did not move for PROBE_SECONDS, or the store is gone."""
    if _GROUP is None:
        return False
    try:
        keys = [BEAT_KEY.format(rank=r) for r in range(world_size) if r != rank]
        before = [_GROUP.beat_store.add(key, 0) for key in keys]
        time.sleep(PROBE_SECONDS)
        after = [_GROUP.beat_store.add(key, 0) for key in keys]
    except Exception:
        return True
    return any(a == b for a, b in zip(before, after, strict=True))


def _wait_for_rank0(dist: DistEnv, timeout_s: int, deadline: float) -> None:
    """Wait until rank 0's rendezvous port answers, at most until `deadline`.

    torch's store client retries with a random back-off that can exceed the timeout itself (seen: a
    15 s timeout failing after 41 s); polling first keeps a missing rank 0 within RENDEZVOUS_TIMEOUT.
    A host name that does not resolve yet (a pod whose DNS record is not published) is retried too.
    """
    resolved = False
    while True:
        try:
            with socket.create_connection(
                (dist.master_addr, dist.master_port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))
            ):
                return
        except socket.gaierror:
            resolved = False
        except OSError:
            resolved = True
        if time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if not resolved:
        raise JobError(
            EXIT_BAD_INPUT,
            f"MASTER_ADDR={dist.master_addr} did not resolve to an address within RENDEZVOUS_TIMEOUT={timeout_s}s; "
            "set MASTER_ADDR to the host name or IP of the rank-0 replica",
        )
    raise JobError(
        1,
        f"rank {dist.rank} found no rank 0 listening at {dist.master_addr}:{dist.master_port} within RENDEZVOUS_TIMEOUT={timeout_s}s; "
        "check that the rank-0 replica started and that MASTER_ADDR/MASTER_PORT point at it",
    )


# ------------------------------------------------------------------------------- collectives
def _broadcast(dist: DistEnv, value: object) -> object:
    import torch.distributed as td

    box = [value]
    td.broadcast_object_list(box, src=0)
    return box[0]


def run_on_main(dist: DistEnv, step: Callable[[], T]) -> T | None:
    """Run `step` on rank 0 only; the other ranks wait for its outcome.

    When rank 0 fails with a JobError every rank stops with the same exit code and message at once,
    instead of waiting in a barrier until the timeout. Returns `step`'s result on rank 0, None elsewhere.
    """
    if not dist.is_distributed:
        return step()
    outcome: tuple[int, str] | None = None
    result = None
    if dist.is_main:
        try:
            result = step()
        except JobError as exc:
            outcome = (exc.code, exc.message)
        except BaseException as exc:
            _broadcast(dist, (1, f"rank 0 failed: {type(exc).__name__}"))
            raise
    outcome = _broadcast(dist, outcome)
    if outcome is not None:
        raise JobError(*outcome)
    return result


def on_main_then_others(dist: DistEnv, step: Callable[[], T]) -> T:
    """Run `step` on rank 0 first (it downloads and tokenizes into the shared cache), then on the others."""
    result = run_on_main(dist, step)
    return result if dist.is_main else step()


def agree(dist: DistEnv, step: Callable[[], T]) -> T:
    """Run `step` on every rank; if any rank fails with a JobError, all stop with the first one's code."""
    if not dist.is_distributed:
        return step()
    import torch.distributed as td

    outcome, result = None, None
    try:
        result = step()
    except JobError as exc:
        outcome = (exc.code, exc.message)
    outcomes: list = [None] * dist.world_size
    td.all_gather_object(outcomes, outcome)
    failed = [o for o in outcomes if o is not None]
    if failed:
        raise JobError(*failed[0])
    return result


def leave_process_group() -> None:
    """After the final barrier: stop the heartbeat and drop the group locally (no collective), so rank 0
    can upload for as long as it needs."""
    import torch.distributed as td

    if _GROUP is not None:
        _GROUP.stop.set()
    if td.is_available() and td.is_initialized():
        td.destroy_process_group()


def _control_group():
    return _GROUP.control if _GROUP is not None else None


def max_over_ranks(dist: DistEnv, value: int) -> int:
    """The largest of every rank's `value` (one all-reduce of an int), on every rank: a decision all ranks share."""
    if not dist.is_distributed:
        return value
    import torch
    import torch.distributed as td

    tensor = torch.tensor([int(value)], dtype=torch.int32)
    td.all_reduce(tensor, op=td.ReduceOp.MAX, group=_control_group())
    return int(tensor.item())


def any_rank(dist: DistEnv, flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank."""
    return bool(max_over_ranks(dist, int(flag)))


def barrier(dist: DistEnv) -> None:
    """Wait until every rank gets here (bounded by RENDEZVOUS_TIMEOUT like every collective)."""
    if dist.is_distributed:
        import torch.distributed as td

        td.barrier(group=_control_group())


def decide_on_main(dist: DistEnv, step: Callable[[], T]) -> T:
    """Run `step` on rank 0 only and give its result to every rank (a JobError on rank 0 stops all)."""
    result = run_on_main(dist, step)
    return _broadcast(dist, result) if dist.is_distributed else result


def is_lost_peer(exc: BaseException, dist: DistEnv) -> bool:
    """Whether `exc` means a peer died, stopped answering or was cut off, told by type and by evidence.

    torch's DistNetworkError and DistStoreError (the store, held by rank 0, is gone) and timeouts are a
    lost peer by type. gloo reports a closed connection or a silent peer as a plain RuntimeError, the
    same type as a real crash, so for those the heartbeat decides: the failure is a lost peer only if a
    peer's heartbeat stopped. Anything else (a CUDA error, an illegal memory access, a bug) is a crash,
    exit 1, which `restartPolicy: ExitCode` rightly does not restart for ever.
    """
    if not dist.is_distributed:
        return False
    import torch
    import torch.distributed as td

    if isinstance(exc, (td.DistNetworkError, td.DistStoreError, PeerTimeout, TimeoutError)):
        return True
    if isinstance(exc, (torch.AcceleratorError, torch.OutOfMemoryError)) or not isinstance(exc, RuntimeError):
        return False
    return peer_lost(dist.world_size, dist.rank)


@contextmanager
def peers_watched(dist: DistEnv, timeout_s: int, resume_hint: Callable[[], str]) -> Iterator[None]:
    """Turn a failure caused by a lost peer, anywhere between rendezvous and the final barrier, into one
    clear error line and exit 143.

    143, as after SIGTERM: the usual cause is a replica preempted or killed (a node lost, an OOM kill),
    and the cure is the same, restart every replica and resume from the last checkpoint. With exit 1,
    `restartPolicy: ExitCode` would end the whole job at the first lost node.
    """
    try:
        yield
    except JobError:
        raise
    except Exception as exc:
        if not is_lost_peer(exc, dist):
            raise
        raise JobError(
            EXIT_PREEMPTED,
            f"rank {dist.rank} lost contact with its peers ({type(exc).__name__}): a replica was killed, stopped "
            f"or cut off, or did not answer within RENDEZVOUS_TIMEOUT={timeout_s}s; restart all {dist.world_size} replicas: "
            f"{resume_hint()}",
        ) from None
