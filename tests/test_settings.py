"""Settings precedence, `--help`, and what `--dry-run` shows under every launcher's environment.

What main.py resolves before torch (`main.configure`, what `--dry-run` prints) is checked in this process (`make
check`); `--help`, `--dry-run`'s own output and a refused start run the real entry point. Bad values are
tests/test_refusals.py's.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.support.env import REPO, base_env, free_port, rank_env
from tests.support.harness import configured
from tests.support.outcomes import assert_refusal
from tests.support.processes import patiently, run_main, start_main
from utils.common.errors import EXIT_BAD_INPUT, JobError
from utils.config.settings import FIELDS, Settings, env_name, flag_name
from utils.config.sources import FLAG_ALIASES, describe_range, load_settings


def dry_run(tmp_path, *args: str, **env: str) -> dict:
    """The settings and ranks `python main.py --dry-run` prints, as main.configure resolves them for it, in this
    process with the job's environment `env` (test_dry_run_lists_every_setting_masks_the_token_and_imports_no_torch
    checks that the real process prints the same)."""
    with pytest.MonkeyPatch.context() as patch:
        from main import dry_run_view

        settings, dist, _, plan = configured(patch, base_env(tmp_path, **env), ["--dry-run", *args])
        shown = dry_run_view(settings, dist, plan)  # reads the token: inside `env`
    return json.loads(json.dumps(shown))


def refusal(tmp_path, *args: str, **env: str) -> str:
    """The one-line message `dry_run` is refused with, exit 2."""
    with pytest.raises(JobError) as refused:
        dry_run(tmp_path, *args, **env)
    message = refused.value.message
    assert refused.value.code == EXIT_BAD_INPUT and "\n" not in message, message
    return message


@pytest.mark.check
def test_defaults_env_and_flags_resolve_in_that_order(tmp_path):
    assert dry_run(tmp_path)["config"]["per_device_batch_size"] == 64
    assert dry_run(tmp_path, PER_DEVICE_BATCH_SIZE="32")["config"]["per_device_batch_size"] == 32
    resolved = dry_run(tmp_path, "--per-device-batch-size", "16", PER_DEVICE_BATCH_SIZE="32")["config"]
    assert resolved["per_device_batch_size"] == 16


def test_dry_run_lists_every_setting_masks_the_token_and_imports_no_torch(tmp_path):
    token = "hf_secret_value_that_must_not_leak"
    env = base_env(tmp_path, HF_TOKEN=token, PYTHONVERBOSE="1")
    result = run_main(env, "--dry-run")
    assert result.code == 0
    payload = result.json()
    # "deepspeed" too under STRATEGY=deepspeed
    assert set(payload) == {"config", "distributed", "plan", "identity", "batch", "task", "test_split", "strategy"}
    assert payload["test_split"] is None  # the Hub's data set: no test file is answered
    assert payload["strategy"] == payload["config"]["strategy"] == payload["plan"]["strategy"]
    assert payload["batch"] == payload["plan"]["batch"]
    assert set(FIELDS) | {"hf_token"} == set(payload["config"])
    assert payload["config"]["hf_token"] == "***"
    assert token not in result.stdout + result.stderr
    # PYTHONVERBOSE logs every import to stderr: neither torch nor transformers may appear.
    imported = {line.split()[1] for line in result.stderr.splitlines() if line.startswith("import ")}
    assert not {"torch", "transformers", "datasets", "peft"} & imported
    assert payload["config"] == dry_run(tmp_path, HF_TOKEN=token)["config"]  # what the tests below resolve
    assert payload["distributed"] == dry_run(tmp_path, HF_TOKEN=token)["distributed"]
    assert dry_run(tmp_path)["config"]["hf_token"] is None


@pytest.mark.check
def test_token_from_hf_token_path(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("hf_from_file_123\n")
    assert dry_run(tmp_path, HF_TOKEN_PATH=str(token_file))["config"]["hf_token"] == "***"


def test_help_lists_every_setting_with_env_name_default_and_why(tmp_path):
    result = run_main(base_env(tmp_path, COLUMNS="1000"), "--help")  # wide: argparse wraps no help text
    assert result.code == 0
    text = " ".join(result.stdout.split())
    assert "--dry-run" in text and "--push-only" in text and "HF_TOKEN" in text
    text = text[text.index("options:") :]  # past the usage line, which names every flag too
    # The recipe file is listed once, as --config; --config-file is still read, unlisted.
    assert "--config FILE" in text and "--config-file" not in result.stdout
    for field, info in FIELDS.items():
        if field == "config_file":
            continue
        entry = re.search(
            rf" {flag_name(field)} \S+ (.*?) \(default(?: factory)?: ([^)]*)\) \[env: {env_name(field)}\]", text
        )
        assert entry and entry[1] == info.description, field
    assert "(default: query,value)" in text  # list settings show the comma-separated form to type
    for alias, flag in FLAG_ALIASES.items():  # the other tools' names, each with the flag it is
        assert f"--{alias[2:].replace('-', '_')} ({flag})" in text, alias


@pytest.mark.check
def test_list_settings_are_comma_separated_in_env_and_flags(tmp_path):
    config = dry_run(tmp_path, "--report-to", "none", LORA_TARGET_MODULES="query, key,value", LABEL_NAMES="bad,good")
    assert config["config"]["lora_target_modules"] == ["query", "key", "value"]
    assert config["config"]["label_names"] == ["bad", "good"] and config["config"]["report_to"] == ["none"]
    flags = dry_run(tmp_path, "--lora-target-modules", "query,key", REPORT_TO="tensorboard,mlflow")["config"]
    assert flags["lora_target_modules"] == ["query", "key"] and flags["report_to"] == ["tensorboard", "mlflow"]


@pytest.mark.check
def test_blank_env_is_unset(tmp_path):
    # An empty flag, by contrast, is refused: tests/test_refusals.py
    config = dry_run(tmp_path, RESULT_MODEL_ID="", MAX_STEPS="  ", LEARNING_RATE="")["config"]
    assert config["result_model_id"] is None and config["max_steps"] is None


@pytest.mark.check
def test_settings_in_code_never_read_the_environment(monkeypatch):
    monkeypatch.setenv("LORA_R", "32")
    monkeypatch.setenv("SEED", "not a number")
    assert Settings().lora_r == 8 and Settings(lora_r=4).lora_r == 4
    settings, args = load_settings(["--push-only", "--seed", "7"], environ={"LORA_R": "16"})
    assert (settings.lora_r, settings.seed, args.push_only, args.dry_run) == (16, 7, True, False)


@pytest.mark.check
def test_run_name_is_derived_the_same_everywhere_and_changes_with_training_settings(tmp_path):
    first = dry_run(tmp_path, RANK="0", WORLD_SIZE="2", MASTER_ADDR="h")["config"]["run_name"]
    push = dict(RESULT_MODEL_ID="me/x", HF_TOKEN="hf_dry_run_token_0123", HF_HUB_OFFLINE="0")
    again = dry_run(tmp_path, RANK="1", WORLD_SIZE="2", MASTER_ADDR="h", **push)["config"]["run_name"]
    other = dry_run(tmp_path, LORA_R="16")["config"]["run_name"]
    assert first == again != other
    assert dry_run(tmp_path, RUN_NAME="mine")["config"]["run_name"] == "mine"


@pytest.mark.check
def test_output_dir_default_is_local_without_the_shared_volume(tmp_path):
    assert dry_run(tmp_path)["config"]["output_dir"] == "./output"


DISTRIBUTED = ("rank", "local_rank", "world_size", "node_rank", "master_addr", "master_port", "source")
# fmt: off
LAUNCHERS = [  # (environment, the distributed block's DISTRIBUTED values), a table: one launcher a row or two
    ({}, (0, 0, 1, 0, None, None, "single")),
    (dict(RANK="3", WORLD_SIZE="4", NODE_RANK="3", MASTER_ADDR="job-0", MASTER_PORT="23456"),
     (3, 0, 4, 3, "job-0", 23456, "platform")),
    (dict(RANK="2", WORLD_SIZE="4", MASTER_ADDR="sst2-master-0", MASTER_PORT="23456", PET_NODE_RANK="2",
          PET_NNODES="4", PET_NPROC_PER_NODE="1"), (2, 0, 4, 2, "sst2-master-0", 23456, "pytorchjob")),
    (dict(RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", GROUP_RANK="1", LOCAL_WORLD_SIZE="4", TORCHELASTIC_RUN_ID="x",
          MASTER_ADDR="10.0.0.1", MASTER_PORT="29400", SLURM_PROCID="1", SLURM_NTASKS="2"),
     (5, 1, 8, 1, "10.0.0.1", 29400, "torchrun")),
    (dict(SLURM_PROCID="6", SLURM_NTASKS="8", SLURM_LOCALID="2", SLURM_NODEID="1",
          SLURM_JOB_NODELIST="gpu-[01-04,07]"), (6, 2, 8, 1, "gpu-01", 29500, "slurm")),
    (dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_NODELIST="node7,node9"),
     (0, 0, 2, 0, "node7", 29500, "slurm")),
    # Four platform replicas, the port left to its default.
    *((dict(RANK=str(r), WORLD_SIZE="4", NODE_RANK=str(r), MASTER_ADDR="replica-0"),
       (r, 0, 4, r, "replica-0", 29500, "platform")) for r in range(4)),
    # Half a launcher's variables that one process has anyway: still one process.
    (dict(WORLD_SIZE="1", LOCAL_RANK="0", NODE_RANK="0"), (0, 0, 1, 0, None, None, "single")),
]
# fmt: on

# Slurm node lists (no scontrol here, so python-hostlist reads them): suffixes, several bracket
# groups, zero-padding, comma lists inside and outside brackets.
NODELISTS = [
    ("node[1-2]-ib", "node1-ib"),
    ("rack[1-2]-node[01-04]", "rack1-node01"),
    ("gpu-[007-010]", "gpu-007"),
    ("gpu-[03,01-02]", "gpu-03"),
    ("a[2-3]b[5,7]-ib0,c1", "a2b5-ib0"),
    ("login1,node[01-04]", "login1"),
    ("10.0.0.[5-6]", "10.0.0.5"),
]


@pytest.mark.check
@pytest.mark.parametrize("nodelist, first", NODELISTS, ids=[n for n, _ in NODELISTS])
def test_slurm_rendezvous_is_the_first_host_of_the_node_list(tmp_path, nodelist, first):
    env = dict(SLURM_PROCID="1", SLURM_NTASKS="4", SLURM_JOB_NODELIST=nodelist)
    assert dry_run(tmp_path, **env)["distributed"]["master_addr"] == first


@pytest.mark.check
def test_slurm_node_list_is_expanded_by_scontrol_where_it_exists(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "from-scontrol-%s\\nsecond\\n" "$3"\n'
    )
    (fake / "scontrol").chmod(0o755)
    env = dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="n[1-2]", PATH=f"{fake}:{os.environ['PATH']}")
    assert dry_run(tmp_path, **env)["distributed"]["master_addr"] == "from-scontrol-n[1-2]"
    # scontrol present but failing (no controller): the parser answers
    (fake / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    assert dry_run(tmp_path, **env)["distributed"]["master_addr"] == "n1"


@pytest.mark.check
@pytest.mark.parametrize("env, expected", LAUNCHERS, ids=[e[-1] + str(i) for i, (_, e) in enumerate(LAUNCHERS)])
def test_each_launcher_resolves_to_the_right_ranks(tmp_path, env, expected):
    assert dry_run(tmp_path, **env)["distributed"] == dict(zip(DISTRIBUTED, expected, strict=True))


@pytest.mark.check
def test_settings_doc_table_is_the_one_written_from_the_descriptions():
    from scripts.settings_doc import DOC, settings_table, with_table

    doc = DOC.read_text()
    assert with_table(doc) == doc, "docs/settings.md's settings table is stale: run python scripts/settings_doc.py"
    missing = [env_name(field) for field in FIELDS if f"| `{env_name(field)}` |" not in settings_table()]
    assert not missing, f"the settings table lacks {missing}"


@pytest.mark.check
@pytest.mark.parametrize(
    ("world_size", "extra", "rate", "loraplus"),
    [
        (1, {}, 1e-3, 8),  # the reference: global batch 64
        (4, {}, 1e-3, 8),  # the config.yaml deployment: the default global batch, 64, on any count
        (8, {}, 1e-3, 8),
        # The per-device rule: 128 rows on 2 replicas, 1e-3 x 2 ** 0.25 and 8 / 2 ** 0.5.
        (2, {"PER_DEVICE_BATCH_SIZE": "64"}, 0.00118921, 5.65685),
        (4, {"PER_DEVICE_BATCH_SIZE": "64"}, 0.00141421, 4),  # 256
        (8, {"PER_DEVICE_BATCH_SIZE": "64"}, 0.00168179, 2.82843),
        (2, {"GRADIENT_ACCUMULATION_STEPS": "2"}, 0.00141421, 4),  # accumulation counts in the global batch
        (2, {"PER_DEVICE_BATCH_SIZE": "32"}, 1e-3, 8),
        (1, {"PER_DEVICE_BATCH_SIZE": "16"}, 0.000707107, 8),  # below the reference batch LoRA+ stays at 8
        (1, {"GLOBAL_BATCH_SIZE": "8192"}, 0.00336359, 1),  # and never falls below plain LoRA
        (4, {"GLOBAL_BATCH_SIZE": "256", "LEARNING_RATE": "5e-4"}, 5e-4, 4),  # set by the user: exactly that
        (4, {"GLOBAL_BATCH_SIZE": "256", "LORAPLUS_LR_RATIO": "8"}, 0.00141421, 8),
        (4, {"GLOBAL_BATCH_SIZE": "256", "LEARNING_RATE_SCALING": "sqrt"}, 2e-3, 4),
    ],
)
def test_dry_run_shows_the_rates_the_global_batch_gets(tmp_path, world_size, extra, rate, loraplus):
    launcher = dict(RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1") if world_size > 1 else {}
    plan = dry_run(tmp_path, **launcher, **extra)["plan"]
    assert (plan["learning_rate"], plan["loraplus_ratio"]) == (rate, loraplus)


# ------------------------------------------------------------------------------- every setting's range
# One value just past each setting's range: refused at --dry-run (exit 2), one line naming the setting and its
# range, so nothing --dry-run accepts can overflow later (a thread wait, a timedelta, numpy's seed, a batch).
PATH = "p" * 4097
# fmt: off
OVER_THE_BOUND = {  # a table: several settings a line
    "int8_threshold": ("1001", "1000"), "early_stopping_patience": ("1001", "1000"), "config_file": (PATH, "4096"),
    "model_name": (PATH, "4096"), "dataset_name": ("d" * 256, "255"), "dataset_config": ("c" * 256, "255"),
    "dataset_path": (PATH, "4096"), "train_file": (PATH, "4096"), "validation_file": (PATH, "4096"),
    "test_file": (PATH, "4096"), "validation_split": ("0.51", "(range: above 0 to 0.5)"),
    "max_train_samples": ("1000000001", "(range: 1 to 1000000000)"),
    "max_eval_samples": ("1000000001", "(range: 1 to 1000000000)"), "text_column": ("t" * 256, "255"),
    "label_column": ("l" * 256, "255"), "label_columns": (",".join(["c"] * 10001), "10000"),
    "threshold": ("1", "(range: above 0 to below 1)"), "base_model_id": ("me/" + "b" * 97, "your-name/model-name"),
    "output_dir": (PATH, "4096"), "run_name": ("r" * 101, "1-100"), "num_epochs": ("1001", "(range: above 0 to 1000)"),
    "max_steps": ("100000001", "(range: 1 to 100000000)"), "per_device_batch_size": ("65537", "(range: 1 to 65536)"),
    "per_device_eval_batch_size": ("100000000000000000000000", "(range: 1 to 65536)"),
    "gradient_accumulation_steps": ("65537", "(range: 1 to 65536)"),
    "global_batch_size": ("1000001", "(range: 1 to 1000000)"), "learning_rate": ("1", "(range: above 0 to below 1)"),
    "base_learning_rate": ("1", "(range: above 0 to below 1)"), "weight_decay": ("1", "(range: 0 to below 1)"),
    "warmup_ratio": ("1", "(range: 0 to below 1)"), "lora_r": ("4097", "(range: 1 to 4096)"),
    "lora_alpha": ("65537", "(range: 1 to 65536)"), "lora_dropout": ("1", "(range: 0 to below 1)"),
    "lora_target_modules": (",".join(["query"] * 257), "256"),
    "head_learning_rate_ratio": ("1001", "(range: above 0 to 1000)"),
    "loraplus_lr_ratio": ("1001", "(range: above 0 to 1000)"), "model_dropout": ("1", "less than 1"),
    "zero_stage": ("4", "(range: 1 to 3)"), "deepspeed_config": (PATH, "4096"),
    "max_seq_length": ("513", "(range: 8 to 512)"), "dataloader_num_workers": ("257", "(range: 0 to 256)"),
    "seed": (str(2**32), "(range: 0 to 4294967295)"), "save_steps": ("1000000001", "(range: 1 to 1000000000)"),
    "save_total_limit": ("1001", "(range: 1 to 1000)"), "rendezvous_timeout": ("100000000000", "(range: 10 to 86400)"),
    "result_model_id": ("me/" + "m" * 97, "your-name/model-name"), "hub_timeout": ("601", "(range: above 0 to 600)"),
    "push_timeout": ("86401", "(range: above 0 to 86400)"),
    "result_merged_model_id": ("me/" + "m" * 97, "your-name/model-name"),
    "eval_steps": ("1000000001", "(range: 0 to 1000000000)"),
    "logging_steps": ("1000000001", "(range: 1 to 1000000000)"),
}
# fmt: on
# Bounded by their type: a choice among names, a boolean (anything else is refused as it is typed), and
# LABEL_NAMES, whose count and names its own check holds (tests/test_tasks.py).
BOUNDED_BY_TYPE = {
    *("learning_rate_scaling", "train_pooler", "lora_variant", "lora_init", "quantization", "precision", "strategy"),
    *("zero_offload", "gradient_checkpointing", "torch_compile", "hub_private", "merge_adapter", "report_to"),
    *("label_names", "task", "problem_type", "cuda_graphs", "load_best_model", "class_weights"),
}
# Values the settings derive, each from factors inside their own ranges.
# fmt: off
DERIVED_OVER_THE_BOUND = [
    pytest.param({"PER_DEVICE_BATCH_SIZE": "65536", "GRADIENT_ACCUMULATION_STEPS": "16"},
                 ["1048576", "PER_DEVICE_BATCH_SIZE=65536", "GRADIENT_ACCUMULATION_STEPS=16", "1000000"],
                 id="global-batch"),
    pytest.param({"PER_DEVICE_BATCH_SIZE": "65536", "RANK": "0", "WORLD_SIZE": "16", "MASTER_ADDR": "h"},
                 ["1048576", "PER_DEVICE_BATCH_SIZE=65536", "16 replica(s)"], id="global-batch-of-replicas"),
    pytest.param({"LEARNING_RATE_SCALING": "linear", "GLOBAL_BATCH_SIZE": "65536"},
                 ["LEARNING_RATE_SCALING=linear", "1.024"], id="learning-rate"),
]
# fmt: on


@pytest.mark.check
def test_every_setting_has_a_range():
    assert set(OVER_THE_BOUND) | BOUNDED_BY_TYPE == set(FIELDS), "give the new setting a bound and a row here"


@pytest.mark.check
@pytest.mark.parametrize("field", sorted(OVER_THE_BOUND))
def test_a_value_past_a_settings_range_is_refused_at_dry_run(tmp_path, field):
    value, bound = OVER_THE_BOUND[field]
    message = refusal(tmp_path, **{env_name(field): value})
    # The setting as given, its bound, and the flag that sets it too.
    assert message.startswith(f"{env_name(field)}=") and bound in message and flag_name(field) in message, message


@pytest.mark.check
@pytest.mark.parametrize("env, names", DERIVED_OVER_THE_BOUND)
def test_a_derived_value_past_its_range_is_refused_at_dry_run(tmp_path, env, names):
    message = refusal(tmp_path, **env)
    assert [name for name in names if name not in message] == [], message


@pytest.mark.parametrize(
    "env",
    [{"PER_DEVICE_EVAL_BATCH_SIZE": "100000000000000000000000"}, {"RENDEZVOUS_TIMEOUT": "1e23"}, {"SEED": "-1"}],
    ids=["eval-batch", "timeout-float", "seed"],
)
def test_dry_run_process_refuses_an_unbounded_value_in_one_line(tmp_path, env):
    result = run_main(base_env(tmp_path, **env), "--dry-run")
    assert result.code == 2 and result.stdout == "", result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: {next(iter(env))}=") and "Traceback" not in result.stderr


def test_two_ranks_with_a_huge_rendezvous_timeout_are_refused_at_once(tmp_path):
    """RENDEZVOUS_TIMEOUT=1e11 overflowed the watchdog thread's wait: the thread died and the 2-rank job hung
    until killed, then again after each restart. Both ranks now refuse it before they meet."""
    port, out = free_port(), tmp_path / "out"
    ranks = [
        start_main(
            rank_env(tmp_path, rank, 2, port, OUTPUT_DIR=str(out), RENDEZVOUS_TIMEOUT="100000000000"),
            log=tmp_path / f"rank-{rank}.out",
        )
        for rank in range(2)
    ]
    codes = [patiently(rank.wait, 120) for rank in ranks]
    assert codes == [2, 2]
    for rank in range(2):
        output = (tmp_path / f"rank-{rank}.out").read_text()
        assert_refusal(output, ["RENDEZVOUS_TIMEOUT=100000000000", "10 to 86400", "--rendezvous-timeout"])
    assert not out.exists()  # refused before the run folder


# ------------------------------------------------------------------------------- a recipe file
@pytest.mark.check
def test_recipe_file_sits_between_the_defaults_and_the_environment(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lora_r: 4\nLORA_ALPHA: 8\nseed: 7\nlora_target_modules: [query, key]\nhub_private: no\n")
    config = dry_run(tmp_path, "--config", str(recipe))["config"]
    assert (config["lora_r"], config["lora_alpha"], config["seed"]) == (4, 8, 7)
    assert config["lora_target_modules"] == ["query", "key"] and config["hub_private"] is False
    assert config["config_file"] == str(recipe)  # what --dry-run and run.json record
    assert config["run_name"] != dry_run(tmp_path)["config"]["run_name"]  # the recipe's values name the run
    # the environment wins over the file, a flag over both; CONFIG_FILE is the same as --config
    config = dry_run(tmp_path, "--seed", "9", CONFIG_FILE=str(recipe), SEED="8", LORA_R="16")["config"]
    assert (config["lora_r"], config["seed"], config["lora_alpha"], config["config_file"]) == (16, 9, 8, str(recipe))
    other = tmp_path / "other.yaml"
    other.write_text("lora_r: 2\n")
    config = dry_run(tmp_path, "--config", str(other), CONFIG_FILE=str(recipe))["config"]
    assert (config["lora_r"], config["config_file"]) == (2, str(other))  # a flag's file over the environment's


@pytest.mark.check
def test_the_sst2_recipe_is_the_defaults(tmp_path):
    recipe, defaults = dry_run(tmp_path, "--config", str(REPO / "recipes" / "sst2.yaml")), dry_run(tmp_path)
    assert {**recipe["config"], "config_file": None} == defaults["config"]
    # What it trains too: a batch setting written out (even at its default) would switch the global batch from
    # the default (64 on any replica count) to the per-device rule.
    assert recipe["plan"] == defaults["plan"]


@pytest.mark.check
@pytest.mark.parametrize(
    "text, says",
    [
        pytest.param("lora_rank: 4\n", "holds lora_rank, which is not a setting (did you mean lora_r?)", id="unknown"),
        pytest.param(
            "hf_token: hf_abcdefghijklmnop\n", "holds hf_token: a secret does not belong in a recipe", id="token"
        ),
        pytest.param(
            "HF_TOKEN_PATH: /run/secrets/token\n", "set HF_TOKEN, or HF_TOKEN_PATH to a mounted file", id="token-path"
        ),
        pytest.param("config_file: other.yaml\n", "names another recipe", id="nested"),
        pytest.param("lora_r: 4\nLORA_R: 8\n", "sets lora_r twice", id="twice"),
        pytest.param("- lora_r\n- 4\n", "holds a YAML list, not a mapping of settings", id="list"),
        pytest.param("lora_r: [4\n", "is not valid YAML at line 2", id="yaml"),
        pytest.param("lora_r: 100000\n", "lora_r: 100000 in CONFIG_FILE=", id="value"),
        pytest.param(b"lora_r: \xe9\n", "is not a text file (not UTF-8)", id="binary"),
        pytest.param(None, "does not exist; point --config or CONFIG_FILE at a YAML file", id="missing"),
        pytest.param("folder", "is not a regular file (a directory)", id="folder"),
        pytest.param("fifo", "is not a regular file", id="fifo"),  # at once: a named pipe is never read
    ],
)
def test_a_bad_recipe_is_refused_in_one_line(tmp_path, text, says):
    recipe = tmp_path / "recipe.yaml"
    if text == "folder":
        recipe.mkdir()
    elif text == "fifo":
        os.mkfifo(recipe)
    elif isinstance(text, bytes):
        recipe.write_bytes(text)
    elif text is not None:
        recipe.write_text(text)
    message = refusal(tmp_path, "--config", str(recipe))
    assert says in message and "hf_abcdefghijklmnop" not in message, message


def test_a_bad_recipe_is_one_error_line_from_the_process(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learnig_rate: 1e-4\n")
    result = run_main(base_env(tmp_path, CONFIG_FILE=str(recipe)), "--dry-run")
    assert result.code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: CONFIG_FILE={recipe} holds learnig_rate, which is not a setting (did you mean learning_rate?); "
        "fix the name, or remove it (`python main.py --help` lists the settings)"
    ]


# ------------------------------------------------------------------------------- misspelled variables, --help
@pytest.mark.check
def test_a_misspelled_variable_is_warned_about_not_refused(tmp_path, capsys):
    shown = dry_run(tmp_path, LEARNIG_RATE="1e-4", LORA_RANK="4", ZERO_STAGES="3", LORA_R="16")
    assert shown["plan"]["learning_rate"] == 1e-3 and shown["config"]["lora_r"] == 16  # ignored, as before
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert [line.split()[1] for line in warnings] == ["LEARNIG_RATE", "LORA_RANK", "ZERO_STAGES"]
    assert "did you mean LEARNING_RATE?" in warnings[0] and "did you mean LORA_R?" in warnings[1]
    assert "did you mean ZERO_STAGE?" in warnings[2]


@pytest.mark.check
@pytest.mark.parametrize("env", [{}, *(launcher for launcher, _ in LAUNCHERS)], ids=lambda env: env.get("RANK", "-"))
def test_a_clean_environment_under_any_launcher_warns_about_nothing(tmp_path, env, capsys):
    torchrun = dict(TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="3", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    platform = dict(PET_MASTER_ADDR="m", PET_MASTER_PORT="23456", MAX_JOBS="2", HF_HUB_ENABLE_HF_TRANSFER="1")
    shell = dict(OMP_NUM_THREADS="1", NCCL_DEBUG="INFO", CUDA_DEVICE_MAX_CONNECTIONS="1", HOSTNAME="pod-0")
    dry_run(tmp_path, **env, **torchrun, **platform, **shell, HF_TOKEN_PATH="", CONFIG_FILE="")
    assert "warning: " not in capsys.readouterr().err  # this machine's own environment (base_env) included


def test_help_answers_whatever_hf_token_holds_and_never_shows_it(tmp_path):
    for token in ("bad", "hf_half_a_token\nsecond_line_value"):
        result = run_main(base_env(tmp_path, HF_TOKEN=token, LEARNIG_RATE="1"), "--help")
        assert result.code == 0 and "usage: main.py" in result.stdout and result.stderr == "", result.stderr
        assert not any(line and line in result.stdout for line in token.splitlines() if len(line) > 5)
    refused = run_main(base_env(tmp_path, HF_TOKEN="bad"), "--dry-run")
    assert_refusal(refused, ["HF_TOKEN", "3 characters"])


@pytest.mark.check
def test_settings_doc_states_every_range_the_code_holds():
    doc = (REPO / "docs" / "settings.md").read_text()
    ranges = {env_name(f): describe_range(f).removeprefix(" (range: ").removesuffix(")") for f in FIELDS}
    missing = [f"{name}: {shown}" for name, shown in ranges.items() if shown and f"| `{name}` | {shown} |" not in doc]
    assert not missing, f"docs/settings.md's ranges table lacks or misstates {missing}"


@pytest.mark.check
def test_the_shipped_config_maps_start_without_a_token_and_warn_about_nothing(tmp_path, capsys):
    """Applied as shipped, with no Hub token (the Secret is optional): the job trains and keeps the model on the
    volume; a RESULT_MODEL_ID left in would stop every replica at once (exit 2)."""
    import yaml

    platform = yaml.safe_load((REPO / "config.yaml").read_text())["config_map"]
    kubernetes = yaml.safe_load((REPO / "k8s" / "base" / "configmap.yaml").read_text())["data"]
    for config_map in (platform, kubernetes):
        # every key a setting (or the one thread count torch reads): a misspelled one would be ignored in silence
        assert set(config_map) - {env_name(field) for field in FIELDS} <= {"OMP_NUM_THREADS"}, sorted(config_map)
        config = dry_run(tmp_path, **{**config_map, "OUTPUT_DIR": str(tmp_path / "out")})["config"]
        assert config["result_model_id"] is None and config["hf_token"] is None
        assert "warning: " not in capsys.readouterr().err


# ------------------------------------------------------------------------------- the flags people type
@pytest.mark.check
def test_run_glue_and_trainer_flag_names_resolve_to_the_jobs_settings(tmp_path):
    theirs = dry_run(
        tmp_path,
        *("--model_name_or_path", "models/tiny", "--learning_rate", "2e-5", "--num_train_epochs", "2"),
        *("--per_device_train_batch_size", "16", "--output_dir", str(tmp_path / "out"), "--max_seq_length", "64"),
        *("--seed", "7", "--task_name=mnli", "--lora_r=4", "--hub_private_repo", "false"),
    )["config"]
    ours = dry_run(
        tmp_path,
        *("--model-name", "models/tiny", "--learning-rate", "2e-5", "--num-epochs", "2"),
        *("--per-device-batch-size", "16", "--output-dir", str(tmp_path / "out"), "--max-seq-length", "64"),
        *("--seed", "7", "--task", "mnli", "--lora-r", "4", "--hub-private", "false"),
    )["config"]
    names = ("model_name", "learning_rate", "num_epochs", "per_device_batch_size", "output_dir", "max_seq_length")
    resolved = [theirs[name] for name in (*names, "seed", "task", "lora_r", "hub_private")]
    assert resolved == ["models/tiny", 2e-5, 2, 16, str(tmp_path / "out"), 64, 7, "mnli", 4, False]
    assert theirs == ours


BATCH_GIVEN = ("per_device_batch_size", "gradient_accumulation_steps")


@pytest.mark.check
def test_every_flag_is_taken_with_underscores(tmp_path):
    """Each setting's flag typed the run_glue way (`--per_device_eval_batch_size`), with its default as the value:
    accepted, and resolved to what the defaults are."""
    defaults = dry_run(tmp_path)["config"]
    typed = [
        (f"--{name}", ",".join(map(str, value)) if isinstance(value, list) else str(value).lower())
        for name, value in defaults.items()
        # Given at all, a batch setting picks the per-device batch rule over the default global batch (utils/config/plan.py).
        if name in FIELDS and value is not None and name not in ("run_name", *BATCH_GIVEN)
    ]
    assert len(typed) > 30
    assert dry_run(tmp_path, *(part for pair in typed for part in pair))["config"] == defaults


@pytest.mark.check
@pytest.mark.parametrize(
    "args, says",
    [
        pytest.param(["--lerning-rate", "2e-5"], "--lerning-rate 2e-5 (did you mean --learning-rate?)", id="misspelt"),
        # an alias misspelt: the job's flag
        pytest.param(["--num_train_epoch", "2"], "(did you mean --num-epochs?)", id="alias-misspelt"),
        pytest.param(["--epochs", "2"], "(did you mean --num-epochs?)", id="short"),
        pytest.param(["lora_r=16"], "lora_r=16 (a setting is given as a flag: --lora-r 16)", id="key=value"),
        pytest.param(["--do_train"], "this job always trains; leave it out", id="do-train"),
        pytest.param(["--bf16"], "use --precision bf16", id="bf16"),
        # not --strategy, which is another thing; not --lora-rank
        pytest.param(["--eval_strategy", "steps"], "every --eval-steps steps", id="eval-strategy"),
        pytest.param(["--local_rank=0"], "the launcher's LOCAL_RANK says it", id="local-rank"),
        pytest.param(["--frobnicate"], "unrecognized arguments: --frobnicate; see `python main.py --help`", id="far"),
    ],
)
def test_an_unknown_flag_is_refused_with_the_flag_meant(tmp_path, args, says):
    assert says in refusal(tmp_path, *args)


def test_an_unknown_flag_is_one_error_line_from_the_process(tmp_path):
    result = run_main(base_env(tmp_path), "--dry-run", "--learning_rate", "2e-5", "--lerning-rate", "2e-5")
    assert result.stdout == ""
    assert_refusal(result, ["--lerning-rate", "did you mean --learning-rate?", "python main.py --help"])


@pytest.mark.check
@pytest.mark.parametrize(
    "path, names",
    [
        ("config.yaml", ["managed platform's job file", "resources, replicas", "config_map", "recipes/"]),
        ("k8s/base/configmap.yaml", ["Kubernetes manifest", "recipes/"]),
        ("launchers/accelerate/multi-gpu.yaml", ["accelerate config", "--config_file", "recipes/"]),
    ],
)
def test_another_yaml_file_of_the_repo_given_as_a_recipe_is_named_as_what_it_is(tmp_path, path, names):
    message = refusal(tmp_path, "--config", str(REPO / path))
    assert [name for name in names if name not in message] == [], message


@pytest.mark.check
def test_the_settings_doc_names_every_flag_alias():
    doc = (REPO / "docs" / "settings.md").read_text()
    missing = [alias for alias in FLAG_ALIASES if f"`--{alias[2:].replace('-', '_')}`" not in doc]
    assert not missing, f"docs/settings.md does not name {missing}"
