"""Submit the job to Slurm from Python with submitit: N nodes x G GPUs, one task per GPU, requeued on timeout.

    pip install submitit==1.5.4
    python launchers/slurm/submit.py --nodes 2 --gpus-per-node 4 --time 240 --partition gpu -- --num-epochs 1
    python launchers/slurm/submit.py --cluster local --tasks-per-node 2 --wait     # the same submission on this machine

Settings reach every task as environment variables (sbatch hands the submitting shell's environment
on, HF_TOKEN included, so no secret is written into a file) or as main.py flags after `--`. Each task
runs `submitit.helpers.TorchDistributedEnvironment().export()` and then main.py's `main()`: the job sees
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as under torchrun.

Near the time limit submitit signals the tasks, calls `Train.checkpoint` and requeues the same
submission; the requeued job resumes from the newest complete checkpoint in OUTPUT_DIR/checkpoints.
From Python: `submit(settings_argv, nodes=2, gpus_per_node=4, ...)` returns the submitit Job.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import submitit

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from utils.common.errors import JobError  # noqa: E402
from utils.config.sources import load_settings  # noqa: E402


class Train(submitit.helpers.Checkpointable):
    """One task of the job. Checkpointable: on timeout or preemption submitit resubmits this same object."""

    def __init__(self, argv: list[str], repo: str = str(REPO)):
        self.argv = list(argv)
        self.repo = repo  # where main.py lives on the nodes: the same shared checkout

    def __call__(self) -> int:
        # The job picks its GPU as cuda:LOCAL_RANK, so every task keeps all the node's GPUs visible;
        # submitit's default (CUDA_VISIBLE_DEVICES=LOCAL_RANK) would leave local ranks > 0 without theirs.
        # overwrite: the task's own values win over any RANK/MASTER_* inherited from the submitting shell.
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        os.environ["NODE_RANK"] = str(submitit.JobEnvironment().node)  # not exported by submitit; the job logs it
        sys.path.insert(0, self.repo)
        os.chdir(self.repo)
        from main import main

        return main(self.argv)


def submit(
    argv: list[str],
    *,
    folder: str,
    cluster: str | None = None,
    nodes: int = 1,
    gpus_per_node: int = 4,
    tasks_per_node: int | None = None,
    cpus_per_task: int = 4,
    timeout_min: int = 120,
    partition: str | None = None,
    job_name: str = "sst2-lora",
    signal_delay_s: int = 180,
) -> submitit.Job:
    """Queue the job: `tasks_per_node` processes on each node (default: one per GPU)."""
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    parameters = dict(
        name=job_name,
        nodes=nodes,
        tasks_per_node=tasks_per_node or gpus_per_node,
        gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task,
        timeout_min=timeout_min,
        slurm_signal_delay_s=signal_delay_s,  # time to write a checkpoint before the limit
        slurm_additional_parameters={"requeue": True},  # a preempted job goes back to the queue (--requeue)
    )
    if partition:
        parameters["slurm_partition"] = partition
    executor.update_parameters(**parameters)
    return executor.submit(Train(argv))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node (default 4); one task each")
    parser.add_argument(
        "--tasks-per-node",
        type=int,
        default=None,
        help="processes per node (default: --gpus-per-node; on the CPU: give it)",
    )
    parser.add_argument("--cpus-per-task", type=int, default=4)
    parser.add_argument("--time", type=int, default=120, help="time limit in minutes (default 120)")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--job-name", default="sst2-lora")
    parser.add_argument(
        "--cluster",
        default=None,
        choices=("slurm", "local", "debug"),
        help="default: Slurm when sbatch is found, else local",
    )
    parser.add_argument(
        "--folder",
        default=str(REPO / "logs" / "submitit" / "%j"),
        help="submitit's logs and pickles (%%j: the job id)",
    )
    parser.add_argument("--wait", action="store_true", help="wait for the job and exit with its exit code")
    args, job_argv = parser.parse_known_args(argv)
    job_argv = [arg for arg in job_argv if arg != "--"]
    if args.cluster == "local" and args.tasks_per_node is None:
        args.gpus_per_node, args.tasks_per_node = 0, 1  # no GPUs here unless told
    try:
        load_settings(job_argv)  # bad settings fail now, not after the queue wait
    except JobError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code

    job = submit(
        job_argv,
        folder=args.folder,
        cluster=args.cluster,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        timeout_min=args.time,
        partition=args.partition,
        job_name=args.job_name,
    )
    print(f"submitted job {job.job_id}; logs in {job.paths.folder}", file=sys.stderr)
    if not args.wait:
        return 0
    codes = job.results()  # one exit code per task; raises if a task raised
    print(f"job {job.job_id} finished: exit codes {codes}", file=sys.stderr)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
