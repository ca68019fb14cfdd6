"""Render the Slurm batch script for N nodes x G GPUs from launchers/slurm/train.sbatch.template.

    python launchers/slurm/render_sbatch.py --nodes 2 --gpus-per-node 4 --time 04:00:00 --partition gpu \
        --venv /shared/venvs/sst2 --set RESULT_MODEL_ID=me/bert-sst2-lora -o sst2.sbatch
    HF_TOKEN=hf_... sbatch sst2.sbatch [main.py flags]

    # in a container (pyxis/enroot's `srun --container-image`), the shared folder mounted at /pvc-home:
    python launchers/slurm/render_sbatch.py --nodes 2 --gpus-per-node 4 --container registry/sst2-lora:1.0 \
        --shared-dir /lustre/me/sst2 -o sst2.sbatch

Job settings are given as `--set NAME=VALUE` (any `python main.py --help` setting, plus library
variables such as HF_HOME) and checked here, so a typo fails now rather than after hours in the queue: a name
that is no setting but is spelt like one (LORA_RR) is refused with the setting it probably means.
The Hub token is refused: a batch script is stored in Slurm's spool; export HF_TOKEN when submitting.
Imports nothing heavy (the settings and the sweep's template filler).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from utils.common.errors import JobError  # noqa: E402
from utils.config.distributed import SLURM_TIME_LIMIT  # noqa: E402
from utils.config.settings import FIELDS, SHARED_VOLUME, env_name  # noqa: E402
from utils.config.sources import find_misspelled_variables, load_settings  # noqa: E402
from utils.sweeps.slurm import fill_template  # noqa: E402

TEMPLATE = Path(__file__).with_name("train.sbatch.template")
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
SECRETS = ("HF_TOKEN",)
CONTAINER_WORKDIR = "/app"  # the Dockerfile's WORKDIR: main.py lives there in the image


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1, help="nodes to allocate (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node; one task per GPU (default 4)")
    parser.add_argument(
        "--cpus-per-task", type=int, default=4, help="cores per task: data loading and tokenizing (default 4)"
    )
    parser.add_argument(
        "--time",
        default="02:00:00",
        help="time limit, Slurm format (default 02:00:00: one epoch of SST-2 takes minutes)",
    )
    parser.add_argument("--partition", default=None, help="partition; unset: the cluster's default")
    parser.add_argument("--job-name", default="sst2-lora")
    parser.add_argument(
        "--signal-lead",
        type=int,
        default=180,
        help="seconds before the time limit to checkpoint and requeue (default 180)",
    )
    runtime = parser.add_mutually_exclusive_group()
    runtime.add_argument(
        "--venv", default=None, help="virtual environment on the shared filesystem to activate (default: REPO/.venv)"
    )
    runtime.add_argument(
        "--container",
        default=None,
        help="image for pyxis/enroot (srun --container-image); the job runs /app/main.py in it",
    )
    parser.add_argument(
        "--workdir", default=str(REPO), help="checkout of this repository on the shared filesystem (default: this one)"
    )
    parser.add_argument(
        "--shared-dir",
        default=None,
        help="with --container (required there): host folder every node sees, mounted at /pvc-home (OUTPUT_DIR defaults under it)",
    )
    parser.add_argument("--log-dir", default=None, help="Slurm's own logs, one per task (default: WORKDIR/logs/slurm)")
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a job setting, exported to every task",
    )
    parser.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    return parser.parse_args(argv)


def check_settings(pairs: list[str]) -> dict[str, str]:
    """NAME=VALUE pairs -> dict; setting names and values are validated by the job's own settings model."""
    values: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not ENV_NAME.match(name):
            raise JobError(2, f"--set {pair!r} is not NAME=VALUE with an UPPER_SNAKE name, e.g. --set NUM_EPOCHS=2")
        if name in SECRETS:
            raise JobError(
                2,
                f"--set {name} would write a secret into the batch script; export {name} in the shell that runs sbatch, or set HF_TOKEN_PATH",
            )
        values[name] = value
    # The job's own test for a misspelt variable (it warns: its environment holds other programs' too); a name
    # written into a batch script is meant for the job, so here it is refused.
    for name, setting in find_misspelled_variables(values):
        raise JobError(
            2,
            f"--set {name}: {name} is not a setting of the job (did you mean {setting}?); fix the name "
            "(`python main.py --help` lists the settings)",
        )
    known = {env_name(field) for field in FIELDS}
    # raises JobError with the fix
    load_settings([], environ={name: value for name, value in values.items() if name in known})
    return values


def render(args: argparse.Namespace) -> str:
    for name in ("nodes", "gpus_per_node", "cpus_per_task", "signal_lead"):
        if getattr(args, name) < 1:
            raise JobError(2, f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if not SLURM_TIME_LIMIT.fullmatch(args.time):
        raise JobError(2, f"--time={args.time} is not a Slurm time limit; use minutes, HH:MM:SS or D-HH:MM:SS")
    if args.shared_dir and not args.container:
        raise JobError(
            2, "--shared-dir is for --container (it is mounted at /pvc-home); with --venv set OUTPUT_DIR via --set"
        )
    if args.container and not args.shared_dir:
        raise JobError(
            2,
            "--container needs --shared-dir: a folder every node sees, mounted at /pvc-home (checkpoints, model and logs go there)",
        )
    settings = check_settings(args.settings)
    workdir = Path(args.workdir).resolve()
    log_dir = Path(args.log_dir).resolve() if args.log_dir else workdir / "logs" / "slurm"

    if args.container:
        mounts = f"{shlex.quote(str(Path(args.shared_dir).resolve()))}:{SHARED_VOLUME}"
        srun_extra = f"--container-image={shlex.quote(args.container)} --container-workdir={CONTAINER_WORKDIR} --container-mounts={mounts} "
        activate = "# the container brings its own Python and packages (srun --container-image below)"
        python = f"python {CONTAINER_WORKDIR}/main.py"
        settings.setdefault("OUTPUT_DIR", f"{SHARED_VOLUME}/output")
    else:
        venv = Path(args.venv).resolve() if args.venv else workdir / ".venv"
        srun_extra = ""
        activate = f"source {shlex.quote(str(venv / 'bin' / 'activate'))}"
        python = "python main.py"
        settings.setdefault("OUTPUT_DIR", str(workdir / "output"))  # every node sees the checkout: a shared filesystem

    values = {
        "JOB_NAME": args.job_name,
        "NODES": str(args.nodes),
        "GPUS_PER_NODE": str(args.gpus_per_node),
        "CPUS_PER_TASK": str(args.cpus_per_task),
        "TIME": args.time,
        "PARTITION_LINE": f"#SBATCH --partition={args.partition}"
        if args.partition
        else "# (no --partition: the cluster's default partition)",
        "SIGNAL_LEAD": str(args.signal_lead),
        "LOG_DIR": shlex.quote(str(log_dir)),
        "WORKDIR": shlex.quote(str(workdir)),
        "ACTIVATE": activate,
        "SETTINGS": "\n".join(f"export {name}={shlex.quote(value)}" for name, value in sorted(settings.items())),
        "SRUN_EXTRA": srun_extra,
        "PYTHON": python,
    }
    return fill_template(TEMPLATE, values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        script = render(args)
    except JobError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code
    if args.output == "-":
        sys.stdout.write(script)
    else:
        Path(args.output).write_text(script)
        Path(args.output).chmod(0o755)
        print(f"wrote {args.output}; submit it with: sbatch {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
