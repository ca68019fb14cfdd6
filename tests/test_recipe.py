"""The recipe's options do what their settings say (utils/config/recipe.py): the head trained in full beside the
adapters (TRAIN_POOLER, DistilBERT's pre_classifier), the rates of the optimizer the job's Trainer really builds
(LoRA+, HEAD_LEARNING_RATE_RATIO, no decay on biases), and the base model's dropout (MODEL_DROPOUT). And what the
job derives is held to the checks a value typed in gets, so no run ends with nothing trained: the rate the batch
rule resolves, the warm-up of a one-step run, a global batch larger than the data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DistilBertConfig, DistilBertForSequenceClassification

from tests.support.data import write_files
from tests.support.env import REPO, base_env, tiny_run_env, tiny_run_settings
from tests.support.harness import configured, start_in_process
from tests.support.outcomes import assert_refusal
from tests.support.processes import run_main, wait_all
from utils.config.settings import Settings
from utils.config.tasks import GLUE
from utils.training.model import ModelChoices, build_model

RATE = 1e-3


@pytest.fixture(scope="module")
def pooler_runs(tmp_path_factory, tiny_bert, sst2_dir):
    """One epoch with the pooler trained (the default) and one with TRAIN_POOLER=false, as real processes."""
    outs = {}
    for name, extra in (("trained", {}), ("frozen", {"TRAIN_POOLER": "false"})):
        tmp = tmp_path_factory.mktemp(name)
        result = run_main(tiny_run_env(tmp, tiny_bert, sst2_dir, NUM_EPOCHS=1, **extra))
        assert result.code == 0, result.stderr[-3000:]
        outs[name] = tmp / "out"
    return outs


def adapter_weights(out) -> dict[str, torch.Tensor]:
    return load_file(out / "model" / "adapter_model.safetensors")


def test_the_pooler_trains_with_the_classifier_and_is_published_with_the_adapter(pooler_runs, tiny_bert):
    base = load_file(tiny_bert / "model.safetensors")
    trained = {k: v for k, v in adapter_weights(pooler_runs["trained"]).items() if "pooler" in k}
    assert trained, "TRAIN_POOLER=true (the default) published no pooler weights beside the adapter"
    weight = next(v for k, v in trained.items() if k.endswith("pooler.dense.weight"))
    assert not torch.equal(weight, base["bert.pooler.dense.weight"]), (
        "the published pooler is the base's: it never trained"
    )
    config = json.loads((pooler_runs["trained"] / "model" / "adapter_config.json").read_text())
    assert "pooler" in config["modules_to_save"]


def test_train_pooler_false_leaves_the_pooler_to_the_base(pooler_runs):
    weights = adapter_weights(pooler_runs["frozen"])
    assert not [k for k in weights if "pooler" in k]
    assert [k for k in weights if "classifier" in k], "the classifier must be published whatever TRAIN_POOLER says"
    record = json.loads((pooler_runs["frozen"] / "run.json").read_text())
    assert record["settings"]["train_pooler"] is False


@pytest.mark.check
@pytest.mark.parametrize(
    ("batch", "b_ratio"),
    [
        ({"LORAPLUS_LR_RATIO": "8"}, 8),
        # Unset, the ratio follows the global batch: 4 at 256, the 4-replica deployment's batch.
        ({"GLOBAL_BATCH_SIZE": "256"}, 4),
    ],
    ids=["set", "following-the-batch"],
)
def test_the_optimizer_trains_each_group_at_its_rate(tmp_path, job_env, monkeypatch, batch, b_ratio):
    # The Trainer the job's own start-up builds (main.main, stopped at the first step) from these settings.
    env = {**job_env, "LEARNING_RATE": str(RATE), "HEAD_LEARNING_RATE_RATIO": "3", "WEIGHT_DECAY": "0.01", **batch}
    start = start_in_process(monkeypatch, env)
    assert start.ready is not None, start.stderr[-3000:]
    trainer = start.ready.trainer
    optimizer = trainer.create_optimizer()
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert len(group_of) == len(trainable), "the optimizer holds other weights than the trainable ones"
    kinds = set()
    for name, param in trainable:
        if "lora_B" in name:
            kind, rate = "B", b_ratio * RATE
        elif "classifier" in name or "pooler" in name:
            kind, rate = "head", 3 * RATE
        else:
            kind, rate = "A", RATE
        kinds.add(kind)
        group = group_of[id(param)]
        assert group["lr"] == pytest.approx(rate), f"{name} trains at {group['lr']:g}, not {rate:g}"
        assert group["weight_decay"] == (0.01 if param.ndim > 1 else 0.0), (
            f"{name}: weight decay {group['weight_decay']}"
        )
    assert kinds == {"A", "B", "head"}


def dropouts(model: torch.nn.Module) -> dict[str, float]:
    """p of every Dropout module: the base model's and the adapters' (lora_dropout)."""
    return {name: module.p for name, module in model.named_modules() if isinstance(module, torch.nn.Dropout)}


@pytest.mark.check
def test_model_dropout_sets_the_base_models_dropout_and_leaves_the_adapters(tiny_bert):
    kept = build_model(
        Settings(model_name=str(tiny_bert), model_dropout="checkpoint").select(ModelChoices),
        "none",
        torch.device("cpu"),
    )
    assert {p for name, p in dropouts(kept).items() if "lora_dropout" not in name} == {0.1}  # the checkpoint's

    model = build_model(
        Settings(model_name=str(tiny_bert)).select(ModelChoices), "none", torch.device("cpu")
    )  # the default: 0
    base = {name: p for name, p in dropouts(model).items() if "lora_dropout" not in name}
    adapters = {name: p for name, p in dropouts(model).items() if "lora_dropout" in name}
    assert base and set(base.values()) == {0.0}, base
    assert adapters and set(adapters.values()) == {0.05}, "LORA_DROPOUT is the adapter's and stays as set"
    config = model.get_base_model().config
    assert (config.hidden_dropout_prob, config.attention_probs_dropout_prob) == (0.0, 0.0)  # SDPA reads the config


@pytest.fixture(scope="module")
def tiny_distilbert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distilbert")
    config = DistilBertConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, hidden_dim=64, num_labels=2)
    DistilBertForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.mark.check
def test_distilbert_trains_its_pre_classifier_and_takes_model_dropout_by_its_own_names(tiny_distilbert):
    settings = Settings(model_name=str(tiny_distilbert), lora_target_modules="q_lin,v_lin", model_dropout=0.0)
    model = build_model(settings.select(ModelChoices), "none", torch.device("cpu"))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert [n for n in trainable if "pre_classifier" in n], (
        "pre_classifier is as new as the classifier; frozen it stays random"
    )
    config = model.get_base_model().config
    assert (config.dropout, config.attention_dropout) == (0.0, 0.0)


@pytest.mark.parametrize(
    "value, shown", [(None, 0.0), ("checkpoint", "checkpoint"), ("0.1", 0.1), ("1.5", None), ("none", None)]
)
def test_model_dropout_values_in_the_dry_run(job_env, value, shown):
    env = {**job_env, **({"MODEL_DROPOUT": value} if value is not None else {})}
    result = run_main(env, "--dry-run")
    if shown is None:
        assert_refusal(result, ["MODEL_DROPOUT", value])
    else:
        assert result.code == 0, result.stderr[-2000:]
        assert json.loads(result.stdout)["config"]["model_dropout"] == shown


# ------------------------------------------------------------------------------- values the job derives
FOUR = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "launch, batch, world",
    [({}, 65_536, 1), (FOUR, 16_384, 4)],  # PER_DEVICE_BATCH_SIZE's bound on one replica: a global batch of 65536
    ids=["one-replica", "four-replicas"],
)
def test_a_rate_the_batch_rule_resolves_is_checked_like_one_typed_in(job_env, launch, batch, world):
    """LEARNING_RATE_SCALING=linear at a huge global batch resolved to a rate LEARNING_RATE itself refuses, and
    trained a diverged model with exit 0. --dry-run resolves the rate too, so it refuses it as the run would."""
    env = {k: v for k, v in job_env.items() if k != "LEARNING_RATE"}
    env.update(launch, LEARNING_RATE_SCALING="linear", PER_DEVICE_BATCH_SIZE=str(batch))
    # The rule, the rate and batch it resolved, the setting that refuses it, and the other rules' rates.
    says = ["1.024", "65536", f"PER_DEVICE_BATCH_SIZE={batch}", f"{world} replica(s)", "LEARNING_RATE"]
    for args in (["--dry-run"], []):
        assert_refusal(
            run_main(env, *args), ["LEARNING_RATE_SCALING=linear", *says, "LEARNING_RATE_SCALING=fourth-root"]
        )
        assert not (Path(env["OUTPUT_DIR"]) / "run.json").exists()

    # The same bound as a rate typed in, which is refused by the settings themselves.
    typed = run_main({**env, "LEARNING_RATE": "1.5", "LEARNING_RATE_SCALING": "none"}, "--dry-run")
    assert typed.code == 2 and "LEARNING_RATE=1.5 is invalid: Input should be less than 1" in typed.stderr
    # The default rule at the same batch stays in bounds: the run is not refused for its batch alone.
    gentle = run_main({**env, "LEARNING_RATE_SCALING": "fourth-root"}, "--dry-run")
    assert gentle.code == 0, gentle.stderr[-2000:]
    assert 0 < json.loads(gentle.stdout)["plan"]["learning_rate"] < 1


@pytest.mark.parametrize(
    "steps",
    [{"MAX_STEPS": "1"}, {"NUM_EPOCHS": "1", "PER_DEVICE_BATCH_SIZE": "2000"}],
    ids=["max-steps-1", "one-step-an-epoch"],
)
def test_a_one_step_run_trains_the_adapters_and_the_head(tmp_path, tiny_bert, sst2_dir, steps):
    """6% warm-up of one step rounded up to the whole run, whose only step ran at rate 0: every lora_B stayed 0
    and the head kept the base's weights, exit 0. The warm-up now always leaves a step at the full rate.
    The second case is also the largest global batch accepted: the whole training split (2000 rows)."""
    settings = tiny_run_settings(tiny_bert, sst2_dir, tmp_path / "out", REPORT_TO="none", **steps)
    if "MAX_STEPS" in steps:
        settings.pop("NUM_EPOCHS")
    result = run_main(base_env(tmp_path, **settings))
    assert result.code == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert json.loads((out / "metrics.json").read_text())["global_batch"] <= 2000
    weights = adapter_weights(out)
    lora_b = {name: tensor for name, tensor in weights.items() if "lora_B" in name}
    assert lora_b and all(tensor.abs().max() > 0 for tensor in lora_b.values()), {
        name: float(tensor.abs().max()) for name, tensor in lora_b.items()
    }
    base = load_file(tiny_bert / "model.safetensors")
    [head] = [tensor for name, tensor in weights.items() if name.endswith("classifier.weight")]
    assert not torch.equal(head, base["classifier.weight"]), "the head kept the base model's weights: it never trained"


def test_a_global_batch_larger_than_the_training_split_stops_every_replica(tmp_path, tiny_bert, sst2_dir, replicas):
    """2 replicas x 1001 rows a step > the 2000 training rows: both ranks take the same decision from the same
    data, each says why and the fix, and exits 2 before any training step (no peer left waiting)."""
    settings = tiny_run_settings(
        tiny_bert, sst2_dir, tmp_path / "out", PER_DEVICE_BATCH_SIZE=1001, RENDEZVOUS_TIMEOUT=60, REPORT_TO="none"
    )
    procs = replicas.start("batch", settings)
    assert wait_all(procs, timeout=240) == [2, 2]
    for stream in replicas.streams:
        text = stream.read_text()
        names = ["2002 rows", "PER_DEVICE_BATCH_SIZE=1001", "2 replica(s)", "GRADIENT_ACCUMULATION_STEPS=1", "2000"]
        assert_refusal(text, [*names, "1000"])
    assert not list((tmp_path / "out").glob("checkpoints/checkpoint-*")) and not (tmp_path / "out" / "model").exists()


# ------------------------------------------------------------------------------- the recipe files
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.check
@pytest.mark.parametrize("recipe", RECIPES, ids=[path.name for path in RECIPES])
def test_a_shipped_recipe_pins_nothing_that_breaks_another_task(recipe, tmp_path, monkeypatch):
    """Each shipped recipe, under each TASK the environment names: the task's data settings, none refused for a
    value the recipe pinned (TASK=cola --config recipes/sst2.yaml)."""
    for task, spec in GLUE.items():
        env = base_env(tmp_path, TASK=task, OUTPUT_DIR=str(tmp_path / "out"))
        settings = configured(monkeypatch, env, ["--config", str(recipe)])[0]
        seen = (settings.task, settings.dataset_config, settings.text_columns)
        assert seen == (task, spec.dataset_config, spec.text_columns)


@pytest.mark.check
def test_relative_paths_in_a_recipe_resolve_against_the_working_directory(tmp_path, monkeypatch, sst2_dir):
    """The documented base (docs/settings.md, Recipe files): the directory the job starts in, not the recipe's."""
    from utils.run_folder.record import open_run_dir
    from utils.training.data import DataSource, load_raw

    shutil.copytree(sst2_dir, tmp_path / "data")
    recipe = write_files(tmp_path / "recipes", {"r.yaml": "dataset_path: data\noutput_dir: out\n"}) / "r.yaml"
    (tmp_path / "recipes" / "data").mkdir()  # the same name beside the recipe: an empty folder, not the data
    monkeypatch.chdir(tmp_path)
    settings, _, _, plan = configured(monkeypatch, base_env(tmp_path), ["--config", str(recipe)])
    rows = len((sst2_dir / "train.csv").read_text().splitlines()) - 1  # one sentence a line, after the header
    assert load_raw(settings.select(DataSource))["train"].num_rows == rows
    open_run_dir(settings.output_dir, plan, None, settings.base_model_id)
    assert (tmp_path / "out").is_dir() and not (tmp_path / "recipes" / "out").exists()
