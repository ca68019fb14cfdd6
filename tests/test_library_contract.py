"""What the job relies on inside its libraries, beyond their public API, checked on the installed versions.

Each test names the library and its version when it fails, and what in the job stops working.

transformers' Trainer: JobTrainer (utils/trainer.py) overrides three private methods. `_get_train_sampler` and
`_get_eval_sampler`: the public route (`train_sampling_strategy="group_by_length"` with a `length` column)
measures every row again, draws each epoch's order from the global RNG (a resume in epoch 2 or later trains
other batches) and reorders evaluation. `_save_checkpoint`: a save a full volume cut short must end every rank
alike. A library upgrade can rename those methods, stop calling them, or change what the loaders do around
them; the job would then train other batches, evaluate reordered rows or fail as a traceback without a word.
The progress callback's `training_bar` is closed by the job before an error line (utils/run.py), and
`_no_split_modules` names the blocks FSDP shards (utils/strategy.py); `_attn_implementation` is how the
benchmarks read the attention the model runs.

pydantic-settings: load_settings (utils/settings.py) reads any mapping as the environment by overriding
`EnvSettingsSource._load_env_vars`, builds Settings from its own sources with `Settings(_build_sources=...)`,
and hands `CliSettingsSource` its environment source (`_env_settings_source`) for `--help`.

huggingface_hub: every Hub request gets a timeout through a client made by `utils._http.default_client_factory`
(utils/hub.py). datasets: the tokenized cache is keyed on each split's `_fingerprint` (utils/data.py).

accelerate, transformers and peft: a run that does not use DeepSpeed or 8-bit weights leaves those libraries out
by setting them to None in sys.modules (utils/job.py), which the three must take for "not installed".

Why these are hand-written: for the tokenized cache, the push's retries and deadline and the masking of secrets,
a test shows the case the library beside them gets wrong (docs/development.md lists them); when the library
learns it, the test says so and the job's code can go.

Python's warnings: a library announces such a change with a DeprecationWarning or FutureWarning first;
the last test checks that one attributed to the job's code fails the job processes the tests start.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from torch.utils.data import SequentialSampler
from transformers import Trainer
from transformers.trainer_pt_utils import get_length_grouped_indices

from tests.conftest import base_env, job_trainer
from utils.trainer import EpochSeededLengthGroupedSampler, epoch_sampler

SEED = 42
BATCH = 8
ROWS = 96  # 12 batches an epoch
FIRST_ID = 5  # after BERT's special tokens


def row_ids(index: int, length: int) -> list[int]:
    """Token ids that name their row: its index in the first two tokens (the tiny vocabulary has > 16 words)."""
    return [FIRST_ID + index // 16, FIRST_ID + index % 16, *[FIRST_ID] * (length - 2)]


def row_index(ids: list[int]) -> int:
    return (ids[0] - FIRST_ID) * 16 + (ids[1] - FIRST_ID)


def sampler_of(loader):
    """The sampler inside a prepared loader, through accelerate's wrappers."""
    batches = loader.batch_sampler
    while hasattr(batches, "batch_sampler"):
        batches = batches.batch_sampler
    return batches.sampler


def lengths() -> list[int]:
    return [2 + (index * 7) % 19 for index in range(ROWS)]


def dataset() -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [
            {"input_ids": row_ids(index, length), "attention_mask": [1] * length, "label": index % 2}
            for index, length in enumerate(lengths())
        ]
    )


@pytest.fixture
def trainer(tmp_path, tiny_bert):
    """The job's own Trainer (build_trainer) on the tiny model, two epochs, nothing saved or evaluated on the way."""
    data = {"train": dataset(), "validation": dataset()}
    return job_trainer(
        tmp_path / "out",
        tiny_bert,
        data,
        per_device_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        num_epochs=2,
        seed=SEED,
    )


def test_the_overridden_private_methods_keep_their_names_and_signatures():
    for name, parameters in (
        ("_get_train_sampler", ["self", "train_dataset"]),
        ("_get_eval_sampler", ["self", "eval_dataset"]),
        ("_save_checkpoint", ["self", "model", "trial"]),
        (
            "_run_epoch",
            [
                "self",
                "model",
                "epoch",
                "train_dataloader",
                "steps_in_epoch",
                "num_update_steps_per_epoch",
                "trial",
                "ignore_keys_for_eval",
                "start_time",
                "resume_from_checkpoint",
                "epochs_trained",
                "steps_trained_in_current_epoch",
            ],
        ),
    ):
        method = getattr(Trainer, name, None)
        assert method is not None, f"Trainer.{name} is gone: JobTrainer's override is never called (utils/trainer.py)"
        assert list(inspect.signature(method).parameters) == parameters, (
            f"Trainer.{name} now takes {inspect.signature(method)}: check JobTrainer's override against it"
        )


def test_the_training_loader_still_asks_the_override_for_its_sampler(trainer):
    loader = trainer.get_train_dataloader()
    sampler = sampler_of(loader)
    assert isinstance(sampler, EpochSeededLengthGroupedSampler) and epoch_sampler(loader) is sampler, (
        "get_train_dataloader no longer builds its sampler with _get_train_sampler (or accelerate wraps it "
        "differently): batches are no longer length-grouped in a resumable order"
    )
    assert sampler.lengths == lengths()  # Arrow's lengths, the ones the library would measure


def test_the_evaluation_loader_still_asks_the_override_and_keeps_dataset_order(trainer):
    loader = trainer.get_eval_dataloader()
    assert isinstance(sampler_of(loader), SequentialSampler), (
        "get_eval_dataloader no longer builds its sampler with _get_eval_sampler: evaluation is reordered"
    )
    seen = [row_index(ids.tolist()) for batch in loader for ids in batch["input_ids"]]
    assert seen == list(range(ROWS))
    predictions = trainer.predict(trainer.eval_dataset)
    assert predictions.label_ids.tolist() == [index % 2 for index in range(ROWS)]


def test_each_epoch_trains_the_batches_drawn_from_seed_plus_epoch(trainer):
    """SamplerEpoch must run before each epoch's order is drawn, and the loader must follow the sampler:
    what a resume in any epoch reproduces."""
    steps: list[list[int]] = []
    training_step = trainer.training_step

    def recording_step(model, inputs, num_items_in_batch=None):
        steps.append([row_index(ids.tolist()) for ids in inputs["input_ids"]])
        return training_step(model, inputs, num_items_in_batch)

    trainer.training_step = recording_step
    trainer.train()

    expected = [
        get_length_grouped_indices(lengths(), BATCH, generator=torch.Generator().manual_seed(SEED + epoch))
        for epoch in (0, 1)
    ]
    trained = [index for step in steps for index in step]
    assert trained[:ROWS] == expected[0], "epoch 1 did not train the order drawn from SEED"
    assert trained[ROWS:] == expected[1], "epoch 2 did not train the order drawn from SEED + 1"
    assert expected[0] != expected[1]
    assert trainer.samples_seen == 2 * ROWS


# ------------------------------------------------------------------------------- transformers, beyond the Trainer
def test_the_progress_bar_the_job_closes_is_the_trainers_training_bar(trainer):
    import transformers

    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    callbacks = trainer.callback_handler.callbacks
    bars = [cb.training_bar for cb in callbacks if getattr(cb, "training_bar", None) is not None]
    assert len(bars) == 1 and callable(getattr(bars[0], "close", None)), (
        f"transformers {transformers.__version__}: no callback of the Trainer holds its progress bar as `training_bar` "
        "after on_train_begin; utils/run.py closes it before an error line, which would now share the bar's line"
    )
    bars[0].close()


def test_bert_declares_its_block_as_not_to_be_split(tiny_bert):
    import transformers
    from transformers import AutoModelForSequenceClassification

    from utils.strategy import wrap_classes

    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert)
    declared = getattr(model, "_no_split_modules", None) or []
    assert "BertLayer" in declared, (
        f"transformers {transformers.__version__}: {type(model).__name__}._no_split_modules is {declared!r}, without "
        "BertLayer; utils/strategy.py wrap_classes picks FSDP's units from it (falling back to every repeated block)"
    )
    assert wrap_classes(model) == ["BertLayer"]


def test_the_attention_asked_for_is_the_one_the_model_runs(tiny_bert):
    import transformers

    from utils.model import build_model
    from utils.settings import Settings

    model = build_model(Settings(model_name=str(tiny_bert)), False, torch.device("cpu"))
    attention = getattr(model.get_base_model().config, "_attn_implementation", None)
    assert attention == "sdpa", (
        f"transformers {transformers.__version__}: the model built with attn_implementation='sdpa' reports "
        f"config._attn_implementation={attention!r}; utils/model.py asks for SDPA by name and benchmarks/arms.py "
        "reads it there"
    )


# ------------------------------------------------------------------------------- pydantic-settings
def test_the_environment_source_reads_what_load_env_vars_returns(monkeypatch):
    """load_settings(environ=...) and blank config_map entries rest on this: the source reads the variables
    through `_load_env_vars` only, and matches them to fields by lower-cased name."""
    import pydantic_settings
    from pydantic_settings import EnvSettingsSource

    from utils.settings import _Environment

    where = f"pydantic-settings {pydantic_settings.__version__}"
    hook = getattr(EnvSettingsSource, "_load_env_vars", None)
    assert hook is not None and list(inspect.signature(hook).parameters) == ["self"], (
        f"{where}: EnvSettingsSource._load_env_vars is gone or takes other arguments; utils/settings.py _Environment "
        "overrides it to read a mapping instead of os.environ"
    )
    monkeypatch.setenv("NUM_EPOCHS", "7")
    monkeypatch.setenv("LORA_R", "4")
    read = _Environment({"NUM_EPOCHS": "3", "SEED": "   "})()
    assert read == {"num_epochs": "3"}, (
        f"{where}: an environment source over {{NUM_EPOCHS: 3, SEED: blank}} with NUM_EPOCHS=7 LORA_R=4 in os.environ "
        f"read {read}; utils/settings.py relies on it reading the mapping alone"
    )


def test_settings_are_built_from_exactly_the_sources_given(monkeypatch):
    """load_settings builds Settings(_build_sources=((flags, env), {})): those sources, the first winning, not
    settings_customise_sources (which gives code and tests the init values only) and not os.environ."""
    import pydantic_settings
    from pydantic_settings import BaseSettings

    from utils.settings import Settings, _Environment

    where = f"pydantic-settings {pydantic_settings.__version__}"
    assert "_build_sources" in inspect.signature(BaseSettings.__init__).parameters, (
        f"{where}: BaseSettings no longer takes _build_sources; utils/settings.py load_settings builds Settings from "
        "its own flag and environment sources with it"
    )
    monkeypatch.setenv("LORA_R", "4")
    first, second = _Environment({"NUM_EPOCHS": "2"}), _Environment({"NUM_EPOCHS": "5", "SEED": "7"})
    built = Settings(_build_sources=((first, second), {}))
    assert (built.num_epochs, built.seed, built.lora_r) == (2, 7, Settings().lora_r), (
        f"{where}: Settings(_build_sources=((NUM_EPOCHS=2), (NUM_EPOCHS=5, SEED=7))) with LORA_R=4 in os.environ built "
        f"num_epochs={built.num_epochs} seed={built.seed} lora_r={built.lora_r}; flags must win over the environment "
        "and nothing else be read"
    )


def test_the_flag_source_takes_the_environment_source_and_reports_the_flags_given():
    """`--help` shows each setting's variable beside its flag through `_env_settings_source`; a refusal names
    the flag a bad value came from through what the source returns after parsing."""
    import pydantic_settings
    from pydantic_settings import CliSettingsSource

    from utils.settings import Settings, _Environment, _parser

    where = f"pydantic-settings {pydantic_settings.__version__}"
    assert "_env_settings_source" in inspect.signature(CliSettingsSource.__init__).parameters, (
        f"{where}: CliSettingsSource no longer takes _env_settings_source; utils/settings.py load_settings passes "
        "its environment source so --help names the variables"
    )
    parser = _parser()
    flags = CliSettingsSource(Settings, root_parser=parser, _env_settings_source=_Environment({}))
    flags(parsed_args=parser.parse_args(["--num-epochs", "3"]))
    assert flags() == {"num_epochs": "3"}, f"{where}: the flag source reports {flags()} for --num-epochs 3"
    assert "NUM_EPOCHS" in parser.format_help(), f"{where}: --help no longer shows the variables (NUM_EPOCHS)"


# ------------------------------------------------------------------------------- huggingface_hub
def test_hub_requests_get_the_timeout_through_the_default_client_factory():
    import huggingface_hub
    from huggingface_hub import get_session, set_client_factory

    from utils.hub import use_request_timeout

    where = f"huggingface_hub {huggingface_hub.__version__}"
    try:
        from huggingface_hub.utils._http import default_client_factory
    except ImportError:
        pytest.fail(f"{where}: utils._http.default_client_factory moved; utils/hub.py builds its client with it")
    hooks = default_client_factory().event_hooks
    try:
        use_request_timeout(7.0)
        session = get_session()
        assert (session.timeout.read, session.timeout.connect) == (7.0, 7.0), (
            f"{where}: after use_request_timeout(7) the Hub client's timeout is {session.timeout}; a silent Hub would "
            "block the token check and the push for ever"
        )
        assert session.event_hooks == hooks, f"{where}: the client lost the library's own request hooks"
    finally:
        set_client_factory(default_client_factory)


# ------------------------------------------------------------------------------- datasets
def test_a_splits_fingerprint_follows_its_data(tmp_path):
    """The tokenized cache on the shared volume is keyed on `_fingerprint`: the same files give the same key on
    every replica and restart, other rows another."""
    from tests.conftest import delimited, film_rows, write_files
    from utils.data import load_raw
    from utils.settings import Settings

    where = f"datasets {datasets.__version__}"
    folder = write_files(
        tmp_path / "data", {"train.csv": delimited(film_rows(8)), "validation.csv": delimited(film_rows(4))}
    )
    settings = Settings(dataset_path=str(folder))
    first, again = load_raw(settings), load_raw(settings)
    prints = [getattr(first["train"], "_fingerprint", None), getattr(again["train"], "_fingerprint", None)]
    assert isinstance(prints[0], str) and prints[0] == prints[1], (
        f"{where}: the same csv read twice has fingerprints {prints}; utils/data.py cache_key would tokenize again "
        "on every start (or fail)"
    )
    (folder / "train.csv").write_text(delimited(film_rows(9)))
    assert load_raw(settings)["train"]._fingerprint != prints[0], (
        f"{where}: other rows in train.csv kept the fingerprint; the tokenized cache of the old rows would be reused"
    )


# ------------------------------------------------------------------------------- why these are hand-written
# The library's route is asserted as it behaves today (and fails when it changes), the job's as it must behave.


def test_the_tokenized_cache_follows_the_tokenizer_where_datasets_cache_does_not(tmp_path, tiny_bert):
    """utils/data.py tokenize: datasets caches a map of in-memory data (what the label checks leave) nowhere the
    other ranks could read it, and a map given a file on the volume reuses that file whatever tokenized it."""
    import copy

    from utils.data import tokenize
    from utils.model import load_tokenizer
    from utils.settings import Settings

    where = f"datasets {datasets.__version__}"
    rows = {"text": ["a zebra film", "a dull zebra"], "labels": [1, 0]}  # as the label checks leave them
    raw = datasets.DatasetDict({split: datasets.Dataset.from_dict(rows) for split in ("train", "validation")})
    old = load_tokenizer(Settings(model_name=str(tiny_bert)))
    new = copy.deepcopy(old)
    new.add_tokens(["zebra"])  # a tokenizer that learned a word: other ids for the same rows
    wanted = new(rows["text"])["input_ids"]

    def encode_with(tokenizer):
        return lambda batch: tokenizer(batch["text"])

    assert raw.map(encode_with(old), batched=True)["train"].cache_files == [], (
        f"{where}: a map of in-memory rows is now cached on disk; see whether utils/data.py tokenize can use it"
    )
    files = {split: str(tmp_path / "library" / f"{split}.arrow") for split in raw}
    (tmp_path / "library").mkdir()
    raw.map(encode_with(old), batched=True, cache_file_names=files)
    reused = raw.map(encode_with(new), batched=True, cache_file_names=files)
    assert reused["train"]["input_ids"] != wanted, (
        f"{where}: a map given cache_file_names now notices another tokenizer; utils/data.py tokenize can leave its "
        "key and reuse to datasets"
    )

    cache = tmp_path / "job"
    tokenize(raw, old, 32, cache)
    tokenized = tokenize(raw, new, 32, cache)
    assert tokenized["train"]["input_ids"] == wanted
    assert all(Path(f["filename"]).is_relative_to(cache) for f in tokenized["train"].cache_files)
    assert len(list(cache.glob("tokenized-*"))) == 2


def test_the_push_outlasts_a_hub_that_answers_503_or_nothing_where_huggingface_hub_does_not(
    hub, hub_in_process, tmp_path
):
    """utils/hub.py Hub.push_files: huggingface_hub retries a commit but not create_repo, and no call of it has a
    total deadline (a Hub that accepts the connection and never answers holds it for ever)."""
    import contextlib
    import threading
    import time

    import huggingface_hub
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    from utils.hub import HubDeadline

    where = f"huggingface_hub {huggingface_hub.__version__}"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    files = {"adapter_config.json": folder / "adapter_config.json"}
    library = HfApi(endpoint=constants.ENDPOINT, token=hub.token)

    hub.fail("create", 503)
    try:
        library.create_repo("user/model", exist_ok=True)
        pytest.fail(f"{where}: create_repo now retries a 503; see whether utils/hub.py's retries can go")
    except HfHubHTTPError:
        pass
    hub.fail("create", 503)
    assert "commit" in hub_in_process(30).push_files(files, "user/model", True, "upload")

    hub.go_silent("commit")

    def upload() -> None:
        with contextlib.suppress(Exception):  # the stand-in drops the connection when it stops
            library.upload_folder(repo_id="user/model", folder_path=folder)

    waiting = threading.Thread(target=upload, daemon=True)
    waiting.start()
    started = time.monotonic()
    with pytest.raises(HubDeadline):
        hub_in_process(2).push_files(files, "user/model", True, "upload")
    assert time.monotonic() - started < 2 + 2
    assert waiting.is_alive(), (
        f"{where}: upload_folder now gives up on a silent Hub; see whether utils/hub.py within can go"
    )


def test_secrets_in_what_huggingface_hub_raises_are_masked_by_the_job_alone(hub):
    """utils/hub_token.py: huggingface_hub names the endpoint in its errors with the credentials inside it, and
    logging prints what it is given; MaskedStream and MaskingFilter are what keep it out of stderr and the logs."""
    import io
    import logging

    import huggingface_hub
    from huggingface_hub import HfApi
    from pydantic import SecretStr

    from utils.hub_token import MaskedStream, Masker, MaskingFilter, url_secrets

    where = f"huggingface_hub {huggingface_hub.__version__}"
    password = "s3cret-mirror-password"
    endpoint = hub.url.replace("http://", f"http://alice:{password}@")
    hub.fail("create", 503)
    with pytest.raises(Exception) as raised:
        HfApi(endpoint=endpoint, token=hub.token).create_repo("user/model", exist_ok=True)
    message = str(raised.value)
    assert password in message, f"{where}: its errors no longer show the endpoint's password; masking may shrink"

    masker = Masker(SecretStr(hub.token), url_secrets({"HF_ENDPOINT": endpoint}))
    stream, logged = io.StringIO(), io.StringIO()
    MaskedStream(stream, masker).write(message)
    logger = logging.getLogger("test-masking")
    handler = logging.StreamHandler(logged)
    handler.addFilter(MaskingFilter(masker))
    logger.addHandler(handler)
    try:
        logger.error("push failed: %s", message)
    finally:
        logger.removeHandler(handler)
    for text in (stream.getvalue(), logged.getvalue()):
        assert password not in text and "alice:***@" in text


# ------------------------------------------------------------------------------- libraries a run leaves out
LEFT_OUT = """
import json, sys
for name in ("deepspeed", "bitsandbytes"):
    sys.modules[name] = None  # what Job.leave_unused_libraries_out does before transformers is imported
import accelerate.utils, peft, peft.import_utils, transformers.utils
from transformers import Trainer
from accelerate.utils.other import extract_model_from_parallel
import torch
extract_model_from_parallel(torch.nn.Linear(1, 1))  # where Accelerate imports DeepSpeed when it finds it
print(json.dumps({
    "accelerate deepspeed": bool(accelerate.utils.is_deepspeed_available()),
    "accelerate bitsandbytes": bool(accelerate.utils.is_bnb_available()),
    "transformers bitsandbytes": bool(transformers.utils.is_bitsandbytes_available()),
    "peft bitsandbytes": bool(peft.import_utils.is_bnb_available()),
    "loaded": [name for name in ("deepspeed", "bitsandbytes") if sys.modules.get(name) is not None],
}))
"""


def test_a_library_left_out_of_sys_modules_counts_as_not_installed(tmp_path):
    """A run under DDP or FSDP leaves DeepSpeed out, one without 8-bit weights bitsandbytes (utils/job.py), by
    setting them to None in sys.modules. Accelerate, transformers and peft must then take them for not installed
    and import neither; should one import a library directly instead of asking, every such run fails at start."""
    import accelerate
    import peft
    import transformers

    where = f"accelerate {accelerate.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    result = subprocess.run(
        [sys.executable, "-c", LEFT_OUT], env=base_env(tmp_path), capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"{where}: importing the stack without them fails:\n{result.stderr[-3000:]}"
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {
        "accelerate deepspeed": False,
        "accelerate bitsandbytes": False,
        "transformers bitsandbytes": False,
        "peft bitsandbytes": False,
        "loaded": [],
    }, f"{where}: a library left out is seen as installed or loaded anyway: {seen}"


@pytest.mark.parametrize("category", ["DeprecationWarning", "FutureWarning"])
def test_a_deprecation_in_the_jobs_code_fails_the_job_processes_the_tests_start(tmp_path, category):
    """pytest.ini makes a deprecation attributed to this repo's code an error in the test process; the job
    processes (base_env) get the same rule, so an API the job calls going away fails the test that runs it,
    while one inside a library stays the library's to fix."""
    warn = "import warnings; warnings.warn_explicit('going away', {category}, 'x.py', 1, module={module!r}); print('went on')"
    for module, code, says in [
        ("utils.trainer", 1, f"{category}: going away"),
        ("transformers.trainer", 0, "went on"),
    ]:
        result = subprocess.run(
            [sys.executable, "-c", warn.format(category=category, module=module)],
            env=base_env(tmp_path),
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == code and says in result.stderr + result.stdout, (module, result.stderr)


def test_the_compiler_internals_the_fast_path_reads_are_there():
    """TORCH_COMPILE (utils/trainer.py) sets inductor's `fallback_random` (dropout masks drawn as eager draws them)
    and reads dynamo's `counters` and `calculate_time_spent` for logs/rank-R.json: torch internals, as of 2.13."""
    import torch
    import torch._inductor.config
    from torch._dynamo.utils import calculate_time_spent, counters

    where = f"torch {torch.__version__}"
    assert isinstance(torch._inductor.config.fallback_random, bool), f"{where} has no inductor fallback_random"
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager", dynamic=False)
    compiled(torch.ones(3))
    compiled(torch.ones(4))  # a new static shape: a second graph of the same frame
    assert counters["stats"]["unique_graphs"] == 2 and counters["frames"]["total"] == 2, f"{where}: {dict(counters)}"
    assert not counters["graph_break"], f"{where}: {dict(counters['graph_break'])}"
    assert calculate_time_spent()["total_wall_time"] > 0, f"{where}: {calculate_time_spent()}"
