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
import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from utils.errors import EXIT_BAD_INPUT, JobError
from utils.settings import FIELDS, env_name, load_settings

BACKENDS = ("local", "slurm", "katib")
DIRECTIONS = ("maximize", "minimize")
# What the job's metrics.json may hold for a sweep to rank by (read as `eval_<name>`, or `<name>` as written):
# the classification metrics of today's job, the evaluation loss, and the task metrics GLUE defines.
METRICS = (
    "accuracy",
    "f1",
    "precision",
    "recall",
    "loss",
    "matthews_correlation",
    "pearson",
    "spearman",
    "spearmanr",
    "mse",
    "accuracy_mm",
)
LOWER_IS_BETTER = ("loss", "mse")
SPEC_KEYS = (
    "name",
    "settings",
    "config",
    "grid",
    "random",
    "trials",
    "seed",
    "metric",
    "direction",
    "parallel",
    "backend",
    "output_dir",
    "push",
    "slurm",
    "katib",
)
# The sweep owns these: every trial gets its own folder, and pushes only when the spec says so.
OWNED = {"output_dir": "output_dir (at the top of the spec)", "result_model_id": "push: true"}
RANGE_KEYS = {"low", "high", "log", "type"}


def refused(message: str) -> JobError:
    return JobError(EXIT_BAD_INPUT, message)


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
    """YAML 1.1 reads 1e-3 as a string (it wants 1.0e-3); a sweep means the number."""
    if isinstance(value, str):
        for number in (int, float):
            try:
                return number(value)
            except ValueError:
                pass
    return value


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
    number = int if kind == "int" else float
    return Range(number(low), number(high), log, kind == "int")


def read_spec(path: Path) -> Spec:
    """Read and check a spec; everything wrong with it is a JobError (exit 2) that says the fix."""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise refused(f"no sweep spec at {path}; give the path of a SPEC.yaml (examples/sweeps/ has some)") from None
    except yaml.YAMLError as exc:
        raise refused(f"{path} is not valid YAML ({str(exc).splitlines()[0]}); fix the file") from None
    if not isinstance(raw, dict):
        raise refused(f"{path}: a sweep spec is a mapping (settings, grid, random, metric, ...); see docs/sweeps.md")
    unknown = sorted(set(raw) - set(SPEC_KEYS))
    if unknown:
        raise refused(f"{path}: unknown key(s) {unknown}; a spec takes {', '.join(SPEC_KEYS)}")

    def mapping(key: str) -> dict:
        value = raw.get(key) or {}
        if not isinstance(value, dict):
            raise refused(f"{key}: must be a mapping of setting name to value(s), got {type(value).__name__}")
        return value

    if not raw.get("output_dir"):
        raise refused(f"{path}: output_dir is missing; set it to the folder for the trials and the summary")
    spec = Spec(path=path, name=str(raw.get("name") or path.stem), output_dir=Path(str(raw["output_dir"])))
    spec.settings = {env_name(setting_name(k, "settings")): setting_value(v) for k, v in mapping("settings").items()}
    if raw.get("config") is not None:
        spec.config = str(raw["config"])

    for name, values in mapping("grid").items():
        key = setting_name(name, "grid")
        if not isinstance(values, list) or not values:
            raise refused(f"grid.{name}: an empty grid; give a list of at least one value, e.g. {name}: [1, 2]")
        spec.grid[key] = [setting_value(v) if isinstance(v, list) else yaml_number(v) for v in values]
    if "grid" in raw and not spec.grid:
        raise refused("grid: an empty grid; give each swept setting a list, e.g. grid: {learning_rate: [1e-4, 3e-4]}")
    for name, space in mapping("random").items():
        key = setting_name(name, "random")
        if isinstance(space, list):
            if not space:
                raise refused(f"random.{name}: an empty list; give the values to draw from, or a range {{low, high}}")
            spec.random[key] = [setting_value(v) if isinstance(v, list) else yaml_number(v) for v in space]
        elif isinstance(space, dict):
            spec.random[key] = parse_range(name, space)
        else:
            raise refused(f"random.{name}: give a list of values or a range {{low, high, log, type}}, got {space!r}")
    if "random" in raw and not spec.random:
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

    trials = raw.get("trials")
    if spec.random:
        if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
            raise refused(f"random search needs trials: N (how many draws, at least 1), got trials={trials!r}")
        spec.trials = trials
    elif trials is not None:
        raise refused("trials: is for random search; a grid runs every point once, remove trials:")
    spec.seed = int(raw.get("seed", 0))

    metric = str(raw.get("metric", "accuracy")).removeprefix("eval_")
    if metric not in METRICS:
        close = difflib.get_close_matches(metric, METRICS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise refused(
            f"metric={raw.get('metric')!r} is not a metric the job writes{hint}; use one of {', '.join(METRICS)}"
        )
    spec.metric = metric
    spec.direction = str(raw.get("direction", "minimize" if metric in LOWER_IS_BETTER else "maximize"))
    if spec.direction not in DIRECTIONS:
        raise refused(f"direction={spec.direction!r}; use maximize or minimize")
    parallel = raw.get("parallel", 1)
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise refused(f"parallel={parallel!r}; give how many trials run at once, at least 1")
    spec.parallel = parallel
    spec.backend = str(raw.get("backend", "local"))
    if spec.backend not in BACKENDS:
        raise refused(f"backend={spec.backend!r}; use one of {', '.join(BACKENDS)}")
    if spec.backend != "katib":  # a folder here (katib's is a path in the pods)
        spec.output_dir = spec.output_dir.resolve()
    push = raw.get("push", False)
    if push is True:
        push = os.environ.get("RESULT_MODEL_ID", "")
        if not push:
            raise refused("push: true reads the Hub repo from RESULT_MODEL_ID, which is unset; write push: OWNER/NAME")
    if push is not False and (not isinstance(push, str) or not push):
        raise refused(
            f"push={push!r}; write push: OWNER/NAME (trial-003 pushes to OWNER/NAME-trial-003) or push: false"
        )
    spec.push = push or None
    spec.slurm, spec.katib = mapping("slurm"), mapping("katib")
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


def check_trials(spec: Spec, trials: list[Trial], environ: dict[str, str] | None = None) -> None:
    """Resolve each trial's settings with the job's own model, as its main.py will: a bad value stops the sweep
    before any trial starts. The job also reads the variables of this shell, so they take part."""
    environ = os.environ if environ is None else environ
    inherited = {k: v for k, v in environ.items() if k.lower() in FIELDS and k != "RESULT_MODEL_ID"}
    for trial in trials:
        env = {**inherited, **spec.trial_env(trial)}
        try:
            load_settings([], environ={k: v for k, v in env.items() if k.lower() in FIELDS})
        except JobError as exc:
            raise refused(f"{trial.name} ({describe(trial)}): {exc.message}") from None


def describe(trial: Trial) -> str:
    return " ".join(f"{env_name(k)}={setting_value(v)}" for k, v in trial.params.items())


def metric_value(metrics: dict, metric: str) -> float | None:
    """The spec's metric from a trial's metrics.json, written `eval_<name>` or `<name>`."""
    for key in (f"eval_{metric}", metric):
        value = metrics.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None
