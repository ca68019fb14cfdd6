"""A sweep's spec (SPEC.yaml) and its trials: read, checked against the job's own settings, planned.

Every trial is planned before the first one starts, the same way on every backend: a grid is the product of
its lists in the order the spec writes them; a random search is `trials` draws of Optuna's RandomSampler
seeded with the spec's `seed`. So trial-003 is the same settings whether the local runner, a Slurm array
index or `--dry-run` names it. Grid and random in one spec are refused: a grid point is a trial, so the
grid's product times `trials` draws would be a sweep of a size nobody asked for; sweep the grid's lists as
`random` choices instead, or run two sweeps.

Imports nothing heavy (Optuna only for random draws, PyYAML, the settings module).
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from utils.errors import EXIT_BAD_INPUT, JobError
from utils.settings import FIELDS, SECRET_SETTINGS, env_name, load_settings
from utils.tasks import CLASSIFICATION, LOWER_IS_BETTER, REGRESSION, eval_prefix, reported_metrics
from utils.tasks import validation_splits as task_splits

BACKENDS = ("local", "slurm", "katib")
# Each trial is a training run, and Slurm's default MaxArraySize (1001) takes array indexes 0-1000: a bigger
# sweep is a typo (trials: 100000000) or a grid nobody means to pay for.
MAX_TRIALS = 1000
SPEC_MAX_BYTES = 1 << 20  # a spec is a page of YAML; more is the wrong file (and /dev/zero never ends)
# The Hub repos a run pushes to: a trial pushes only where the spec's `push:` says, never to a repo from the shell,
# the recipe or `settings:` (every trial would push over the last one).
HUB_DESTINATIONS = ("RESULT_MODEL_ID", "RESULT_MERGED_MODEL_ID")
# YAML 1.1 reads 1e-3 as a string (it wants 1.0e-3); a sweep means the number. Only that form: a quoted "001"
# stays the text it is.
EXPONENT_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
SWEEP_RECORD = "sweep.json"  # in output_dir: the sweep's identity, and its claim on the folder
# The sweep owns these: every trial gets its own folder, and pushes only when the spec says so.
OWNED = {
    "output_dir": "output_dir (at the top of the spec)",
    "result_model_id": "push: OWNER/NAME",
    "result_merged_model_id": "push: OWNER/NAME (each trial pushes its adapter; no merged model is pushed)",
}
RANGE_KEYS = {"low", "high", "log", "type"}


def refused(message: str) -> JobError:
    return JobError(EXIT_BAD_INPUT, message)


class SpecKeys(BaseModel):
    """The spec's keys, each of its type and range (strict: `true` is no count, `"8"` no number); each description
    is the fix its refusal names. The rules across keys, the settings and the search space are read_spec's."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = Field(None, min_length=1, description="name the sweep, e.g. name: lr-rank")
    settings: dict | None = Field(None, description="settings: is a mapping of setting name to value")
    config: str | None = Field(None, min_length=1, description="config: is the path of a recipe file")
    grid: dict | None = Field(None, description="grid: is a mapping of setting name to a list of values")
    random: dict | None = Field(None, description="random: is a mapping of setting name to a list or a range")
    trials: int | None = Field(None, ge=1, le=MAX_TRIALS, description=f"trials: is how many draws, 1 to {MAX_TRIALS}")
    seed: int = Field(
        0, ge=0, lt=2**32, description=f"the draws' seed is a whole number, 0 to {2**32 - 1}, e.g. seed: 0"
    )
    metric: str = Field("accuracy", min_length=1, description="name a key of the trials' metrics.json")
    direction: Literal["maximize", "minimize"] | None = Field(None, description="use maximize or minimize")
    parallel: int = Field(1, ge=1, description="give how many trials run at once, at least 1")
    backend: Literal["local", "slurm", "katib"] = Field("local", description=f"use one of {', '.join(BACKENDS)}")
    output_dir: str = Field(min_length=1, description="set it to the folder for the trials and the summary")
    push: str | bool = Field(
        False, description="write push: OWNER/NAME (trial-003 pushes to OWNER/NAME-trial-003) or push: false"
    )
    slurm: dict | None = Field(None, description="slurm: is a mapping of the array's options")
    katib: dict | None = Field(None, description="katib: takes no keys")


def check_keys(path: Path, raw: dict) -> SpecKeys:
    """The spec's keys by SpecKeys; the first thing wrong is one refusal naming the key, the value and the fix."""
    try:
        return SpecKeys.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = str(error["loc"][0]) if error["loc"] else ""
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, list(SpecKeys.model_fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise refused(
                f"{path}: unknown key {key!r}{hint}; a spec takes {', '.join(SpecKeys.model_fields)}"
            ) from None
        fix = SpecKeys.model_fields[key].description
        if error["type"] == "missing":
            raise refused(f"{path}: {key} is missing; {fix}") from None
        raise refused(f"{key}={error['input']!r} is invalid: {error['msg']}; {fix}") from None


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    log: bool = False
    is_int: bool = False


@dataclass(frozen=True)
class Trial:
    index: int
    name: str  # trial-000: also its folder under output_dir
    params: dict  # swept setting (lower snake) -> value, as the spec or the sampler gave it

    def env(self) -> dict[str, str]:
        return {env_name(name): setting_value(value) for name, value in self.params.items()}


@dataclass
class Spec:
    path: Path
    name: str
    output_dir: Path
    settings: dict[str, str] = field(default_factory=dict)  # ENV_NAME -> value, fixed for every trial
    config: str | None = None
    grid: dict[str, list] = field(default_factory=dict)
    random: dict[str, list | Range] = field(default_factory=dict)
    trials: int | None = None
    seed: int = 0
    metric: str = "accuracy"
    metric_key: str = "eval_accuracy"  # where metrics.json holds `metric` for this sweep's task (check_trials)
    metric_keys: tuple[str, ...] = ()  # every metric metrics.json holds for it, as eval_<name>
    metric_splits: tuple[str, ...] = ()  # the metric on each validation split (MNLI: matched, mismatched)
    direction: str = "maximize"
    parallel: int = 1
    backend: str = "local"
    push: str | None = None  # the Hub repo trials push to as <repo>-<trial>; None: no trial pushes
    slurm: dict = field(default_factory=dict)
    katib: dict = field(default_factory=dict)

    @property
    def swept(self) -> list[str]:
        return [*self.grid, *self.random]

    def is_log(self, name: str) -> bool:
        space = self.random.get(name)
        return isinstance(space, Range) and space.log

    def trial_env(self, trial: Trial, output_dir: Path | str | None = None) -> dict[str, str]:
        """The settings one trial runs with, as the environment of its `python main.py`."""
        env = dict(self.settings)
        if self.config:
            env["CONFIG_FILE"] = self.config
        env.update(trial.env())
        env["OUTPUT_DIR"] = str(Path(output_dir or self.output_dir) / trial.name)
        if self.push:
            env["RESULT_MODEL_ID"] = f"{self.push}-{trial.name}"
        return env


def setting_value(value) -> str:
    """A YAML value as the job reads it from the environment."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(setting_value, value))
    return str(value)


def yaml_number(value):
    """1e-3 as the number YAML 1.1 did not read it as; every other value as written."""
    return float(value) if isinstance(value, str) and EXPONENT_NUMBER.match(value.strip()) else value


def swept_values(where: str, values: list) -> list:
    """A list of a grid or of random choices: each value as the job reads it, none twice (two trials would be one)."""
    values = [setting_value(v) if isinstance(v, list) else yaml_number(v) for v in values]
    seen: dict[str, object] = {}
    for value in values:
        if setting_value(value) in seen:
            raise refused(
                f"{where}: {seen[setting_value(value)]!r} and {value!r} are the same setting to the job "
                f"({setting_value(value)}); list each value once"
            )
        seen[setting_value(value)] = value
    return values


def setting_name(name: str, where: str) -> str:
    """`learning_rate` or `LEARNING_RATE` -> learning_rate; an unknown name is refused with the closest one."""
    field_name = str(name).strip().lower()
    if field_name in OWNED:
        raise refused(f"{where}: {name} is set by the sweep; use {OWNED[field_name]}")
    if field_name == "config_file":
        raise refused(f"{where}: {name} is the spec's `config:` key; write `config: FILE.yaml` at the top of the spec")
    if field_name not in FIELDS:
        close = difflib.get_close_matches(field_name, list(FIELDS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise refused(
            f"{where}: {name} is not a setting of the job{hint}; `python main.py --help` lists them (lower_snake or UPPER names)"
        )
    return field_name


def parse_range(name: str, space: dict) -> Range:
    where = f"random.{name}"
    unknown = set(space) - RANGE_KEYS
    if unknown or not {"low", "high"} <= set(space):
        raise refused(f"{where}: a range is {{low, high, log: true|false, type: int|float}}; got keys {sorted(space)}")
    low, high = yaml_number(space["low"]), yaml_number(space["high"])
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high)):
        raise refused(f"{where}: low and high must be numbers, got low={low!r} high={high!r}")
    kind = space.get("type", "int" if isinstance(low, int) and isinstance(high, int) else "float")
    if kind not in ("int", "float"):
        raise refused(f"{where}: type={kind!r}; use type: int or type: float")
    log = space.get("log", False)
    if not isinstance(log, bool):
        raise refused(f"{where}: log={log!r}; use log: true or log: false")
    if low >= high:
        raise refused(f"{where}: low={low} is not below high={high}; write the smaller value as low")
    if log and low <= 0:
        raise refused(f"{where}: a log range needs low > 0, got low={low}; use e.g. low: 1e-5")
    if kind == "int" and not all(float(v).is_integer() for v in (low, high)):
        raise refused(f"{where}: an int range needs whole numbers, got low={low} high={high}; use type: float")
    number = int if kind == "int" else float
    return Range(number(low), number(high), log, kind == "int")


def read_spec_text(path: Path) -> str:
    """The spec file's text. Non-blocking and regular files only: a FIFO would wait for a writer for ever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise refused(f"no sweep spec at {path}; give the path of a SPEC.yaml (examples/sweeps/ has some)") from None
    except OSError as exc:
        raise refused(f"cannot read the sweep spec {path} ({exc.strerror}); give a readable SPEC.yaml") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refused(f"{path} is not a regular file; give the path of a SPEC.yaml (examples/sweeps/ has some)")
    with os.fdopen(fd, "rb") as handle:
        try:
            raw = handle.read(SPEC_MAX_BYTES + 1)
        except OSError as exc:
            raise refused(f"cannot read the sweep spec {path} ({exc.strerror}); give a readable SPEC.yaml") from None
    if len(raw) > SPEC_MAX_BYTES:
        raise refused(f"{path} holds more than {SPEC_MAX_BYTES} bytes, not a sweep spec; give a SPEC.yaml")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refused(f"{path} is not UTF-8 text (byte at offset {exc.start}); a sweep spec is YAML") from None


def read_spec(path: Path) -> Spec:
    """Read and check a spec; everything wrong with it is a JobError (exit 2) that says the fix."""
    try:
        raw = yaml.safe_load(read_spec_text(path))
    except yaml.YAMLError as exc:
        raise refused(f"{path} is not valid YAML ({str(exc).splitlines()[0]}); fix the file") from None
    if not isinstance(raw, dict):
        raise refused(f"{path}: a sweep spec is a mapping (settings, grid, random, metric, ...); see docs/sweeps.md")
    keys = check_keys(path, raw)
    spec = Spec(path=path, name=keys.name or path.stem, output_dir=Path(keys.output_dir), config=keys.config)
    spec.settings = {env_name(setting_name(k, "settings")): setting_value(v) for k, v in (keys.settings or {}).items()}
    for name, values in (keys.grid or {}).items():
        key = setting_name(name, "grid")
        if not isinstance(values, list) or not values:
            raise refused(f"grid.{name}: an empty grid; give a list of at least one value, e.g. {name}: [1, 2]")
        spec.grid[key] = swept_values(f"grid.{name}", values)
    if keys.grid is not None and not spec.grid:
        raise refused("grid: an empty grid; give each swept setting a list, e.g. grid: {learning_rate: [1e-4, 3e-4]}")
    for name, space in (keys.random or {}).items():
        key = setting_name(name, "random")
        if isinstance(space, list):
            if not space:
                raise refused(f"random.{name}: an empty list; give the values to draw from, or a range {{low, high}}")
            spec.random[key] = swept_values(f"random.{name}", space)
        elif isinstance(space, dict):
            spec.random[key] = parse_range(name, space)
        else:
            raise refused(f"random.{name}: give a list of values or a range {{low, high, log, type}}, got {space!r}")
    if keys.random is not None and not spec.random:
        raise refused("random: empty; give each drawn setting a list or a range {low, high, log, type}")
    if spec.grid and spec.random:
        raise refused(
            "grid and random in one spec: give the grid's settings as random lists (drawn with the rest), or run two sweeps"
        )
    if not spec.grid and not spec.random:
        raise refused(f"{path}: nothing to sweep; add grid: (lists) or random: (lists or ranges) with trials:")
    for key in spec.swept:
        if env_name(key) in spec.settings:
            raise refused(f"{key} is both fixed (settings) and swept; remove it from settings")

    if spec.random:
        if keys.trials is None:
            raise refused(f"random search needs trials: N (how many draws, 1 to {MAX_TRIALS}), got trials=None")
        spec.trials = keys.trials
    elif keys.trials is not None:
        raise refused("trials: is for random search; a grid runs every point once, remove trials:")
    else:
        size = math.prod(len(values) for values in spec.grid.values())
        if size > MAX_TRIALS:
            raise refused(f"grid: {size} points, more than {MAX_TRIALS} trials; sweep fewer values, or draw random:")
    spec.seed, spec.parallel, spec.backend = keys.seed, keys.parallel, keys.backend
    spec.metric = keys.metric.strip().removeprefix("eval_")  # checked against the task's metrics by check_trials
    lower = spec.metric.rsplit("_", 1)[-1] in {"loss", *LOWER_IS_BETTER}
    spec.direction = keys.direction or ("minimize" if lower else "maximize")
    if spec.backend != "katib":  # a folder here (katib's is a path in the pods)
        spec.output_dir = spec.output_dir.resolve()
        if spec.output_dir.exists() and not spec.output_dir.is_dir():
            raise refused(f"output_dir={spec.output_dir} is a file; give a folder for the trials and the summary")
    push = keys.push
    if push is True:
        push = os.environ.get("RESULT_MODEL_ID", "")
        if not push:
            raise refused("push: true reads the Hub repo from RESULT_MODEL_ID, which is unset; write push: OWNER/NAME")
    if push == "":
        raise refused(f"push=''; {SpecKeys.model_fields['push'].description}")
    spec.push = push or None
    spec.slurm, spec.katib = keys.slurm or {}, keys.katib or {}
    return spec


def plan_trials(spec: Spec) -> list[Trial]:
    """Every trial of the sweep, in order, named trial-000, trial-001, ..."""
    if spec.grid:
        points = [dict(zip(spec.grid, values, strict=True)) for values in itertools.product(*spec.grid.values())]
    else:
        points = draw_random(spec)
    width = max(3, len(str(len(points) - 1)))
    return [Trial(i, f"trial-{i:0{width}d}", params) for i, params in enumerate(points)]


def distributions(spec: Spec) -> dict:
    """Each swept setting as an Optuna distribution: a list (grid or random) is categorical, a range is
    a float or int range, log-scaled when the spec says so."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    found = {}
    for name, space in {**spec.grid, **spec.random}.items():
        if isinstance(space, Range):
            kind = IntDistribution if space.is_int else FloatDistribution
            found[name] = kind(space.low, space.high, log=space.log)
        else:
            found[name] = CategoricalDistribution(space)
    return found


def draw_random(spec: Spec) -> list[dict]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spaces = distributions(spec)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=spec.seed))
    points = []
    for _ in range(spec.trials or 0):
        params = study.ask(spaces).params
        # three significant digits, kept in range: readable in records and tables, and what the trial ran with
        for name, value in params.items():
            if isinstance(value, float) and isinstance(spec.random[name], Range):
                params[name] = min(max(float(f"{value:.3g}"), spec.random[name].low), spec.random[name].high)
        points.append(params)
    return points


def job_environment(spec: Spec, trial: Trial, environ: dict[str, str]) -> dict[str, str]:
    """The environment of one trial's `python main.py`: this shell's (the job reads its setting variables too),
    less the Hub repos (a trial pushes only where the spec's `push:` says), with the trial's settings over it. The
    check, the sweep's identity and the run all take it from here."""
    env = {name: value for name, value in environ.items() if name not in HUB_DESTINATIONS}
    env.update(spec.trial_env(trial))
    return env


def check_trials(spec: Spec, trials: list[Trial], environ: dict[str, str] | None = None) -> dict:
    """Resolve each trial's settings with the job's own model, as its main.py will: a bad value stops the sweep
    before any trial starts; so does a Hub repo from the recipe (nothing is pushed unless `push:` says) and a metric
    the trials' metrics.json will not hold (it sets `spec.metric_key`, where that file holds it).

    Returns the sweep's identity: every input that makes a trial's settings (each trial's setting variables, this
    shell's among them, and the recipe's content), which `open_sweep_dir` keeps with the trials' folders."""
    environ = os.environ if environ is None else environ
    found: dict[str, dict[str, str]] = {}
    keys: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for trial in trials:
        env = {k: v for k, v in job_environment(spec, trial, environ).items() if k.lower() in FIELDS}
        try:
            settings, _ = load_settings([], environ=env)
        except JobError as exc:
            raise refused(f"{trial.name} ({describe(trial)}): {exc.message}") from None
        for name in HUB_DESTINATIONS:
            value = getattr(settings, name.lower())
            if value and value != spec.trial_env(trial).get(name):
                raise refused(
                    f"CONFIG_FILE={spec.config} sets {name.lower()}: {value}, so every trial would push to it, each over "
                    "the last; remove it from the recipe (write push: OWNER/NAME in the spec to push each trial)"
                )
        names = metric_names(settings)
        key = metric_key(settings, spec.metric, names)
        keys[key] = (names, on_each_split(settings, key))
        found[trial.name] = {k: v for k, v in sorted(env.items()) if k.lower() not in SECRET_SETTINGS}
    if len(keys) > 1:
        raise refused(
            f"metric={spec.metric}: the trials write it under different names ({', '.join(keys)}); sweep one task"
        )
    ((key, (names, splits)),) = keys.items()
    spec.metric_key, spec.metric_keys = f"eval_{key}", tuple(f"eval_{name}" for name in names)
    spec.metric_splits = splits
    recipe = None
    if spec.config:  # read by the job's recipe reader above: a regular file of a page at most
        recipe = {
            "path": spec.config,
            "sha256": hashlib.sha256(Path(spec.config).expanduser().read_bytes()).hexdigest(),
        }
    return {"trials": found, "recipe": recipe}


def metric_names(settings) -> tuple[str, ...]:
    """What a run with these settings writes to metrics.json, less `eval_`: its task's metrics on each validation split
    (MNLI's as matched_accuracy, mismatched_accuracy, ...) and each split's loss. Without TASK or PROBLEM_TYPE the data
    decides classification or regression, so either problem's metrics may be named."""
    problems = (settings.problem_type,) if settings.problem_type != "auto" else (CLASSIFICATION, REGRESSION)
    names = [name for problem in problems for name in reported_metrics(settings, problem)]
    names += [f"{prefix}_loss" if prefix else "loss" for prefix in map(eval_prefix, task_splits(settings))]
    return tuple(dict.fromkeys(names))


def metric_key(settings, metric: str, names: tuple[str, ...]) -> str:
    """The spec's `metric` as metrics.json names it (less `eval_`). A name without a split, on a task evaluated on
    several (MNLI), means the first split's: `accuracy` is `matched_accuracy`, the metric the job tracks as best
    (`metric_for_best_model`)."""
    first = eval_prefix(task_splits(settings)[0])
    for name in (metric, f"{first}_{metric}" if first else metric):
        if name in names:
            return name
    close = difflib.get_close_matches(metric, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    task = f"TASK={settings.task}" if settings.task else f"PROBLEM_TYPE={settings.problem_type}"
    raise refused(f"metric={metric!r} is not a metric the trials write ({task}){hint}; use one of {', '.join(names)}")


def on_each_split(settings, key: str) -> tuple[str, ...]:
    """The metric `key` (less `eval_`) on every validation split, as metrics.json names it: MNLI's
    `matched_accuracy` -> eval_matched_accuracy, eval_mismatched_accuracy."""
    prefixes = [eval_prefix(split) for split in task_splits(settings)]
    base = next((key.removeprefix(f"{p}_") for p in prefixes if p and key.startswith(f"{p}_")), key)
    return tuple(f"eval_{p}_{base}" if p else f"eval_{base}" for p in prefixes)


def describe(trial: Trial) -> str:
    return " ".join(f"{env_name(k)}={setting_value(v)}" for k, v in trial.params.items())


def metric_value(metrics: dict, key: str) -> float | None:
    """The sweep's metric from a trial's metrics.json (`key` as `spec.metric_key` names it), if it is a number."""
    value = metrics.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


# ------------------------------------------------------------------------------- the sweep's folder
def open_sweep_dir(spec: Spec, identity: dict) -> None:
    """Claim output_dir for this sweep: a new or empty folder, or this same sweep's (its sweep.json holds the same
    recipe and, for every trial both name, the same settings; more random draws of the same seed extend it, as
    more trials extend an Optuna study). A folder another tool wrote is refused untouched, as main.py refuses one
    for OUTPUT_DIR (the sweep replaces files in its trials' folders and its summary); another sweep's is refused
    too, so a resume, a `--run-trial` or a summary never shows a result under values it was not trained with."""
    out = spec.output_dir
    record = out / SWEEP_RECORD
    fix = "give this spec a new output_dir, or restore the spec, recipe and setting variables the sweep was made with"
    if record.is_file():
        try:
            theirs = json.loads(record.read_text())
        except (OSError, ValueError) as exc:
            raise refused(f"{record} cannot be read ({exc}); {fix}") from None
        if change := identity_change(theirs, identity):
            raise refused(f"{out} holds another sweep ({change}); {fix}")
        # every trial ever planned here stays recorded: a later spec naming it again is checked against it
        known = {"trials": {**theirs["trials"], **identity["trials"]}, "recipe": identity["recipe"]}
        if known != theirs:
            write_sweep_record(record, known)
        return
    ours = {SWEEP_RECORD, ".sweep.lock", "lost+found"}
    names = (
        sorted(n for n in os.listdir(out) if n not in ours and not n.startswith(f".{SWEEP_RECORD}"))
        if out.is_dir()
        else []
    )
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise refused(
            f"output_dir={out} is not empty and is not a folder of this sweep (it holds {shown}, and no {SWEEP_RECORD}); "
            "the sweep deletes and replaces files in its folders, so it leaves this one untouched: use an empty or new folder"
        )
    write_sweep_record(record, identity)


def write_sweep_record(record: Path, identity: dict) -> None:
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{SWEEP_RECORD}.{os.getpid()}")
        tmp.write_text(json.dumps(identity, indent=2) + "\n")
        tmp.replace(record)
    except OSError as exc:
        raise refused(f"output_dir={record.parent} is not writable ({exc.strerror}); give a writable folder") from None


def identity_change(theirs: dict, ours: dict) -> str | None:
    """The first input that differs between a sweep's recorded identity and this spec's, as the user would fix it;
    None when they are the same sweep."""
    if theirs.get("recipe") != ours["recipe"]:
        old, new = theirs.get("recipe") or {}, ours["recipe"] or {}
        return (
            f"its recipe was {old.get('path')} (sha256 {str(old.get('sha256'))[:12]}), "
            f"now {new.get('path')} (sha256 {str(new.get('sha256'))[:12]})"
        )
    old_trials = theirs.get("trials", {})
    for name, new in ours["trials"].items():
        old = old_trials.get(name)
        if old is not None and old != new:
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))[:4]
            was = ", ".join(f"{k}={old.get(k, '<unset>')}" for k in changed)
            now = ", ".join(f"{k}={new.get(k, '<unset>')}" for k in changed)
            return f"{name} ran with {was}; now {now}"
    return None
