"""Sweep the job's settings: every trial an ordinary run of main.py in OUTPUT_DIR/<trial>, on the engine named
by the spec's `backend` (docs/sweeps.md).

    python sweep.py SPEC.yaml                 # local: run the trials here (a killed sweep resumes); summary at the end
    python sweep.py SPEC.yaml --dry-run       # the trials and their settings, as JSON; nothing runs
    python sweep.py SPEC.yaml                 # slurm: write OUTPUT_DIR/sweep.sbatch (one job array); --submit submits it
    python sweep.py SPEC.yaml --run-trial 3   # one trial by index (what each array task runs)
    python sweep.py SPEC.yaml --summarize     # summary.csv/md/png from the trial folders
    python sweep.py SPEC.yaml -o exp.yaml     # katib: write the Experiment (default: standard output)

A spec that is wrong in any way (an unknown setting or value, an empty grid, a metric the trials will not write,
a bad range) is refused before any trial starts: one `error:` line saying the fix, exit 2. A local sweep in which
no trial completed exits 1; one stopped by SIGTERM or Ctrl-C exits 143 or 130 once its running trials have
checkpointed (run it again to resume).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from utils.common.errors import JobError
from utils.common.hub_token import install_masking
from utils.config.sources import Parser
from utils.sweeps.katib import write_experiment
from utils.sweeps.local import check_study, pass_stop_signal, run_local, run_trial
from utils.sweeps.slurm import render_array
from utils.sweeps.spec import check_sweep_dir, check_trials, claim_sweep_dir, plan_trials, read_spec, refused
from utils.sweeps.summary import collect_rows, write_summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog="sweep.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("spec", type=Path, help="the sweep spec (YAML); examples/sweeps/ has some")
    parser.add_argument("--dry-run", action="store_true", help="print the trials as JSON and exit")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--run-trial", type=int, metavar="I", help="run trial I alone (a Slurm array task)")
    what.add_argument("--summarize", action="store_true", help="write the summary from the trial folders")
    what.add_argument("--submit", action="store_true", help="slurm: submit the rendered array with sbatch")
    parser.add_argument("-o", "--output", type=Path, help="slurm/katib: where to write the script or Experiment")
    return parser.parse_args(argv)


def sweep(args: argparse.Namespace) -> int:
    spec = read_spec(args.spec)
    trials = plan_trials(spec)
    identity = check_trials(spec, trials)
    one = args.run_trial is not None
    if one and not 0 <= args.run_trial < len(trials):
        raise refused(f"--run-trial {args.run_trial}: the sweep has trials 0..{len(trials) - 1}")
    if args.dry_run:
        rows = [{"trial": t.name, "params": t.params, "settings": spec.trial_env(t)} for t in trials]
        # metric_key: where the trials' metrics.json holds the metric
        plan = {k: getattr(spec, k) for k in ("backend", "metric", "metric_key", "direction")} | {"trials": rows}
        print(json.dumps(rows[args.run_trial] if one else plan, indent=2))
        return 0
    if args.output is not None and args.output.is_dir():
        raise refused(f"-o {args.output} is a folder; give the file to write, e.g. -o {args.output}/sweep.yaml")
    if args.submit and spec.backend != "slurm":
        raise refused(f"--submit is for backend: slurm; this spec's backend is {spec.backend}")
    if spec.backend == "katib":  # Katib runs, names and records the trials itself
        if args.summarize or one:
            raise refused(
                f"{'--summarize' if args.summarize else '--run-trial'} reads the trial folders, which Katib names "
                f"itself; a Katib sweep's results are its Experiment's: kubectl get experiment {spec.name} -o yaml "
                "(status.currentOptimalTrial), or the Katib UI"
            )
        write_experiment(spec, len(trials), args.output)
        return 0
    if spec.backend == "slurm" and not one and not args.summarize:
        return write_array(spec, len(trials), identity, args)
    record = check_sweep_dir(spec, identity)  # the trials' folders, records and summary go there
    if not one and not args.summarize:
        check_study(spec)
    claim_sweep_dir(spec, record)  # after every check: a refused start leaves the folder as it was
    if one:
        return run_one_trial(spec, trials[args.run_trial])
    code = 0
    if not args.summarize:
        print(f"sweep: {len(trials)} trial(s) of {spec.path.name} in {spec.output_dir}, {spec.parallel} at a time")
        code = run_local(spec, trials)
    write_summary(spec, trials)
    return code


def write_array(spec, trial_count: int, identity: dict, args: argparse.Namespace) -> int:
    record = check_sweep_dir(spec, identity)
    script = render_array(spec, trial_count)  # before the folder is claimed: a template fault leaves it untouched
    claim_sweep_dir(spec, record)
    path = args.output or spec.output_dir / "sweep.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    path.chmod(0o755)
    if not args.submit:
        print(f"wrote {path} ({trial_count} trials); submit it with: sbatch {path}", file=sys.stderr)
        print(f"then, when the array is done: python sweep.py {args.spec} --summarize", file=sys.stderr)
        return 0
    if not shutil.which("sbatch"):
        raise refused(f"--submit: no sbatch here; run it on a Slurm login node, or `sbatch {path}` there")
    return subprocess.run(["sbatch", str(path)], check=False).returncode


def run_one_trial(spec, trial) -> int:
    """One trial; SIGTERM (Slurm's time limit) and Ctrl-C are passed on, so the job checkpoints."""
    (row,) = collect_rows(spec, [trial])
    if row.status == "complete":  # an array run again: what finished stays as it is
        print(f"sweep: {trial.name} is already complete, {spec.metric}={row.value:.4f}; not run again", flush=True)
        return 0
    signal.signal(signal.SIGTERM, pass_stop_signal)
    signal.signal(signal.SIGINT, pass_stop_signal)
    return run_trial(spec, trial)[0]


def main(argv: list[str] | None = None) -> int:
    try:
        install_masking()  # the token, in any form, never shown: a spec value may hold it, as a refusal quotes it
        return sweep(parse_args(argv))
    except JobError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:  # Ctrl-C before the trials' handler is in place: nothing started to stop
        print("sweep: interrupted (Ctrl-C) before any trial started", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
