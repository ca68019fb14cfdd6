"""The slurm backend: the sweep as one job array rendered from launchers/slurm/sweep.sbatch.template. Task I runs
`python sweep.py SPEC --run-trial I`, trial I of `plan_trials` as every task computes it: no shared study.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from utils.sweeps.spec import CONTROL, Spec, refused

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "launchers" / "slurm" / "sweep.sbatch.template"
PLACEHOLDER = re.compile(r"@([A-Z_]+)@")


def fill_template(template: Path, values: dict[str, str]) -> str:
    """`template`'s text with each @NAME@ replaced by values[NAME] (launchers/slurm/render_sbatch.py's too)."""
    text = template.read_text()
    if missing := sorted(set(PLACEHOLDER.findall(text)) - set(values)):  # never a literal @NAME@ on the cluster
        raise RuntimeError(f"template placeholders without a value: {missing}")
    return PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


def render_array(spec: Spec, trial_count: int) -> str:
    opts = spec.slurm
    out = spec.output_dir
    venv = Path(opts.venv).resolve() if opts.venv else REPO / ".venv"
    log_dir = Path(opts.log_dir).resolve() if opts.log_dir else out / "slurm"
    # Quoting keeps a space or a `$(...)` a word of the script; a newline would still end a comment or an #SBATCH
    # line and start a shell line of its own, so a path holding a control character is refused.
    paths = {"the spec's path": spec.path.resolve(), "output_dir": out, "slurm.venv": venv, "slurm.log_dir": log_dir}
    for key, path in {**paths, "the checkout": REPO}.items():
        if CONTROL.search(str(path)):
            raise refused(f"{key} {str(path)!r} holds a control character (a newline, a tab); use a path without one")
    values = {
        "SPEC": shlex.quote(str(spec.path.resolve())),
        "OUTPUT_DIR": shlex.quote(str(out)),
        "JOB_NAME": shlex.quote(spec.name),  # sbatch reads quotes in #SBATCH lines as a shell does
        "LAST_INDEX": str(trial_count - 1),
        "PARALLEL": str(spec.parallel),
        "GPUS_LINE": f"#SBATCH --gpus-per-task={opts.gpus}" if opts.gpus else "# (gpus: 0, trials run on the CPU)",
        "GPUS_LINE_NOTE": f"{opts.gpus} GPU(s)" if opts.gpus else "the CPU",
        "CPUS_PER_TASK": str(opts.cpus_per_task),
        "TIME": opts.time,
        "PARTITION_LINE": f"#SBATCH --partition={opts.partition}"  # a checked name: nothing to quote
        if opts.partition
        else "# (no partition: the cluster's default partition)",
        "SIGNAL_LEAD": str(opts.signal_lead),
        "LOG_DIR": shlex.quote(str(log_dir)),
        "WORKDIR": shlex.quote(str(REPO)),
        "ACTIVATE": f"source {shlex.quote(str(venv / 'bin' / 'activate'))}",
    }
    return fill_template(TEMPLATE, values)
