"""The local backend: the sweep's trials on this machine, `parallel` at a time (one GPU each), each `python main.py`.

The study is OUTPUT_DIR/study.db (Optuna), one trial per run, named by its `trial` user attribute, so a sweep run
again resumes: a COMPLETE trial is never rerun, a RUNNING one is marked FAIL and rerun (the job resumes from its
checkpoint). The trials are `plan_trials`'s, their settings a user attribute, not Optuna parameters: Optuna ties a
parameter to its first value space, so a grown grid could not be recorded. A trial dies with the sweep
(PR_SET_PDEATHSIG) and runs in its own session, so Ctrl-C reaches the sweep alone, which tells each trial once.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import queue
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

from utils.common.errors import EXIT_UNEXPECTED
from utils.run_folder.layout import RunDir
from utils.sweeps.spec import Spec, Trial, describe, job_environment, refused, trial_metric
from utils.sweeps.summary import record_trial

REPO = Path(__file__).resolve().parents[2]
TRIAL_LOG = "trial.log"  # the job's stdout and stderr, appended to by every run of the trial
STUDY = "study.db"


def visible_gpus(environ: dict[str, str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES as set, else what nvidia-smi lists; none on a CPU machine."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if not shutil.which("nvidia-smi"):
        return []
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]


LIVE: set[subprocess.Popen] = set()  # the trials running now
STOPPED: list[int] = []  # the stop signal the sweep got, if one came: no trial starts after it
SIGNAL_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}


def pass_stop_signal(signum, frame) -> None:
    """SIGTERM or Ctrl-C goes on to each running trial (it checkpoints and exits); no trial starts after it."""
    if not STOPPED:
        STOPPED.append(signum)
    for proc in list(LIVE):
        proc.send_signal(signum)


# Looked up now: between fork and exec (preexec_fn) the child runs only this call, taking no lock a thread held.
PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def run_trial(spec: Spec, trial: Trial, gpu: str | None = None) -> tuple[int, float | None]:
    """One run of the job for `trial`, in its folder, announced; its exit code and metric (None unless complete)."""
    print(f"sweep: start {trial.name}{f' on GPU {gpu}' if gpu else ''}: {describe(trial)}", flush=True)
    started = time.monotonic()
    folder = record_trial(spec, trial, status="running", exit_code=None)
    env = job_environment(spec, trial)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    with open(folder / TRIAL_LOG, "a") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "main.py")],
            env=env,  # in this folder, as a user's main.py: relative paths hold
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)) if PRCTL else None,
            start_new_session=True,
        )
        LIVE.add(proc)
        if STOPPED:  # the stop came while this trial was starting: tell it too
            proc.send_signal(STOPPED[0])
        try:
            code = proc.wait()
        finally:
            LIVE.discard(proc)
    value = trial_metric(spec, folder) if code == 0 else None
    record_trial(spec, trial, status="failed" if value is None else "complete", exit_code=code)
    if value is None:
        why = f"exit {code}" if code else f"no {spec.metric_key} in metrics.json"
        print(f"sweep: end {trial.name}: failed ({why}; see {folder / TRIAL_LOG})", flush=True)
    else:
        took = time.monotonic() - started
        print(f"sweep: end {trial.name}: complete, {spec.metric}={value:.4f} ({took:.0f} s)", flush=True)
    return code, value


def run_local(spec: Spec, trials: list[Trial]) -> int:
    # One sweep per output_dir, or a second would rerun the first one's RUNNING trials. An OS lock, not the job's
    # heartbeat lock: a local sweep runs on one host. Opened as the job opens its files: a planted link is refused.
    with RunDir(spec.output_dir).open(spec.output_dir / ".sweep.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise refused(
                f"another sweep is running in {spec.output_dir}; wait for it, or give this one another output_dir"
            ) from None
        return run_study(spec, trials)


def check_study(spec: Spec) -> None:
    """Refuse a study.db SQLite cannot read whole, in one line with the fix: Optuna would end in a traceback."""
    db = spec.output_dir / STUDY
    if not db.exists():
        return
    try:
        with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=30)) as conn:
            verdict = conn.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.Error as exc:
        verdict = str(exc)
    if verdict != "ok":
        raise refused(
            f"{db} is not a database the sweep can read ({verdict[:120]}); restore it, or move it aside to start a "
            "new study: each trial that finished stays complete in its folder (its job finds the run done)"
        )


def open_study(spec: Spec, trials: list[Trial]):
    """The sweep's study, the trials a stopped sweep left running marked failed, and the trials still to run."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name="sweep",  # one study per output_dir, whatever the spec's file is called
        storage=f"sqlite:///{spec.output_dir / STUDY}",
        load_if_exists=True,
        direction=spec.direction,
        sampler=optuna.samplers.RandomSampler(seed=spec.seed),
    )
    for stale in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        print(f"sweep: {stale.user_attrs.get('trial')} was left running by a stopped sweep; running it again")
        study.tell(stale.number, state=TrialState.FAIL)
    done = {t.user_attrs.get("trial") for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}
    todo = [t for t in trials if t.name not in done]
    if done:
        print(f"sweep: {len(done)} trial(s) already complete in {spec.output_dir / STUDY}, {len(todo)} to run")
    return study, todo


def run_study(spec: Spec, trials: list[Trial]) -> int:
    from optuna.trial import TrialState

    signal.signal(signal.SIGTERM, pass_stop_signal)
    signal.signal(signal.SIGINT, pass_stop_signal)
    gpus = visible_gpus(dict(os.environ))
    if gpus and spec.parallel > len(gpus):
        raise refused(f"parallel={spec.parallel} but {len(gpus)} GPU(s) here; set parallel: {len(gpus)}")
    study, todo = open_study(spec, trials)
    ask_lock = threading.Lock()
    slots: queue.Queue = queue.Queue()
    for slot in gpus[: spec.parallel] or [None] * spec.parallel:
        slots.put(slot)

    def run_one(trial: Trial) -> None:
        gpu = slots.get()
        try:
            if STOPPED:
                return
            with ask_lock:
                asked = study.ask()
                asked.set_user_attr("trial", trial.name)
                asked.set_user_attr("params", trial.params)
            _, value = run_trial(spec, trial, gpu)
            with ask_lock:
                study.tell(asked, value, state=TrialState.FAIL if value is None else TrialState.COMPLETE)
        finally:
            slots.put(gpu)

    with ThreadPoolExecutor(max_workers=spec.parallel) as pool:
        list(pool.map(run_one, todo))
    if STOPPED:
        stop = f"stopped by {SIGNAL_NAMES.get(STOPPED[0], STOPPED[0])}: the running trials were told to checkpoint"
        print(f"sweep: {stop} and no other started; run the same command again to resume", file=sys.stderr)
        return 128 + STOPPED[0]
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        print(f"sweep: no trial completed; each trial.log in {spec.output_dir} says why", file=sys.stderr)
        return EXIT_UNEXPECTED
    return 0
