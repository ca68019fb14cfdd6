"""A sweep's spec (SPEC.yaml) and its trials: read, checked against the job's own settings, planned.

Every trial is planned before the first starts, alike on every backend (a grid's product in the spec's order, or seeded
random draws), so trial-003 is the same settings whether the local runner, a Slurm array index or `--dry-run` names it.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import os
import re
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass

from utils.common.errors import BadInput, JobError, first_line
from utils.common.hub_token import UnfitFile, read_small_text
from utils.config.distributed import SLURM_TIME_LIMIT
from utils.config.identity import identity_changes, sha256_file
from utils.config.plan import build_plan
from utils.config.preflight import check_push_possible
from utils.config.settings import FIELDS, env_name
from utils.config.sources import _KeyTwice, _unique_key_loader, load_settings
from utils.config.tasks import CLASSIFICATION, LOWER_IS_BETTER, REGRESSION, eval_prefix, reported_metrics
from utils.config.tasks import validation_splits as task_splits
from utils.run_folder.layout import RunDir

# Slurm's default MaxArraySize (1001) takes array indexes 0-1000; more trials are a typo or a grid nobody would pay for.
MAX_TRIALS = 1000
SPEC_MAX_BYTES = 1 << 20  # a spec is a page of YAML; more is the wrong file (and /dev/zero never ends)
# A trial pushes only where the spec's `push:` says, never to these from the shell or the recipe (each over the last).
HUB_DESTINATIONS = ("RESULT_MODEL_ID", "RESULT_MERGED_MODEL_ID")
# YAML 1.1 reads 1e-3 as a string (it wants 1.0e-3); a sweep means the number. A quoted "001" stays text.
EXPONENT_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")
# Slurm partition names, one or a comma-separated list: what #SBATCH --partition takes, and nothing a shell reads.
PARTITIONS = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # a newline in a rendered script or manifest starts a line of its own
SWEEP_RECORD = "sweep.json"  # in output_dir: the sweep's identity, and its claim on the folder
SWEEP_RECORD_MAX_BYTES = 64 << 20  # 1000 trials' settings are well under a megabyte; more is not the sweep's record
OWNED = {
    "output_dir": "output_dir (at the top of the spec)",
    "result_model_id": "push: OWNER/NAME",
    "result_merged_model_id": "push: OWNER/NAME (each trial pushes its adapter; no merged model is pushed)",
}


def refused(message: str) -> JobError:
    return BadInput(message)


def setting_value(value) -> str:
    """A YAML value as the job reads it from the environment."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(setting_value, value))
    return str(value)


def as_environment(values: dict) -> dict[str, str]:  # {learning_rate: 1e-4} -> {LEARNING_RATE: "0.0001"}
    return {env_name(name): setting_value(value) for name, value in values.items()}


def yaml_number(value):
    return float(value) if isinstance(value, str) and EXPONENT_NUMBER.match(value.strip()) else value


def setting_name(name: str) -> str:
    """`learning_rate` or `LEARNING_RATE` -> learning_rate; an unknown name is refused with the closest one."""
    field_name = name.strip().lower()
    if field_name in OWNED:
        raise ValueError(f"{name} is set by the sweep; use {OWNED[field_name]}")
    if field_name == "config_file":
        raise ValueError(f"{name} is the spec's `config:` key; write `config: FILE.yaml` at the top of the spec")
    if field_name not in FIELDS:
        close = difflib.get_close_matches(field_name, list(FIELDS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(
            f"{name} is not a setting of the job{hint}; `python main.py --help` lists them (lower_snake or UPPER names)"
        )
    return field_name


def swept_values(values: list) -> list:
    """A list of a grid or of random choices: each value as the job reads it, none twice (two trials would be one)."""
    values = [setting_value(v) if isinstance(v, list) else yaml_number(v) for v in values]
    texts = [setting_value(v) for v in values]
    for i, text in enumerate(texts):
        if (first := texts.index(text)) < i:
            raise ValueError(
                f"{values[first]!r} and {values[i]!r} are the same setting to the job ({text}); list each value once"
            )
    return values


SettingName = Annotated[str, AfterValidator(setting_name)]
Values = Annotated[list, Field(min_length=1), AfterValidator(swept_values)]


def finite(value):
    """.nan passes every order check (it compares false); .inf and an int past a float's range overflow the draw."""
    with suppress(OverflowError):  # an int too large for a float
        if math.isfinite(value):
            return value
    shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(repr(value))} digits)"
    raise ValueError(f"{shown} is not a finite number; give each bound as a number, e.g. low: 1.0e-5")


Number = Annotated[float | int, BeforeValidator(yaml_number), AfterValidator(finite)]


class Range(BaseModel):
    """A range of `random:`; an int range when `type` says so, or both ends are whole numbers as written."""

    model_config = ConfigDict(extra="forbid", strict=True)
    low: Number
    high: Number
    log: bool = False
    type: Literal["int", "float"] | None = None

    @model_validator(mode="after")
    def _check(self) -> Range:
        low, high = self.low, self.high
        self.type = self.type or ("int" if isinstance(low, int) and isinstance(high, int) else "float")
        is_int = self.type == "int"
        if low >= high:
            raise ValueError(f"low={low} is not below high={high}; write the smaller value as low")
        if self.log and low <= 0:
            raise ValueError(f"a log range needs low > 0, got low={low}; use e.g. low: 1e-5")
        if is_int and not all(float(v).is_integer() for v in (low, high)):
            raise ValueError(f"an int range needs whole numbers, got low={low} high={high}; use type: float")
        self.low, self.high = (int(low), int(high)) if is_int else (float(low), float(high))
        return self


Space = Annotated[
    Annotated[Values, Tag("list")] | Annotated[Range, Tag("range")],
    Discriminator(
        lambda value: "list" if isinstance(value, list) else "range" if isinstance(value, dict | Range) else None,
        custom_error_type="space",
        custom_error_message="give a list of values or a range {low, high, log, type}",
    ),
]
# What the union's branches add to an error's location; the user wrote none of them.
UNION_TAGS = {"[key]", "list", "range", "int", "float"}


class SlurmOptions(BaseModel):
    """The `slurm:` block: the resources of each array task (one trial)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    time: str = "02:00:00"
    partition: str | None = None  # None: the cluster's default partition
    gpus: int = Field(1, ge=0)  # per trial; 0: the CPU
    cpus_per_task: int = Field(4, ge=1)
    venv: str | None = None  # None: the repo's .venv
    log_dir: str | None = None  # None: output_dir/slurm
    signal_lead: int = Field(180, ge=1)  # seconds of SIGTERM before the time limit: the trial checkpoints

    @field_validator("partition")
    @classmethod
    def _partition(cls, partition: str | None) -> str | None:
        if partition is not None and not PARTITIONS.fullmatch(partition):
            raise ValueError(
                f"partition={partition!r} is not a Slurm partition name (letters, digits, '_', '.', '-', or a "
                "comma-separated list of them); write e.g. partition: gpu"
            )
        return partition

    @field_validator("time", mode="before")
    @classmethod
    def _time_limit(cls, time):
        if isinstance(time, int):  # YAML 1.1 reads an unquoted 1:30:00 as 5400, which Slurm takes as minutes
            raise ValueError(f'time={time} is a number to YAML; quote the limit, e.g. time: "1:30:00"')
        if isinstance(time, str) and not SLURM_TIME_LIMIT.fullmatch(time):
            raise ValueError(f"time={time!r} is not a Slurm time limit; use HH:MM:SS or D-HH:MM:SS")
        return time


@dataclass(frozen=True)
class Trial:
    index: int
    name: str  # trial-000: also its folder under output_dir
    params: dict  # swept setting (lower snake) -> value, as the spec or the sampler gave it


@pydantic_dataclass(config=ConfigDict(extra="forbid", strict=True))
class Spec:
    """A spec's keys, each strictly of its type (`true` is no count, `"8"` no number), each description the fix its
    refusal names; the rules across keys in `_rules`. read_spec and check_trials set the fields without init."""

    output_dir: Path = Field(description="set it to the folder for the trials and the summary")
    name: str | None = Field(None, min_length=1, description="name the sweep, e.g. name: lr-rank")
    # ENV_NAME -> value, fixed for every trial
    settings: Annotated[dict[SettingName, Any], AfterValidator(as_environment)] = Field(
        default_factory=dict, description="settings: maps setting to value"
    )
    config: str | None = Field(None, min_length=1, description="config: is the path of a recipe file")
    grid: dict[SettingName, Values] = Field(
        default_factory=dict, description="give each swept setting a list, e.g. grid: {learning_rate: [1e-4, 3e-4]}"
    )
    random: dict[SettingName, Space] = Field(
        default_factory=dict, description="give each drawn setting a list or a range {low, high, log, type: int|float}"
    )
    trials: int | None = Field(None, ge=1, le=MAX_TRIALS, description=f"trials: is how many draws, 1 to {MAX_TRIALS}")
    seed: int = Field(
        0, ge=0, lt=2**32, description=f"the draws' seed is a whole number, 0 to {2**32 - 1}, e.g. seed: 0"
    )
    metric: str = Field("accuracy", min_length=1, description="name a key of the trials' metrics.json")
    direction: Literal["maximize", "minimize"] | None = Field(None, description="use maximize or minimize")
    # Each runs a process: a larger count than a sweep's trials is a typo that would exhaust memory.
    parallel: int = Field(1, ge=1, le=MAX_TRIALS, description=f"give how many trials run at once, 1 to {MAX_TRIALS}")
    backend: Literal["local", "slurm", "katib"] = Field("local", description="use one of local, slurm, katib")
    push: str | bool | None = Field(
        False, description="write push: OWNER/NAME (trial-003 pushes to OWNER/NAME-trial-003) or push: false"
    )
    slurm: SlurmOptions = Field(
        default_factory=SlurmOptions,
        description=f"slurm: takes {', '.join(SlurmOptions.model_fields)} (gpus per trial; gpus: 0 for the CPU)",
    )
    katib: dict = Field(default_factory=dict, description="katib: takes no keys")
    path: Path = Field(Path("SPEC.yaml"), init=False)
    metric_key: str = Field("eval_accuracy", init=False)  # where metrics.json holds `metric`
    metric_keys: tuple[str, ...] = Field((), init=False)  # every metric metrics.json holds for it, as eval_<name>
    metric_splits: tuple[str, ...] = Field((), init=False)  # the metric on each validation split (MNLI's two)

    @field_validator("output_dir", mode="before")
    @classmethod
    def _a_path(cls, value):
        if value == "":
            raise ValueError("it is empty; set it to the folder for the trials and the summary")
        return Path(value) if isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _printable(cls, name: str | None) -> str | None:
        # the name goes into the Slurm script, the Katib Experiment and the study: a newline would be a line of its own
        if name is not None and CONTROL.search(name):
            raise ValueError(f"{name!r} holds a control character (a newline, a tab); write a name on one line")
        return name

    @field_validator("metric")
    @classmethod
    def _as_named(cls, metric: str) -> str:
        return metric.strip().removeprefix("eval_")  # checked against the task's metrics by check_trials

    @field_validator("push")
    @classmethod
    def _repo(cls, push: str | bool) -> str | None:
        if push is True and not (push := os.environ.get("RESULT_MODEL_ID", "")):
            raise ValueError("true reads the Hub repo from RESULT_MODEL_ID, which is unset; write push: OWNER/NAME")
        if push == "":
            raise ValueError("'' names no repo; write push: OWNER/NAME or push: false")
        return push or None

    @field_validator("katib")
    @classmethod
    def _no_keys(cls, katib: dict) -> dict:
        if katib:
            raise ValueError(
                f"unknown key(s) {sorted(katib)}; it takes none: the trial is k8s/pytorchjob.yaml as deployed, "
                "and parallel, trials and seed are the spec's own keys"
            )
        return katib

    @model_validator(mode="after")
    def _rules(self) -> Spec:
        if self.grid and self.random:
            raise ValueError(
                "grid and random in one spec: sweep the grid's lists as random choices, or run two sweeps"
            )
        if not self.grid and not self.random:
            raise ValueError("nothing to sweep; add e.g. grid: {learning_rate: [1e-4, 3e-4]}, or random: with trials:")
        if fixed := [key for key in self.swept if env_name(key) in self.settings]:
            raise ValueError(f"{fixed[0]} is both fixed (settings) and swept; remove it from settings")
        if self.random and self.trials is None:
            raise ValueError(f"random search needs trials: N (how many draws, 1 to {MAX_TRIALS}), got trials=None")
        if self.grid and self.trials is not None:
            raise ValueError("trials: is for random search; a grid runs every point once, remove trials:")
        if self.grid and (size := math.prod(len(values) for values in self.grid.values())) > MAX_TRIALS:
            raise ValueError(
                f"grid: {size} points, more than {MAX_TRIALS} trials; sweep fewer values, or draw random:"
            )
        lower = self.metric.rsplit("_", 1)[-1] in {"loss", *LOWER_IS_BETTER}
        self.direction = self.direction or ("minimize" if lower else "maximize")
        if self.backend != "katib":  # a folder here (katib's is a path in the pods)
            self.output_dir = self.output_dir.resolve()
            if self.output_dir.exists() and not self.output_dir.is_dir():
                raise ValueError(
                    f"output_dir={self.output_dir} is a file; give a folder for the trials and the summary"
                )
        return self

    @property
    def swept(self) -> list[str]:
        return [*self.grid, *self.random]

    def trial_env(self, trial: Trial) -> dict[str, str]:
        """The settings one trial runs with, as the environment of its `python main.py` (or Katib's template)."""
        config = {"CONFIG_FILE": self.config} if self.config else {}
        push = {"RESULT_MODEL_ID": f"{self.push}-{trial.name}"} if self.push else {}
        trial_env = {**as_environment(trial.params), "OUTPUT_DIR": str(self.output_dir / trial.name), **push}
        return {**self.settings, **config, **trial_env}


FILE_KEYS = [name for name, field in Spec.__pydantic_fields__.items() if field.init is not False]


def spec_error(path: Path, exc: ValidationError) -> str:
    """The first thing wrong in a spec, as one line naming the key, the value and the fix."""
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"] if part not in UNION_TAGS]
    where = ".".join(loc)
    if error["type"] == "unexpected_keyword_argument":
        close = difflib.get_close_matches(where, FILE_KEYS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"{path}: unknown key {where!r}{hint}; a spec takes {', '.join(FILE_KEYS)}"
    if error["type"] == "value_error":  # the spec's own rules: the message says the fix
        reason = error["msg"].removeprefix("Value error, ")
        return f"{where}: {reason}" if where else f"{path}: {reason}"
    fix = Spec.__pydantic_fields__[loc[0]].description
    if error["type"] == "missing":
        return f"{path}: {where} is missing; {fix}"
    return f"{where}={error['input']!r} is invalid: {error['msg']}; {fix}"


class _Alias(Exception):
    """An alias (*name) in a spec: (name, line)."""


class SpecLoader(_unique_key_loader(yaml)):  # one rule for a key given twice, in the recipe and in the spec
    """The recipe reader's loader, refusing aliases too: nested ones make a few hundred bytes millions of values (a
    "billion laughs"), which a check then walks and an error message quotes whole."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Alias(event.anchor, event.start_mark.line + 1)
        return super().compose_node(parent, index)


def read_spec(path: Path) -> Spec:
    try:
        raw = yaml.load(read_small_text(path, SPEC_MAX_BYTES), Loader=SpecLoader)
    except (OSError, UnfitFile) as exc:
        why = f"cannot be read ({exc.strerror})" if isinstance(exc, OSError) else exc
        raise refused(f"{path} {why}; give the path of a SPEC.yaml (examples/sweeps/ has some)") from None
    except _KeyTwice as exc:
        key, first, second = exc.args
        raise refused(f"{path} sets {key} twice (lines {first} and {second}); keep one") from None
    except _Alias as exc:
        name, line = exc.args
        raise refused(
            f"{path} line {line}: the alias *{str(name)[:40]} is not read in a spec; write the value out where it is used"
        ) from None
    except yaml.YAMLError as exc:
        raise refused(f"{path} is not valid YAML ({first_line(exc, None, '')}); fix the file") from None
    if not isinstance(raw, dict) or not all(isinstance(key, str) for key in raw):
        raise refused(f"{path}: a sweep spec is a mapping (settings, grid, random, metric, ...); see docs/sweeps.md")
    try:
        spec = Spec(**raw)
    except ValidationError as exc:
        raise refused(spec_error(path, exc)) from None
    spec.path, spec.name = path, spec.name or path.stem
    return spec


def plan_trials(spec: Spec) -> list[Trial]:
    """Every trial of the sweep, in order, named trial-000, trial-001, ..."""
    if spec.grid:
        points = [dict(zip(spec.grid, values, strict=True)) for values in itertools.product(*spec.grid.values())]
    else:
        points = draw_random(spec)
    width = max(3, len(str(len(points) - 1)))
    return [Trial(i, f"trial-{i:0{width}d}", params) for i, params in enumerate(points)]


def draw_random(spec: Spec) -> list[dict]:
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spaces = {
        name: (IntDistribution if space.type == "int" else FloatDistribution)(space.low, space.high, log=space.log)
        if isinstance(space, Range)
        else CategoricalDistribution(space)
        for name, space in spec.random.items()
    }
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


def job_environment(spec: Spec, trial: Trial) -> dict[str, str]:
    """One trial's `python main.py` environment (checked, identified and run alike): this shell's less the Hub repos,
    with the trial's settings over it."""
    return {**{k: v for k, v in os.environ.items() if k not in HUB_DESTINATIONS}, **spec.trial_env(trial)}


@dataclass(frozen=True)
class Resolved:
    """What the sweep reads of a trial's resolved settings (Settings.select builds it)."""

    config_file: str | None
    result_model_id: str | None
    result_merged_model_id: str | None
    task: str | None
    problem_type: str


def check_trials(spec: Spec, trials: list[Trial]) -> dict:
    """Resolve each trial's settings and plan as its main.py will, so a bad value, a Hub repo from the recipe, a push
    the job would refuse or a metric metrics.json will not hold stops the sweep before any trial starts; set
    `spec.metric_key`. Returns the sweep's identity for `check_sweep_dir`."""
    found: dict[str, dict] = {}
    keys: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    recipe = None
    for trial in trials:
        env = {k: v for k, v in job_environment(spec, trial).items() if k.lower() in FIELDS}
        try:
            settings, _ = load_settings([], environ=env)
            plan = build_plan(settings, 1)  # each trial is a one-process run (locally, and as a Slurm array task)
            found[trial.name] = plan.identity
        except JobError as exc:
            raise refused(f"{trial.name} ({describe(trial)}): {exc.message}") from None
        resolved = settings.select(Resolved)
        recipe = resolved.config_file
        for name in HUB_DESTINATIONS:
            value = getattr(resolved, name.lower())
            if value and value != spec.trial_env(trial).get(name):
                raise refused(
                    f"CONFIG_FILE={recipe} sets {name.lower()}: {value}, so every trial would push to it, each over the last; remove it from the recipe (write push: OWNER/NAME in the spec to push each trial)"
                )
        if spec.push and spec.backend != "katib":  # Katib's trials read the token from the cluster's Secret
            try:  # as the job refuses the push: every trial would train, then be refused (or fail to push)
                check_push_possible(settings, plan.base_model_id)
            except JobError as exc:
                raise refused(
                    f"push: {spec.push} ({trial.name}): {exc.message}; or write push: false to keep each trial's model "
                    "in its folder"
                ) from None
        key, names, on_splits = metric_of(spec.metric, resolved.task, resolved.problem_type)
        keys[key] = (names, on_splits)
    if len(keys) > 1:
        raise refused(f"metric={spec.metric}: the trials name it differently ({', '.join(keys)}); sweep one task")
    ((key, (names, spec.metric_splits)),) = keys.items()
    spec.metric_key, spec.metric_keys = f"eval_{key}", tuple(f"eval_{name}" for name in names)
    return sweep_identity(spec, found, recipe)


def sweep_identity(spec: Spec, trials: dict[str, dict], recipe: str | None) -> dict:
    """What makes two runs of a spec one sweep (sweep.json): the job's identity of each trial (a setting the job
    ignores changes no trial), a random search's space and seed (more trials extend it), the recipe's path and digest."""
    swept = {name: setting_space(values) for name, values in (spec.random or spec.grid).items()}
    space = {"random": swept, "seed": spec.seed} if spec.random else {"grid": swept}
    # read by the job's recipe reader in check_trials: a regular file of a page at most
    digest = recipe and sha256_file(Path(recipe).expanduser())
    identity = {"trials": trials, "space": space, "recipe": recipe and {"path": recipe, "sha256": digest}}
    return json.loads(json.dumps(identity, default=str))  # as sweep.json holds it: compared as it is read back


def setting_space(space) -> list | dict:
    return space.model_dump() if isinstance(space, Range) else [*map(setting_value, space)]


def metric_of(metric: str, task: str | None, problem_type: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """The spec's `metric` as metrics.json names it (less `eval_`), every name metrics.json holds, and the metric's key
    on each split. On MNLI a metric without a split is the first split's, as the job tracks it. Without TASK or
    PROBLEM_TYPE the data decides classification or regression: either's metrics may be named."""
    problems = (problem_type,) if problem_type != "auto" else (CLASSIFICATION, REGRESSION)
    splits = task_splits(task)
    reported = [name for problem in problems for name in reported_metrics(task, problem)]
    prefixes = [eval_prefix(split) for split in splits]
    names = tuple(dict.fromkeys([*reported, *(f"{p}_loss" if p else "loss" for p in prefixes)]))
    for name in (metric, f"{prefixes[0]}_{metric}" if prefixes[0] else metric):
        if name in names:  # on every split: MNLI's matched_accuracy is also eval_mismatched_accuracy
            base = next((name.removeprefix(f"{p}_") for p in prefixes if p and name.startswith(f"{p}_")), name)
            return name, names, tuple(f"eval_{p}_{base}" if p else f"eval_{base}" for p in prefixes)
    close = difflib.get_close_matches(metric, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    kind = f"TASK={task}" if task else f"PROBLEM_TYPE={problem_type}"
    raise refused(f"metric={metric!r} is not a metric the trials write ({kind}){hint}; use one of {', '.join(names)}")


def describe(trial: Trial) -> str:
    return " ".join(f"{k}={v}" for k, v in as_environment(trial.params).items())


def trial_metric(spec: Spec, folder: Path) -> float | None:
    """The sweep's metric from a trial's metrics.json, if it is a number."""
    path = folder / "metrics.json"
    value = json.loads(path.read_text()).get(spec.metric_key) if path.exists() else None
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def check_sweep_dir(spec: Spec, identity: dict) -> dict | None:
    """Refuse an output_dir that is not new, empty or this same sweep's, so no result shows under values it was not
    trained with. Writes nothing: returns the record `claim_sweep_dir` writes (None: the folder's stands)."""
    out = spec.output_dir
    record = out / SWEEP_RECORD
    if record.is_file():
        theirs = read_sweep_record(record)
        if change := identity_change(theirs, identity):
            raise refused(f"{out} holds another sweep ({change}); {RESTORE}")
        # every trial ever planned here stays recorded: a later spec naming it again is checked against it
        known = {**identity, "trials": {**theirs["trials"], **identity["trials"]}}
        return known if known != theirs else None
    ours = {SWEEP_RECORD, ".sweep.lock", "lost+found"}
    found = os.listdir(out) if out.is_dir() else []
    if names := sorted(n for n in found if n not in ours and not n.startswith(f".{SWEEP_RECORD}")):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise refused(
            f"output_dir={out} is not empty and is not a folder of this sweep (it holds {shown}, and no {SWEEP_RECORD}); "
            "the sweep deletes and replaces files in its folders, so it leaves this one untouched: use an empty or new folder"
        )
    return identity


RESTORE = "give this spec a new output_dir, or restore the spec, recipe and setting variables the sweep was made with"
UNREADABLE = "restore the sweep.json the sweep wrote, or give this spec a new output_dir"


def read_sweep_record(record: Path) -> dict:
    """sweep.json as `sweep_identity` made it; another shape was not this sweep's, or was edited."""
    try:
        theirs = json.loads(read_small_text(record, SWEEP_RECORD_MAX_BYTES))
    except (OSError, UnfitFile, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else exc
        raise refused(f"{record} cannot be read ({why}); {UNREADABLE}") from None
    trials = theirs.get("trials") if isinstance(theirs, dict) else None
    if isinstance(trials, dict) and "space" not in theirs:
        raise refused(
            f"{record} was written by an earlier sweep.py (it records each trial's variables, not the job's identity "
            "of each); finish that sweep with the version that made it, or give this spec a new output_dir"
        )
    if not (
        isinstance(trials, dict)
        and all(isinstance(trial, dict) for trial in trials.values())
        and isinstance(theirs.get("space"), dict)
        and isinstance(theirs.get("recipe", ...), dict | None)
    ):
        raise refused(
            f"{record} is not a record this sweep writes (it holds trials: each trial's identity, space and "
            f"recipe); {UNREADABLE}"
        )
    return theirs


def claim_sweep_dir(spec: Spec, record: dict | None) -> None:
    if record is None:
        return
    try:
        spec.output_dir.mkdir(parents=True, exist_ok=True)
        RunDir(spec.output_dir).write_json(spec.output_dir / SWEEP_RECORD, record)
    except OSError as exc:
        raise refused(
            f"output_dir={spec.output_dir} is not writable ({exc.strerror}); give a writable folder"
        ) from None


def identity_change(theirs: dict, ours: dict) -> str | None:
    """The first difference between the recorded sweep and this spec (`LORA_DROPOUT: 0.1 -> 0.3`); None: the same."""
    if "random" in ours["space"] and theirs["space"] != ours["space"]:  # more draws of another space: another sweep
        was, now = theirs["space"], ours["space"]
        if "random" not in was:
            return "it swept a grid; this spec draws random trials"
        changed = sorted(
            k for k in set(was["random"]) | set(now["random"]) if was["random"].get(k) != now["random"].get(k)
        )
        if changed:
            name = changed[0]
            return f"random.{name} was {was['random'].get(name, '<unset>')}, now {now['random'].get(name, '<unset>')}"
        return f"seed was {was.get('seed')}, now {now.get('seed')}"
    if "grid" in ours["space"] and "grid" not in theirs["space"]:
        return "it drew random trials; this spec sweeps a grid"
    for name, new in ours["trials"].items():
        old = theirs["trials"].get(name)
        if old is not None and (changes := identity_changes(old, new)):
            return f"{name}: {'; '.join(changes[:3])}"
    return None
