"""Where the settings come from: built-in defaults < recipe file < environment (the platform's `config_map`) <
command-line flags. A recipe (`--config FILE.yaml`, CONFIG_FILE) holds settings by their field names and anything
else in it is refused; the environment holds other programs' variables too, so a misspelt setting there is warned
about. Imports nothing heavy.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import (
    CliSettingsSource,
    EnvSettingsSource,
    InitSettingsSource,
    SettingsError,
    YamlConfigSettingsSource,
)

from utils.common.errors import BadInput, JobError
from utils.common.hub_token import UnfitFile, read_small_text, read_token, refuse_token_in_settings
from utils.config.settings import FIELDS, PATH_MAX, Settings, env_name, flag_name

# The names run_glue, the HF Trainer, Axolotl and torchtune give settings this job names otherwise (people type them
# from those tools' READMEs); underscores are dashes for every flag, with no entry here.
FLAG_ALIASES = {
    "--model-name-or-path": "--model-name",  # run_glue
    "--task-name": "--task",  # run_glue
    "--num-train-epochs": "--num-epochs",  # the Trainer
    "--per-device-train-batch-size": "--per-device-batch-size",  # the Trainer
    "--hub-model-id": "--result-model-id",  # the Trainer
    "--hub-private-repo": "--hub-private",  # the Trainer
    "--lora-rank": "--lora-r",  # torchtune
    "--sequence-len": "--max-seq-length",  # Axolotl
    "--micro-batch-size": "--per-device-batch-size",  # Axolotl
}
# Their flags with no counterpart here: refused with what to do instead, not a similar name that means something
# else (--eval-strategy is no --strategy, --local-rank no --lora-rank).
NO_COUNTERPART = {
    "--do-train": "this job always trains; leave it out",
    "--do-eval": "this job always evaluates on the validation split(s); leave it out",
    "--overwrite-output-dir": "an OUTPUT_DIR holding the same run is resumed, one holding another run is refused, "
    "never overwritten; give a new --output-dir",
    "--local-rank": "the launcher's LOCAL_RANK says it, and the deepspeed launcher's own --local_rank is taken off; "
    "leave it out",
    "--eval-strategy": "evaluations run every --eval-steps steps and after training",
    "--evaluation-strategy": "evaluations run every --eval-steps steps and after training",
    "--save-strategy": "checkpoints are saved every --save-steps steps",
    "--bf16": "use --precision bf16 (auto picks bf16 where the GPU has it)",
    "--fp16": "use --precision fp16 (auto picks bf16 where the GPU has it)",
    "--warmup-steps": "use --warmup-ratio, the share of the steps warmed up",
    "--train-file": "use --dataset-path, a folder holding train.* and validation.* files",
    "--validation-file": "use --dataset-path, a folder holding train.* and validation.* files",
}
FLAG_CUTOFF = 0.75  # difflib's ratio: --lerning-rate -> --learning-rate 0.97, --epochs -> --num-epochs 0.8


class Parser(argparse.ArgumentParser):
    """main.py's, predict.py's and sweep.py's: a refused command line is bad input (one `error:` line, exit 2), not a
    usage block. Flags are taken with underscores too, and an unknown one is answered with the closest."""

    aliases: Mapping[str, str] = {}
    no_counterpart: Mapping[str, str] = {}

    def error(self, message: str):
        raise BadInput(f"{message}; see `python {self.prog} --help`")

    def parse_args(self, args=None, namespace=None):
        return self._parsed(self.parse_known_args, args, namespace)

    def parse_intermixed_args(self, args=None, namespace=None):
        return self._parsed(self.parse_known_intermixed_args, args, namespace)

    def _parsed(self, parse, args, namespace) -> argparse.Namespace:
        parsed, unknown = parse(self.normalize(sys.argv[1:] if args is None else list(args)), namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{self.hint(unknown[0])}")
        return parsed

    def normalize(self, argv: list[str]) -> list[str]:
        """`argv` with each known flag spelt another way (underscores, an alias; `--flag=value` too) written as the
        flag. Values and unknown flags stay as typed."""
        takes_value = {flag for flag, action in self._option_string_actions.items() if action.nargs != 0}
        normalized: list[str] = []
        value_next = False  # the argument after a flag that takes one is its value, even one starting with --
        for index, arg in enumerate(argv):
            if arg == "--":
                return normalized + argv[index:]
            if not value_next and arg.startswith("--"):
                name, equals, value = arg.partition("=")
                flag = self.aliases.get(flag_name(name), flag_name(name))
                respelt = name not in self._option_string_actions and flag in self._option_string_actions
                arg = f"{flag}{equals}{value}" if respelt else arg
                value_next = not equals and arg in takes_value
            else:
                value_next = False
            normalized.append(arg)
        return normalized

    def hint(self, arg: str) -> str:
        """` (did you mean --flag?)` for an unknown `arg`, or why it has no counterpart, or ''; a bare `name=value`
        (Axolotl's, torchtune's overrides) gets the flag to type."""
        name, equals, value = arg.partition("=")
        flag = flag_name(name)
        if flag in self.no_counterpart:
            return f" ({name}: {self.no_counterpart[flag]})"
        flags = [known for known in self._option_string_actions if known.startswith("--")]
        close = difflib.get_close_matches(flag, [*flags, *self.aliases], n=1, cutoff=FLAG_CUTOFF)
        if not close:
            return ""
        meant = self.aliases.get(close[0], close[0])
        if name.startswith("-"):
            return f" (did you mean {meant}?)"
        return f" (a setting is given as a flag: {meant} {value})" if equals else ""


class _Environment(EnvSettingsSource):
    """The environment source over any mapping: os.environ for the job, `--set` values render_sbatch never exports."""

    def __init__(self, environ: Mapping[str, str]):
        self._environ = environ
        super().__init__(Settings)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # A blank variable is unset (a blank config_map entry).
        return {name.lower(): value for name, value in self._environ.items() if value.strip()}


def _parser() -> Parser:
    # allow_abbrev=False: `--learn 1e-3` is refused, never read as --learning-rate.
    parser = Parser(
        prog="main.py",
        description="LoRA fine-tuning of BERT for text classification (GLUE SST-2 unless TASK or DATASET_PATH says otherwise), on one process or many. Every setting is a flag, an "
        "environment variable or a key of a recipe file (--config; flags win over the environment, the environment "
        "over the file); the Hub token comes only from HF_TOKEN or HF_TOKEN_PATH.",
        epilog=textwrap.fill(
            "The names run_glue, the Trainer, Axolotl and torchtune give these settings work too, with underscores "
            "or dashes: "
            + ", ".join(f"--{alias[2:].replace('-', '_')} ({flag})" for alias, flag in FLAG_ALIASES.items())
            + "; and every flag above with underscores (--learning_rate).",
            width=100,
            break_on_hyphens=False,
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.aliases, parser.no_counterpart = FLAG_ALIASES, NO_COUNTERPART
    parser.add_argument(
        "--dry-run", action="store_true", help="print the resolved settings and distributed env as JSON, then exit"
    )
    parser.add_argument(
        "--config",
        dest="config_file",  # the same setting as --config-file and CONFIG_FILE
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="a recipe: a YAML file of settings by their names (as --dry-run shows them); sets CONFIG_FILE",
    )
    parser.add_argument(
        "--push-only",
        action="store_true",
        help="push an existing OUTPUT_DIR/model to RESULT_MODEL_ID without training",
    )
    return parser


# ------------------------------------------------------------------------------- a recipe file
RECIPE_MAX_BYTES = 1 << 20  # a recipe is a page of settings; more is the wrong file (and /dev/zero never ends)
SECRET_SETTINGS = ("hf_token", "hf_token_path")


class _Recipe(YamlConfigSettingsSource):
    """pydantic-settings' YAML source, minus what it lets pass: it skips a missing file and keeps the last of a key
    given twice, where a recipe is refused with the fix; read without blocking and bounded (a FIFO, /dev/zero)."""

    def __init__(self, path: str | None):
        super().__init__(Settings, yaml_file=path)

    @staticmethod
    def _existing_files(files) -> list[Path]:
        # A path past PATH_MAX is not opened: CONFIG_FILE's max_length refuses it, naming the flag and variable.
        return [Path(files)] if files and len(files) <= PATH_MAX else []

    def _read_file(self, file_path: Path) -> dict[str, Any]:
        import yaml  # only when a recipe is given

        def refused(why: str) -> JobError:
            return BadInput(f"CONFIG_FILE={self.yaml_file_path} {why}")

        fix = "point --config or CONFIG_FILE at a YAML file of settings"
        try:
            values = yaml.load(read_small_text(file_path, RECIPE_MAX_BYTES), Loader=_unique_key_loader(yaml))
        except FileNotFoundError:
            raise refused(f"does not exist; {fix} (e.g. recipes/sst2.yaml)") from None
        except OSError as exc:
            raise refused(f"cannot be read ({exc.strerror}); make it readable, or {fix}") from None
        except UnfitFile as exc:
            raise refused(f"{exc}; {fix}") from None
        except _KeyTwice as exc:
            raise refused(f"sets {exc.args[0]} twice (lines {exc.args[1]} and {exc.args[2]}); keep one") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise refused(f"is not valid YAML{where} ({problem}); write one `name: value` a line") from None
        if not isinstance(values, dict | None):
            raise refused(f"holds a YAML {type(values).__name__}, not a mapping of settings; {fix}")
        for keys, what, role in OTHER_FILES:
            if keys & set(values or {}):
                raise refused(f"is {what}, not a recipe: {role}; {fix}, such as those in recipes/ (recipes/sst2.yaml)")
        for key in values or {}:
            if not isinstance(key, str):  # the source matches names as text
                raise _not_a_setting(self.yaml_file_path, str(key))
            if key.lower() in SECRET_SETTINGS:
                raise refused(
                    f"holds {key}: a secret does not belong in a recipe (it ends up in job specs and repositories); "
                    "remove it and set HF_TOKEN, or HF_TOKEN_PATH to a mounted file holding the token"
                )
            if key.lower() == "config_file":
                raise refused(f"names another recipe ({key}); put the settings in this file instead")
        return values or {}


# The repo's other YAML files, which people hand to --config: each named by the keys only it has, and where it goes.
OTHER_FILES = (
    (
        {"resources", "replicas"},
        "the managed platform's job file (resources, replicas, config_map)",
        "the platform starts the replicas from it and gives each its config_map as environment variables",
    ),
    ({"apiVersion"}, "a Kubernetes manifest (k8s/)", "kubectl applies it"),
    (
        {"compute_environment", "distributed_type"},
        "an accelerate config (launchers/accelerate/)",
        "`accelerate launch --config_file` takes it",
    ),
)


def _not_a_setting(path: str | None, key: str) -> JobError:
    close = difflib.get_close_matches(key.lower(), list(FIELDS), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return BadInput(
        f"CONFIG_FILE={path} holds {key}, which is not a setting{hint}; fix the name, or remove it "
        "(`python main.py --help` lists the settings)",
    )


class _KeyTwice(Exception):
    """A mapping key given twice in a recipe: (key, first line, second line)."""


def _unique_key_loader(yaml):
    """yaml's SafeLoader, refusing a key given twice (LORA_R and lora_r too), which PyYAML keeps the last of."""

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            lines = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                key = key.lower() if isinstance(key, str) else key
                if key in lines:
                    raise _KeyTwice(key, lines[key], key_node.start_mark.line + 1)
                lines[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


# ------------------------------------------------------------------------------- misspelled variables
# What launchers, schedulers, the platform, the libraries and a shell set: never taken for a misspelled setting.
FOREIGN_PREFIXES = (
    *("PET_", "SLURM", "SBATCH_", "SRUN_", "PMI_", "PMIX_", "OMPI_", "MPI_", "I_MPI_", "KUBERNETES_", "TORCH"),
    *("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "DATASETS_", "ACCELERATE_", "DS_", "BNB_", "TRITON_"),
    *("NCCL_", "GLOO_", "FI_", "UCX_", "CUDA", "CUDNN_", "CUBLAS", "NVIDIA_", "NV_", "ROCR_", "HIP_", "HSA_", "XLA_"),
    *("OMP_", "MKL_", "KMP_", "OPENBLAS_", "PYTHON", "PIP_", "UV_", "VIRTUAL_ENV", "CONDA", "LD_", "LC_", "XDG_"),
    *("MLFLOW_", "WANDB_", "TRACKIO_", "TENSORBOARD", "SSH_", "GIT_", "OTEL_", "AWS_", "GOOGLE_", "AZURE_", "DOCKER"),
)
FOREIGN_NAMES = (
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "GROUP_WORLD_SIZE"),
    *("ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MAX_JOBS", "HF_TOKEN"),
    *("PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "HOSTNAME", "TERM", "LANG", "TZ", "TMPDIR"),
    *("COLUMNS", "LINES", "SHLVL", "MAIL", "EDITOR", "PAGER", "DISPLAY", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"),
    *("ALL_PROXY", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"),
)
# The shape of the job's own names: a variable starting like these is meant for the job.
JOB_PREFIXES = (
    *("LORA_", "LORAPLUS_", "ZERO_", "GRADIENT_", "LEARNING_", "WARMUP_", "RENDEZVOUS_", "RESULT_", "PUSH_"),
    *("MERGE_", "DATALOADER_", "PER_DEVICE_", "GLOBAL_BATCH", "BASE_LEARNING", "HEAD_LEARNING", "NUM_EPOCH"),
)
SPELLING_CUTOFF = 0.8  # difflib's ratio: LEARNIG_RATE -> LEARNING_RATE 0.96, LORA_RANK -> LORA_R 0.8


def find_misspelled_variables(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable, the setting it probably means) for each set variable that is no setting but has the job's names'
    shape or a close spelling of one."""
    settings = [env_name(field) for field in FIELDS]
    found = []
    for name, value in environ.items():
        if not value.strip() or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name) or name.lower() in FIELDS:
            continue
        if name in FOREIGN_NAMES or name.startswith(FOREIGN_PREFIXES):
            continue
        close = difflib.get_close_matches(name, settings, n=1, cutoff=SPELLING_CUTOFF)
        if not close and name.startswith(JOB_PREFIXES):
            close = difflib.get_close_matches(name, settings, n=1, cutoff=0)
        if close:
            found.append((name, close[0]))
    return sorted(found)


def warn_misspelled_variables(environ: Mapping[str, str]) -> None:
    for name, setting in find_misspelled_variables(environ):
        print(
            f"warning: {name} is set but is no setting of this job, so it is ignored; did you mean {setting}? "
            f"(rename it, or unset it: `python main.py --help` lists the settings)",
            file=sys.stderr,
        )


def is_word_branch(error: dict, field: str) -> bool:
    """An error of `field`'s `Literal[...]` branch of a union (its loc: the field, then `literal[...]`)."""
    loc = error["loc"]
    return len(loc) > 1 and str(loc[0]) == field and str(loc[1]).startswith("literal[")


def describe_range(field: str) -> str:
    """` (range: LOW to HIGH)` of a setting with numeric bounds, else '' (pydantic names a text's longest length)."""
    bounds = [
        (name, getattr(item, name, None)) for item in FIELDS[field].metadata for name in ("ge", "gt", "le", "lt")
    ]
    shown = {
        name: str(value) if isinstance(value, int) else f"{value:g}" for name, value in bounds if value is not None
    }
    if not shown:
        return ""
    low = shown["ge"] if "ge" in shown else f"above {shown['gt']}" if "gt" in shown else "any"
    high = shown["le"] if "le" in shown else f"below {shown['lt']}" if "lt" in shown else "any"
    return f" (range: {low} to {high})"


def load_settings(
    argv: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Callable[[Settings], dict[str, Any]] | None = None,
) -> tuple[Settings, argparse.Namespace]:
    """Resolve defaults < recipe file < env < flags and validate; bad values raise JobError with the fix.
    `overrides`: what the launcher chooses given the user's settings (deepspeed_config.deepspeed_overrides), merged
    over them. Returns the settings and the parsed command line (`dry_run`, `push_only`)."""
    environ = os.environ if environ is None else environ
    env = _Environment(environ)
    parser = _parser()
    flags = CliSettingsSource(Settings, root_parser=parser, _env_settings_source=env)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)  # --help ends here
    warn_misspelled_variables(environ)
    recipe: dict[str, Any] = {}
    given_flags: dict[str, Any] = {}
    given_env: dict[str, Any] = {}
    path = None
    try:
        flags(parsed_args=args)
        given_flags, given_env = flags(), env()
        path = given_flags.get("config_file") or given_env.get("config_file")
        path = path.strip() if isinstance(path, str) and path.strip() else None
        from_file = _Recipe(path)
        recipe = from_file()
        # The path the file was read from wins over every source (a flag over CONFIG_FILE): what --dry-run records.
        chosen = InitSettingsSource(Settings, init_kwargs={"config_file": path} if path else {})
        sources = (chosen, flags, env, from_file)
        settings = Settings(_build_sources=(sources, {}))  # the first source wins
        if chosen_by_launcher := overrides(settings) if overrides else None:
            launcher = InitSettingsSource(Settings, init_kwargs=chosen_by_launcher)
            settings = Settings(_build_sources=((launcher, *sources), {}))
    except SettingsError as exc:
        raise BadInput(f"{exc}; see `python main.py --help`") from None
    except ValidationError as exc:
        raise _invalid(exc, path, {"flag": given_flags, "env": given_env, "recipe": recipe}) from None
    token = read_token()  # a bad one is refused now; read once, the settings keep it
    refuse_token_in_settings(settings.model_dump(mode="json"), token)
    settings._hub_token = token
    return settings, args


def _invalid(exc: ValidationError, path: str | None, given: dict[str, dict[str, Any]]) -> JobError:
    """The refusal of a value pydantic rejected, naming the flag, variable or recipe key it came from as it was typed
    (`given`: what each source gave)."""
    first = exc.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else ""
    reason = first["msg"].removeprefix("Value error, ")
    # A union with words (`bool | Literal["auto"]`): pydantic reports each branch apart; the words are choices too.
    words = [e["msg"].removeprefix("Input should be ") for e in exc.errors()[1:] if is_word_branch(e, field)]
    reason += f", or {' or '.join(words)}" if words else ""
    if first["type"] == "extra_forbidden":  # no other source reads a name that is no setting
        return _not_a_setting(path, field)
    if field not in FIELDS:  # a check across settings: its message names them and the fix
        return BadInput(reason)
    if field in given["flag"]:
        source, raw = flag_name(field), given["flag"][field]
    elif field in given["env"]:
        source, raw = env_name(field), given["env"][field]
    elif field in (recipe := given["recipe"]):
        return BadInput(
            f"{field}: {recipe[field]!s} in CONFIG_FILE={path} is invalid: {reason}{describe_range(field)}; fix {field} in {path} "
            f"(or set {env_name(field)} or {flag_name(field)}, which win over the file)",
        )
    else:
        source, raw = env_name(field), "<default>"
    # a 5000-character path is not repeated whole
    raw = str(raw) if len(str(raw)) <= 200 else f"{str(raw)[:200]}..."
    return BadInput(
        f"{source}={raw!s} is invalid: {reason}{describe_range(field)}; fix {env_name(field)} or {flag_name(field)}",
    )
