"""Who this process is in the job, from whatever launched it. The only module that reads rank variables.

Launchers, first match wins (so torchrun inside a Slurm task or a PyTorchJob pod wins):

| source     | recognised by                          | gives                                                   |
| ---------- | -------------------------------------- | ------------------------------------------------------- |
| torchrun   | TORCHELASTIC_RUN_ID or LOCAL_WORLD_SIZE | RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_*      |
| pytorchjob | PET_NODE_RANK or PET_NNODES            | RANK = pod index, WORLD_SIZE, MASTER_* (no NODE_RANK)   |
| platform   | RANK and WORLD_SIZE                    | RANK, WORLD_SIZE, NODE_RANK, LOCAL_RANK (0: 1 GPU each) |
| slurm      | SLURM_PROCID and SLURM_NTASKS          | SLURM_PROCID/NTASKS/LOCALID/NODEID, first host of the node list |
| single     | none of the above                      | rank 0 of 1                                             |

The collectives the job needs outside the Trainer (agreeing on an error, the final barrier) live here
too, so every rank-aware decision sits in one file. torch is imported lazily: `--dry-run` uses
`detect_env` without it.
"""

from __future__ import annotations

import os
import re
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Iterator, Mapping, TypeVar

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
            raise JobError(EXIT_BAD_INPUT, f"{name} is not set; the launcher must set it (or unset the other rank variables to run as one process)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise JobError(EXIT_BAD_INPUT, f"{name}={raw!r} is not an integer; set it to a whole number") from None


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu-[01-04,07],cpu1' -> 'gpu-01'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise JobError(EXIT_BAD_INPUT, f"SLURM_JOB_NODELIST={nodelist!r} is not a node list; set MASTER_ADDR to the first node's address")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


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
        return DistEnv(rank=0, local_rank=0, world_size=1, node_rank=0, master_addr=None, master_port=None, source="single")

    if world < 1:
        raise JobError(EXIT_BAD_INPUT, f"world size is {world} ({source}); it must be at least 1")
    if not 0 <= rank < world:
        raise JobError(EXIT_BAD_INPUT, f"WORLD_SIZE={world} but RANK={rank} ({source}); RANK must be 0..{world - 1}")
    if local_rank < 0 or node_rank < 0:
        raise JobError(EXIT_BAD_INPUT, f"LOCAL_RANK={local_rank} and NODE_RANK={node_rank} ({source}) must not be negative")
    addr = (addr or "").strip() or None
    if world == 1:
        return DistEnv(rank, local_rank, 1, node_rank, addr, _int(env, "MASTER_PORT", DEFAULT_PORT) if addr else None, source)
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
    values = {"RANK": dist.rank, "LOCAL_RANK": dist.local_rank, "WORLD_SIZE": dist.world_size, "NODE_RANK": dist.node_rank}
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
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "PET_NODE_RANK", "PET_NNODES", "PET_NPROC_PER_NODE", "SLURM_PROCID", "SLURM_NTASKS",
            "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_NODELIST", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "HF_TOKEN", "HF_TOKEN_PATH")  # fmt: skip
    secret = re.compile("TOKEN|SECRET|PASSWORD|KEY", re.I)
    return {k: ("***" if secret.search(k) and k != "HF_TOKEN_PATH" else os.environ[k]) for k in keys if k in os.environ}


# ------------------------------------------------------------------------------- collectives
def init_process_group(dist: DistEnv, timeout_s: int, cuda: bool) -> None:
    """Create the process group ourselves, so RENDEZVOUS_TIMEOUT holds on gloo too.

    `TrainingArguments(ddp_timeout=...)` is ignored on the CPU (gloo keeps its 30-minute default);
    Accelerate reuses a group that already exists. The timeout then bounds every collective, DDP's
    gradient all-reduce included: a peer that stops answering fails the others after it.
    """
    if not dist.is_distributed:
        return
    import torch
    import torch.distributed as td

    global _CONTROL_GROUP
    timeout = timedelta(seconds=timeout_s)
    if not td.is_initialized():
        if cuda:
            torch.cuda.set_device(dist.local_rank)
        deadline = time.monotonic() + timeout_s
        if not dist.is_main:
            _wait_for_rank0(dist, timeout_s, deadline)
        try:
            td.init_process_group(
                backend="nccl" if cuda else "gloo",
                init_method="env://",
                rank=dist.rank,
                world_size=dist.world_size,
                timeout=timeout,
            )
        except Exception as exc:  # the rendezvous store timed out waiting for the other ranks
            raise JobError(
                EXIT_BAD_INPUT if "resolve" in str(exc).lower() else 1,
                f"rank {dist.rank} could not meet its {dist.world_size - 1} peers at {dist.master_addr}:{dist.master_port} "
                f"within RENDEZVOUS_TIMEOUT={timeout_s}s ({type(exc).__name__}); check that all {dist.world_size} replicas "
                "started with the same WORLD_SIZE and that MASTER_ADDR/MASTER_PORT point at rank 0",
            ) from None
    # Small control messages (the preemption flag, checkpoint barriers) go over gloo on the CPU: on an
    # NCCL job they would otherwise sync the GPU stream at every step.
    _CONTROL_GROUP = td.new_group(backend="gloo", timeout=timeout) if td.get_backend() != "gloo" else None


_CONTROL_GROUP = None


def _wait_for_rank0(dist: DistEnv, timeout_s: int, deadline: float) -> None:
    """Wait until rank 0's rendezvous port answers, at most until `deadline`.

    torch's store client retries with a random back-off that can exceed the timeout itself (seen: a
    15 s timeout failing after 41 s); polling first keeps a missing rank 0 within RENDEZVOUS_TIMEOUT.
    A host name that does not resolve yet (a pod whose DNS record is not published) is retried too.
    """
    resolved = False
    while True:
        try:
            with socket.create_connection((dist.master_addr, dist.master_port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
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
    """After the final barrier: drop the group locally (no collective), so rank 0 can upload for as long as it needs."""
    import torch.distributed as td

    if td.is_available() and td.is_initialized():
        td.destroy_process_group()


def any_rank(dist: DistEnv, flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank (one all-reduce of a byte): a decision all ranks share."""
    if not dist.is_distributed:
        return flag
    import torch
    import torch.distributed as td

    value = torch.tensor([int(flag)], dtype=torch.int32)
    td.all_reduce(value, op=td.ReduceOp.MAX, group=_CONTROL_GROUP)
    return bool(value.item())


def barrier(dist: DistEnv) -> None:
    """Wait until every rank gets here (bounded by RENDEZVOUS_TIMEOUT like every collective)."""
    if dist.is_distributed:
        import torch.distributed as td

        td.barrier(group=_CONTROL_GROUP)


def decide_on_main(dist: DistEnv, step: Callable[[], T]) -> T:
    """Run `step` on rank 0 only and give its result to every rank (a JobError on rank 0 stops all)."""
    result = run_on_main(dist, step)
    return _broadcast(dist, result) if dist.is_distributed else result


GLOO_PREFIX = re.compile(r"^\[[^\]]*\]\s*")  # gloo prefixes its messages with the C++ source location


def is_collective_failure(exc: BaseException) -> bool:
    """A collective that failed because a peer died, stopped answering or was cut off."""
    try:
        import torch.distributed as td

        if isinstance(exc, td.DistError):
            return True
    except ImportError:  # pragma: no cover - torch is always there when collectives ran
        pass
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out waiting")
    )


@contextmanager
def peers_watched(dist: DistEnv, timeout_s: int, resume_hint: Callable[[], str]) -> Iterator[None]:
    """Turn a collective that failed because of a peer into one clear error line, not a traceback.

    The exit code is 143, as after SIGTERM: the usual cause is a replica preempted or killed (a node
    lost, an OOM kill), and the cure is the same, restart every replica and resume from the last
    checkpoint. With exit 1, `restartPolicy: ExitCode` would end the whole job at the first lost node.
    """
    try:
        yield
    except Exception as exc:
        if not (dist.is_distributed and is_collective_failure(exc)):
            raise
        detail = GLOO_PREFIX.sub("", (str(exc).strip().splitlines() or [""])[0]).split(". ")[0][:200]
        raise JobError(
            EXIT_PREEMPTED,
            f"rank {dist.rank} lost contact with its peers ({detail}): a replica was killed, stopped "
            f"or cut off, or did not answer within RENDEZVOUS_TIMEOUT={timeout_s}s; restart all {dist.world_size} replicas: "
            f"{resume_hint()}",
        ) from None
