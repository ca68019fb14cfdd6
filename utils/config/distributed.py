"""Who this process is in the job, from the launcher's variables: the only module that reads (or sets) them.

Launchers, first match wins (docs/launchers.md tabulates what each sets): torchrun (TORCHELASTIC_RUN_ID or
LOCAL_WORLD_SIZE), deepspeed (CROSS_RANK and CROSS_SIZE), pytorchjob (PET_NODE_RANK or PET_NNODES), platform (RANK
and WORLD_SIZE), slurm (SLURM_PROCID and SLURM_NTASKS), else single. No torch here: `--dry-run` must stay fast.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from utils.common.errors import BadInput
from utils.common.hub_token import MASK

# Slurm's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (the batch script and the sweep's array).
SLURM_TIME_LIMIT = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}")
DEFAULT_PORT = 29500  # torch's own default, used when only the address is given
# Every variable a launcher uses to tell a process who it is (platform, torchrun, Kubeflow, Slurm).
LAUNCHER_VARIABLES = tuple(
    "RANK LOCAL_RANK WORLD_SIZE NODE_RANK GROUP_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID "
    "CROSS_RANK CROSS_SIZE LOCAL_SIZE PET_NODE_RANK PET_NNODES PET_NPROC_PER_NODE "
    "SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_NODEID SLURM_JOB_NODELIST".split()
)


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
            raise BadInput(
                f"{name} is not set; the launcher must set it (or unset the other rank variables to run as one process)",
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadInput(f"{name}={raw!r} is not an integer; set it to a whole number") from None


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list ('gpu-[01-04,07],cpu1' -> 'gpu-01'): `scontrol show hostnames` where it is
    installed, else python-hostlist (a parser kept by a Slurm site)."""
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
        raise BadInput(
            f"SLURM_JOB_NODELIST={nodelist!r} is not a node list; set MASTER_ADDR to the first node's address",
        )
    return hosts[0]


def _refuse_partial_rank_variables(env: Mapping[str, str]) -> None:
    """No launcher was recognised, yet rank variables are set: as one process, each of N replicas would train alone
    into the same folder. What one process has anyway (WORLD_SIZE=1, LOCAL_RANK=0, NODE_RANK=0) passes."""
    value = lambda name: env.get(name, "").strip()  # noqa: E731
    if value("WORLD_SIZE") and value("WORLD_SIZE") != "1" and not value("RANK"):
        raise BadInput(
            f"WORLD_SIZE={value('WORLD_SIZE')} is set but RANK is not; set RANK (0..WORLD_SIZE-1) on every replica, or unset WORLD_SIZE to run as one process",
        )
    if value("RANK") and not value("WORLD_SIZE"):
        raise BadInput(
            f"RANK={value('RANK')} is set but WORLD_SIZE is not; set WORLD_SIZE (the number of replicas) on every replica, or unset RANK to run as one process",
        )
    stray = [f"{name}={value(name)}" for name in ("NODE_RANK", "LOCAL_RANK") if value(name) not in ("", "0")]
    stray += [f"{name}={value(name)}" for name in ("MASTER_ADDR", "MASTER_PORT") if value(name)]
    if stray:
        raise BadInput(
            f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} set but RANK and WORLD_SIZE are not, so this replica would train alone; set RANK and WORLD_SIZE as well (or start it with torchrun), or unset them to run as one process",
        )


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables into one checked DistEnv (bad values raise JobError, exit 2)."""
    env = os.environ if environ is None else environ
    has = lambda name: bool(env.get(name, "").strip())  # noqa: E731 - an empty variable counts as unset
    addr = env.get("MASTER_ADDR")
    torchrun = has("TORCHELASTIC_RUN_ID") or has("LOCAL_WORLD_SIZE")
    if torchrun or (has("CROSS_RANK") and has("CROSS_SIZE")):
        # The `deepspeed` launcher (deepspeed/launcher/launch.py): its RANK is the process rank, and the node
        # is CROSS_RANK, not NODE_RANK, which it never sets (read as the platform, node would be the rank).
        source = "torchrun" if torchrun else "deepspeed"
        rank, world, local_rank = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK")
        node_rank = _int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0)) if torchrun else _int(env, "CROSS_RANK")
    elif has("PET_NODE_RANK") or has("PET_NNODES"):
        source = "pytorchjob"
        if not has("RANK"):  # Kubeflow Trainer v2 sets only torchrun's PET_* variables, never RANK
            raise BadInput(
                "PET_NNODES/PET_NODE_RANK are set but RANK is not: under Kubeflow Trainer v2 (TrainJob) start the container with `torchrun main.py`, which turns PET_* into ranks (k8s/trainer-v2/trainjob.yaml)",
            )
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        nproc = env.get("PET_NPROC_PER_NODE", "1").strip() or "1"
        if nproc != "1":
            raise BadInput(
                f"PET_NPROC_PER_NODE={nproc} but the pod started main.py without torchrun, so RANK is the pod index, not the process rank; start the container with `torchrun main.py` (k8s/multi-gpu-per-pod) or set nprocPerNode: 1",
            )
        local_rank, node_rank = 0, _int(env, "PET_NODE_RANK", rank)  # one process per pod
    elif has("RANK") and has("WORLD_SIZE"):
        source = "platform"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank, node_rank = _int(env, "LOCAL_RANK", 0), _int(env, "NODE_RANK", rank)  # one GPU per replica
    elif has("SLURM_PROCID") and has("SLURM_NTASKS"):
        source = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank, node_rank = _int(env, "SLURM_LOCALID", 0), _int(env, "SLURM_NODEID", 0)
        addr = addr or (first_host(env["SLURM_JOB_NODELIST"]) if has("SLURM_JOB_NODELIST") else None)
    else:
        _refuse_partial_rank_variables(env)
        return DistEnv(0, 0, 1, 0, None, None, "single")

    if world < 1:
        raise BadInput(f"world size is {world} ({source}); it must be at least 1")
    if not 0 <= rank < world:
        raise BadInput(f"WORLD_SIZE={world} but RANK={rank} ({source}); RANK must be 0..{world - 1}")
    if local_rank < 0 or node_rank < 0:
        raise BadInput(f"LOCAL_RANK={local_rank} and NODE_RANK={node_rank} ({source}) must not be negative")
    addr = (addr or "").strip() or None
    if world > 1 and addr is None:
        raise BadInput(
            f"WORLD_SIZE={world} ({source}) but MASTER_ADDR is not set; set MASTER_ADDR (and MASTER_PORT, default {DEFAULT_PORT}) to the address of the rank-0 replica, e.g. in the job's config_map",
        )
    port = _int(env, "MASTER_PORT", DEFAULT_PORT) if addr else None
    if world > 1 and not 0 < port < 65536:
        raise BadInput(f"MASTER_PORT={port} is not a TCP port; use 1..65535 (default {DEFAULT_PORT})")
    return DistEnv(rank, local_rank, world, node_rank, addr, port, source)


def elastic_range() -> tuple[range, str] | None:
    """The replica counts an elastic launcher may restart the job on, and the variable that says so: a PyTorchJob's
    elasticPolicy sets PET_NNODES=MIN:MAX, each node running PET_NPROC_PER_NODE (or LOCAL_WORLD_SIZE) processes."""
    env = os.environ
    nodes = env.get("PET_NNODES", "").strip()
    bounds = re.fullmatch(r"(\d+):(\d+)", nodes)
    per_node = env.get("PET_NPROC_PER_NODE", "").strip() or env.get("LOCAL_WORLD_SIZE", "").strip() or "1"
    if not bounds or not per_node.isdigit():
        return None  # a fixed count, or a value torchrun itself refuses
    low, high, step = int(bounds[1]), int(bounds[2]), int(per_node)
    named = f"PET_NNODES={nodes}" + (f" x {step} processes a node" if step != 1 else "")
    return range(low * step, high * step + 1, step), named


def launcher_argv(argv: list[str] | None = None) -> list[str]:
    """The command line without the `--local_rank=N` the `deepspeed` launcher appends beside LOCAL_RANK=N. One that
    disagrees with LOCAL_RANK, or comes without it, was typed: it stays, and is refused as an unknown flag."""
    args = sys.argv[1:] if argv is None else list(argv)
    local_rank = os.environ.get("LOCAL_RANK", "").strip()
    added = {f"--local_rank={local_rank}", f"--local-rank={local_rank}"} if local_rank else set()
    return [arg for arg in args if arg not in added]


def launcher_options(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Training options `accelerate launch` exports from its config file as ACCELERATE_* variables, which the
    Trainer would follow over the job's own settings (the ones that disagree are refused)."""
    env = os.environ if environ is None else environ
    flag = lambda name: env.get(name, "").strip().lower() in ("1", "true", "yes")  # noqa: E731
    value = lambda name: env.get(name, "").strip().lower() or None  # noqa: E731
    stage = value("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    return {
        "fsdp": flag("ACCELERATE_USE_FSDP"),
        "deepspeed": flag("ACCELERATE_USE_DEEPSPEED"),
        "mixed_precision": value("ACCELERATE_MIXED_PRECISION"),
        # A DEEPSPEED config's stage and offload devices (launchers/accelerate/deepspeed-zero*.yaml)
        "zero_stage": int(stage) if stage and stage.isdigit() else stage,
        "offload_optimizer_device": value("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
        "offload_param_device": value("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
        # deepspeed_config_file: a path, so not lower-cased (DEEPSPEED_CONFIG's stand-in)
        "deepspeed_config_file": env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "").strip() or None,
        # accelerate launch --cpu: Accelerate then drops DeepSpeed without a word (deepspeed_config.check_launcher refuses it)
        "cpu": flag("ACCELERATE_USE_CPU"),
    }


# An accelerate config's DeepSpeed choices, dropped once the settings have adopted them: the Trainer's plugin would
# refuse them beside the job's config.
ACCELERATE_DEEPSPEED_VARIABLES = tuple(
    "ACCELERATE_CONFIG_DS_FIELDS ACCELERATE_DEEPSPEED_ZERO_STAGE ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE "
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH "
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH ACCELERATE_DEEPSPEED_ZERO3_INIT ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL "
    "ACCELERATE_DEEPSPEED_CONFIG_FILE ACCELERATE_GRADIENT_ACCUMULATION_STEPS ACCELERATE_GRADIENT_CLIPPING".split()
)


def export_env(dist: DistEnv, deepspeed: bool = False) -> None:
    """Publish the resolved ranks under the names torch, Accelerate and the Trainer read (env://). `deepspeed`:
    STRATEGY=deepspeed, whose engine asserts LOCAL_RANK is set even on one process."""
    for name in ACCELERATE_DEEPSPEED_VARIABLES:
        os.environ.pop(name, None)
    values = dict(RANK=dist.rank, LOCAL_RANK=dist.local_rank, WORLD_SIZE=dist.world_size, NODE_RANK=dist.node_rank)
    if dist.master_addr:
        values |= {"MASTER_ADDR": dist.master_addr, "MASTER_PORT": dist.master_port}
    if dist.is_distributed:
        os.environ.update({name: str(value) for name, value in values.items()})
    else:
        # A stray RANK="" or LOCAL_RANK="" makes the Trainer crash or wait for peers that never come.
        for name in values:
            if not os.environ.get(name, "").strip():
                os.environ.pop(name, None)
        if deepspeed:
            os.environ["LOCAL_RANK"] = "0"


def masked_environ() -> dict[str, str]:
    """The launcher variables this rank saw, for its log; HF_TOKEN, the one secret among them, shown as set only."""
    keys = (*LAUNCHER_VARIABLES, "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "HF_TOKEN", "HF_TOKEN_PATH")
    return {k: MASK if k == "HF_TOKEN" else os.environ[k] for k in keys if k in os.environ}
