"""What the job relies on inside its libraries beyond their public API, checked on the installed versions; a
failure names the library, its version and what in the job stops working.

transformers: JobTrainer (utils/training/trainer.py) overrides five private Trainer methods: the two samplers (the
public route measures every row again, draws each epoch's order from the global RNG and reorders evaluation),
`_save_checkpoint` (a save a full volume cut short ends every rank alike), `_run_epoch` (a resume at the last step
trains no step past it) and `_clip_grad_norm` (the trainable weights only). An upgrade that renames them or stops
calling them would train other batches or fail without a word. Also read: the progress callback's `training_bar`
(utils/run.py), `_no_split_modules` (FSDP's units) and `_attn_implementation` (the benchmarks).
pydantic-settings: utils/config/sources.py's `_load_env_vars`, `_build_sources` and `_env_settings_source`.
huggingface_hub: `utils._http.default_client_factory` (request timeouts); datasets: `_fingerprint` (the tokenized
cache); accelerate, transformers and peft take a library set to None in sys.modules (utils/cluster/job.py) for not
installed.

The "hand-written" tests show the case the library beside the job's own code gets wrong (docs/development.md lists
them); when the library learns it, the test says so and the job's code can go. Last, a deprecation attributed to
the job's code fails the job processes the tests start.
"""

from __future__ import annotations

import inspect
import json
import re
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import datasets
import pytest
import torch
from torch.utils.data import SequentialSampler
from transformers import Trainer

from tests.support.env import base_env, free_port, tiny_run_env
from tests.support.harness import start_in_process
from tests.support.processes import DEVNULL, PIPE, Popen, run_command, start
from utils.training.trainer import GlobalOrderSampler, epoch_sampler

SEED = 42
BATCH = 8
ROWS = 96  # 12 batches an epoch
FIRST_ID = 5  # after BERT's special tokens


def row_ids(index: int, length: int) -> list[int]:
    """Token ids that name their row: its index in the first two tokens (the tiny vocabulary has > 16 words)."""
    return [FIRST_ID + index // 16, FIRST_ID + index % 16, *[FIRST_ID] * (length - 2)]


def row_index(ids: list[int]) -> int:
    """The row a tokenized sentence of `row_ids` came from ([CLS] first)."""
    return (ids[1] - FIRST_ID) * 16 + (ids[2] - FIRST_ID)


def sampler_of(loader):
    """The sampler inside a prepared loader, through accelerate's wrappers."""
    batches = loader.batch_sampler
    while hasattr(batches, "batch_sampler"):
        batches = batches.batch_sampler
    return batches.sampler


def lengths() -> list[int]:
    return [2 + (index * 7) % 19 for index in range(ROWS)]


def token_lengths() -> list[int]:
    """The rows' lengths as the Trainer sees them: [CLS] and [SEP] around each sentence's words."""
    return [length + 2 for length in lengths()]


@pytest.fixture
def trainer(tmp_path, tiny_bert, monkeypatch):
    """The Trainer the job's own start-up builds on the tiny model, two epochs, nothing saved or evaluated on the way;
    ROWS sentences of the tiny vocabulary's words (a token each) in both splits, each naming its row in two words."""
    vocab = (tiny_bert / "vocab.txt").read_text().split()  # a word's line is its token id
    sentences = [" ".join(vocab[i] for i in row_ids(index, length)) for index, length in enumerate(lengths())]
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "validation"):
        rows = "".join(f"{sentence},{index % 2}\n" for index, sentence in enumerate(sentences))
        (data / f"{split}.csv").write_text("sentence,label\n" + rows)
    batches = dict(PER_DEVICE_BATCH_SIZE=BATCH, PER_DEVICE_EVAL_BATCH_SIZE=BATCH, SEED=SEED, REPORT_TO="none")
    env = tiny_run_env(tmp_path, tiny_bert, data, **batches, SAVE_STEPS=10000, EVAL_STEPS=10000)
    start = start_in_process(monkeypatch, env)
    assert start.ready is not None, start.stderr[-3000:]
    return start.ready.trainer


@pytest.mark.check
def test_the_overridden_private_methods_keep_their_names_and_signatures():
    run_epoch = (
        "self model epoch train_dataloader steps_in_epoch num_update_steps_per_epoch trial ignore_keys_for_eval"
    )
    for name, parameters in (
        ("_get_train_sampler", "self train_dataset"),
        ("_get_eval_sampler", "self eval_dataset"),
        ("_save_checkpoint", "self model trial"),
        ("_clip_grad_norm", "self model"),
        ("_run_epoch", f"{run_epoch} start_time resume_from_checkpoint epochs_trained steps_trained_in_current_epoch"),
    ):
        method = getattr(Trainer, name, None)
        assert method is not None, f"Trainer.{name} is gone: JobTrainer's override is never called"
        signature = inspect.signature(method)
        assert list(signature.parameters) == parameters.split(), f"Trainer.{name}{signature}: check JobTrainer's"


@pytest.mark.check
def test_the_training_loader_still_asks_the_override_for_its_sampler(trainer):
    loader = trainer.get_train_dataloader()
    sampler = sampler_of(loader)
    # Else batches are no longer length-grouped in a resumable order.
    assert isinstance(sampler, GlobalOrderSampler) and epoch_sampler(loader) is sampler, "_get_train_sampler unused"
    assert sampler.lengths == token_lengths()  # Arrow's lengths, the ones the library would measure


def test_the_evaluation_loader_still_asks_the_override_and_keeps_dataset_order(trainer):
    loader = trainer.get_eval_dataloader()
    assert isinstance(sampler_of(loader), SequentialSampler), "_get_eval_sampler unused: evaluation is reordered"
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

    def drawn(epoch: int) -> list[int]:
        """The order the job's sampler draws for `epoch`, from SEED + epoch alone."""
        sampler = GlobalOrderSampler(BATCH, token_lengths(), SEED)
        sampler.set_epoch(epoch)
        return list(sampler)

    expected = [drawn(0), drawn(1)]
    trained = [index for step in steps for index in step]
    assert trained[:ROWS] == expected[0], "epoch 1 did not train the order drawn from SEED"
    assert trained[ROWS:] == expected[1], "epoch 2 did not train the order drawn from SEED + 1"
    assert expected[0] != expected[1]
    assert trainer.samples_seen == 2 * ROWS


# ------------------------------------------------------------------------------- transformers, beyond the Trainer
@pytest.mark.check
def test_the_progress_bar_the_job_closes_is_the_trainers_training_bar(trainer):
    import transformers

    from utils.run import ProgressBar

    bars = ProgressBar()  # the Trainer's ProgressCallback, as the job adds it where a terminal watches
    bars.on_train_begin(trainer.args, trainer.state, trainer.control)
    assert callable(getattr(getattr(bars, "training_bar", None), "close", None)), (
        f"transformers {transformers.__version__}: no ProgressCallback.training_bar to close before an error line"
    )
    bars.training_bar.close()


@pytest.mark.check
def test_bert_declares_its_block_as_not_to_be_split(tiny_bert):
    import transformers
    from transformers import AutoModelForSequenceClassification

    from utils.training.strategy import wrap_classes

    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert)
    declared = getattr(model, "_no_split_modules", None) or []
    assert "BertLayer" in declared, f"transformers {transformers.__version__}: FSDP's units: {declared!r}"
    assert wrap_classes(model) == ["BertLayer"]


@pytest.mark.check
def test_the_attention_asked_for_is_the_one_the_model_runs(tiny_bert):
    import transformers

    from utils.config.settings import Settings
    from utils.training.model import ModelChoices, build_model

    model = build_model(Settings(model_name=str(tiny_bert)).select(ModelChoices), "none", torch.device("cpu"))
    attention = getattr(model.get_base_model().config, "_attn_implementation", None)
    # utils/training/model.py asks for SDPA by name, and benchmarks/arms.py reads it there.
    assert attention == "sdpa", f"transformers {transformers.__version__}: asked for sdpa, runs {attention!r}"


# ------------------------------------------------------------------------------- pydantic-settings
@pytest.mark.check
def test_the_environment_source_reads_what_load_env_vars_returns(monkeypatch):
    """load_settings(environ=...) and blank config_map entries rest on this: the source reads the variables
    through `_load_env_vars` only, and matches them to fields by lower-cased name."""
    import pydantic_settings
    from pydantic_settings import EnvSettingsSource

    from utils.config.sources import _Environment

    where = f"pydantic-settings {pydantic_settings.__version__}"
    hook = getattr(EnvSettingsSource, "_load_env_vars", None)
    assert hook is not None and list(inspect.signature(hook).parameters) == ["self"], f"{where}: _load_env_vars"
    monkeypatch.setenv("NUM_EPOCHS", "7")
    monkeypatch.setenv("LORA_R", "4")
    read = _Environment({"NUM_EPOCHS": "3", "SEED": "   "})()
    assert read == {"num_epochs": "3"}, f"{where}: read {read}, not the mapping alone"


@pytest.mark.check
def test_settings_are_built_from_exactly_the_sources_given(monkeypatch):
    """load_settings builds Settings(_build_sources=((flags, env), {})): those sources, the first winning, not
    settings_customise_sources (which gives code and tests the init values only) and not os.environ."""
    import pydantic_settings
    from pydantic_settings import BaseSettings

    from utils.config.settings import Settings
    from utils.config.sources import _Environment

    where = f"pydantic-settings {pydantic_settings.__version__}"
    assert "_build_sources" in inspect.signature(BaseSettings.__init__).parameters, f"{where}: no _build_sources"
    monkeypatch.setenv("LORA_R", "4")
    first, second = _Environment({"NUM_EPOCHS": "2"}), _Environment({"NUM_EPOCHS": "5", "SEED": "7"})
    built = Settings(_build_sources=((first, second), {}))
    # The first source wins (flags over the environment), and nothing else is read.
    assert (built.num_epochs, built.seed, built.lora_r) == (2, 7, Settings().lora_r), f"{where}: {built}"


@pytest.mark.check
def test_the_flag_source_takes_the_environment_source_and_reports_the_flags_given():
    """`--help` shows each setting's variable beside its flag through `_env_settings_source`; a refusal names
    the flag a bad value came from through what the source returns after parsing."""
    import pydantic_settings
    from pydantic_settings import CliSettingsSource

    from utils.config.settings import Settings
    from utils.config.sources import _Environment, _parser

    where = f"pydantic-settings {pydantic_settings.__version__}"
    assert "_env_settings_source" in inspect.signature(CliSettingsSource.__init__).parameters, where
    parser = _parser()
    flags = CliSettingsSource(Settings, root_parser=parser, _env_settings_source=_Environment({}))
    flags(parsed_args=parser.parse_args(["--num-epochs", "3"]))
    assert flags() == {"num_epochs": "3"}, f"{where}: the flag source reports {flags()} for --num-epochs 3"
    assert "NUM_EPOCHS" in parser.format_help(), f"{where}: --help no longer shows the variables (NUM_EPOCHS)"


# ------------------------------------------------------------------------------- huggingface_hub
@pytest.mark.check
def test_hub_requests_get_the_timeout_through_the_default_client_factory():
    import huggingface_hub
    from huggingface_hub import get_session, set_client_factory

    from utils.publishing.hub import use_request_timeout

    where = f"huggingface_hub {huggingface_hub.__version__}"
    try:
        from huggingface_hub.utils._http import default_client_factory
    except ImportError:
        pytest.fail(f"{where}: utils._http.default_client_factory moved; utils/publishing/hub.py builds with it")
    hooks = default_client_factory().event_hooks
    try:
        use_request_timeout(7.0)
        session = get_session()
        # Else a silent Hub would block the token check and the push for ever.
        assert (session.timeout.read, session.timeout.connect) == (7.0, 7.0), f"{where}: {session.timeout}"
        assert session.event_hooks == hooks, f"{where}: the client lost the library's own request hooks"
    finally:
        set_client_factory(default_client_factory)


# ------------------------------------------------------------------------------- datasets
@pytest.mark.check
def test_a_splits_fingerprint_follows_its_data(tmp_path):
    """The tokenized cache on the shared volume is keyed on `_fingerprint`: the same files give the same key on
    every replica and restart, other rows another."""
    from tests.support.data import delimited, film_rows, write_files
    from utils.config.settings import Settings
    from utils.training.data import DataSource, load_raw

    where = f"datasets {datasets.__version__}"
    folder = write_files(
        tmp_path / "d", {"train.csv": delimited(film_rows(8)), "validation.csv": delimited(film_rows(4))}
    )
    settings = Settings(dataset_path=str(folder))
    first, again = load_raw(settings.select(DataSource)), load_raw(settings.select(DataSource))
    prints = [getattr(first["train"], "_fingerprint", None), getattr(again["train"], "_fingerprint", None)]
    assert isinstance(prints[0], str) and prints[0] == prints[1], f"{where}: the same csv read twice: {prints}"
    (folder / "train.csv").write_text(delimited(film_rows(9)))
    assert load_raw(settings.select(DataSource))["train"]._fingerprint != prints[0], (
        f"{where}: other rows kept the fingerprint"
    )


# ------------------------------------------------------------------------------- why these are hand-written
# The library's route is asserted as it behaves today (and fails when it changes), the job's as it must behave.


def test_the_tokenized_cache_follows_the_tokenizer_where_datasets_cache_does_not(tmp_path, tiny_bert):
    """utils/training/data.py tokenize: datasets caches a map of in-memory data (what the label checks leave) nowhere the
    other ranks could read it, and a map given a file on the volume reuses that file whatever tokenized it."""
    import copy

    from utils.training.data import tokenize
    from utils.training.model import load_tokenizer

    where = f"datasets {datasets.__version__}"
    rows = {"text": ["a zebra film", "a dull zebra"], "labels": [1, 0]}  # as the label checks leave them
    raw = datasets.DatasetDict({split: datasets.Dataset.from_dict(rows) for split in ("train", "validation")})
    old = load_tokenizer(str(tiny_bert), max_seq_length=128, lora_r=8)
    new = copy.deepcopy(old)
    new.add_tokens(["zebra"])  # a tokenizer that learned a word: other ids for the same rows
    wanted = new(rows["text"])["input_ids"]

    def encode_with(tokenizer):
        return lambda batch: tokenizer(batch["text"])

    assert raw.map(encode_with(old), batched=True)["train"].cache_files == [], f"{where} caches in-memory maps now"
    files = {split: str(tmp_path / "library" / f"{split}.arrow") for split in raw}
    (tmp_path / "library").mkdir()
    raw.map(encode_with(old), batched=True, cache_file_names=files)
    reused = raw.map(encode_with(new), batched=True, cache_file_names=files)
    assert reused["train"]["input_ids"] != wanted, f"{where}: cache_file_names now notices another tokenizer"

    cache = tmp_path / "job"
    tokenize(raw, old, 32, cache)
    tokenized = tokenize(raw, new, 32, cache)
    assert tokenized["train"]["input_ids"] == wanted
    assert all(Path(f["filename"]).is_relative_to(cache) for f in tokenized["train"].cache_files)
    assert len(list(cache.glob("tokenized-*"))) == 2


@pytest.mark.check
def test_a_resume_lists_the_trainers_checkpoints_but_only_complete_ones_where_get_last_checkpoint_does_not(tmp_path):
    """utils/run_folder/checkpoints.py `_checkpoints`: the Trainer's `PREFIX_CHECKPOINT_DIR`-step folders, resumed
    only when marked COMPLETE; get_last_checkpoint takes the newest, a save a kill cut short too."""
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    from utils.run_folder.checkpoints import COMPLETE_MARKER, latest_complete_checkpoint
    from utils.run_folder.layout import RunDir

    where = f"transformers {transformers.__version__}"
    run = RunDir(tmp_path)
    whole, cut_short = (run.checkpoints / f"{PREFIX_CHECKPOINT_DIR}-{step}" for step in (10, 20))
    for folder in (whole, cut_short):
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
    (whole / COMPLETE_MARKER).write_text("{}")
    # Checkpoints no longer named PREFIX_CHECKPOINT_DIR-<step>: CHECKPOINT_RE finds none, a restart starts over.
    assert latest_complete_checkpoint(run) == whole, f"{where}: checkpoints named {PREFIX_CHECKPOINT_DIR}-<step>?"
    assert get_last_checkpoint(str(run.checkpoints)) == str(cut_short), f"{where} passes over one cut short now"


def test_the_push_outlasts_a_hub_that_answers_503_or_nothing_where_huggingface_hub_does_not(
    hub, hub_in_process, tmp_path
):
    """utils/publishing/hub.py Hub.push_files: huggingface_hub retries a commit but not create_repo, and no call of it has a
    total deadline (a Hub that accepts the connection and never answers holds it for ever)."""
    import contextlib
    import threading

    import huggingface_hub
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    from utils.common.threads import Deadline

    where = f"huggingface_hub {huggingface_hub.__version__}"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    files = {"adapter_config.json": folder / "adapter_config.json"}
    library = HfApi(endpoint=constants.ENDPOINT, token=hub.token)

    hub.fail("create", 503)
    try:
        library.create_repo("user/model", exist_ok=True)
        pytest.fail(f"{where}: create_repo now retries a 503; see whether utils/publishing/hub.py's retries can go")
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
    with pytest.raises(Deadline):  # the job's deadline ended the wait: the library raises no such thing
        hub_in_process(2).push_files(files, "user/model", True, "upload")
    assert waiting.is_alive(), f"{where}: upload_folder gives up on a silent Hub now; the push's `within` can go"


def test_secrets_in_what_huggingface_hub_raises_are_masked_by_the_job_alone(hub):
    """utils/common/hub_token.py: huggingface_hub names the endpoint in its errors with the credentials inside it, and
    logging prints what it is given; MaskedStream and MaskingFilter are what keep it out of stderr and the logs."""
    import io
    import logging

    import huggingface_hub
    from huggingface_hub import HfApi
    from pydantic import SecretStr

    from utils.common.hub_token import MaskedStream, Masker, MaskingFilter, url_secrets

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


@pytest.mark.check
def test_the_hubs_retry_after_as_an_http_date_is_read_by_the_job_alone():
    """utils/publishing/hub.py retry_after: huggingface_hub reads a Retry-After of whole seconds, not the HTTP date
    the header may also hold, so a rate-limited push would retry before the Hub said it may."""
    import email.utils
    from types import SimpleNamespace

    import huggingface_hub
    from huggingface_hub.utils import _http

    from utils.publishing.hub import retry_after

    where = f"huggingface_hub {huggingface_hub.__version__}"
    date = email.utils.formatdate(time.time() + 120, usegmt=True)
    parse = getattr(_http, "_parse_retry_after", None)
    if parse is not None and parse({"Retry-After": date}) is not None:
        pytest.fail(f"{where} now reads an HTTP-date Retry-After; the job's retry_after can go")
    asked = retry_after(SimpleNamespace(response=SimpleNamespace(headers={"Retry-After": date})))
    assert asked is not None and 100 < asked <= 120


@pytest.mark.check
def test_a_token_of_two_lines_is_refused_by_the_job_where_get_token_joins_them(monkeypatch):
    """utils/common/hub_token.py read_token: huggingface_hub.get_token takes HF_TOKEN with its line breaks removed,
    two lines (a token pasted twice, a token and a comment) as one token, which the Hub then refuses as invalid."""
    import huggingface_hub

    from utils.common.errors import JobError
    from utils.common.hub_token import read_token

    where = f"huggingface_hub {huggingface_hub.__version__}"
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_firstlinetoken\nhf_secondline")
    if huggingface_hub.get_token() != "hf_firstlinetokenhf_secondline":
        pytest.fail(f"{where}: get_token no longer joins HF_TOKEN's lines; see whether read_token can use it")
    with pytest.raises(JobError, match="holds a newline"):
        read_token()


# ------------------------------------------------------------------------------- torch.distributed, accelerate
PEER = r"""
import json, os, sys, threading, time
from datetime import timedelta

import torch.distributed as td

scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def say(**fields):
    print(json.dumps(fields), flush=True)


def gloo(timeout):
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout)


if scenario == "stopped-store":  # rank 0 serves the store and is stopped; rank 1 asks it for a key
    store = td.TCPStore("127.0.0.1", port, None, rank == 0, timedelta(seconds=60), wait_for_workers=False)
    say(ready=True)
    if rank == 0:
        time.sleep(120)
    sys.stdin.readline()
    store.set_timeout(timedelta(seconds=0.5))
    asking = threading.Thread(target=lambda: store.get("never-set"), daemon=True)
    asking.start()
    asking.join(4)  # eight times the timeout: a call that kept it has returned long before
    say(observed={"returned": not asking.is_alive()})
elif scenario == "world-size":  # rank 1 was started with another WORLD_SIZE
    outcome = {}

    def join():
        try:
            gloo(timedelta(seconds=1))
            outcome["joined"] = True
        except Exception as exc:
            outcome["failed"] = type(exc).__name__

    joining = threading.Thread(target=join, daemon=True)
    joining.start()
    joining.join(4)  # four times the timeout: a join that kept it has returned or failed by now
    say(observed=outcome)
elif scenario == "monitored":  # rank 1 is stopped; rank 2 is alive, waiting in a collective for rank 0
    gloo(timedelta(seconds=30))
    td.barrier()
    say(ready=True)
    if rank == 1:
        time.sleep(120)
    if rank == 2:
        td.barrier()
    sys.stdin.readline()
    try:
        td.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)
        say(observed={"failed": None})
    except Exception as exc:
        say(observed={"failed": type(exc).__name__, "message": str(exc)})
elif scenario == "main-first":  # rank 0 fails inside Accelerate's main_process_first with the job's exit 2
    from accelerate import PartialState

    state = PartialState(cpu=True)
    state.wait_for_everyone()
    say(ready=True)
    if rank == 0:
        sys.stdin.readline()
    try:
        with state.main_process_first():
            if rank == 0:
                sys.stderr.write("error: REFUSED-ON-RANK-0\n")
                os._exit(2)
        say(observed={"stopped": None})
    except Exception as exc:
        say(observed={"stopped": type(exc).__name__, "message": str(exc)})
os._exit(0)
"""


def start_peers(tmp: Path, scenario: str, worlds: list[int]) -> list[Popen]:
    """One process per rank of `scenario`, rank r started with WORLD_SIZE worlds[r]."""
    port = free_port()
    # Without the autoload, torch would import bitsandbytes (a backend it registers) in every peer.
    env = base_env(tmp, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    return [
        start(
            [sys.executable, "-c", PEER, scenario, str(rank), str(world), str(port)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)},
            stdin=PIPE,
            stdout=PIPE,
            stderr=DEVNULL,
            text=True,
        )
        for rank, world in enumerate(worlds)
    ]


def said(proc: Popen, key: str) -> dict:
    """The next line of `proc` that holds `key` (its lines are JSON objects), or the test fails if it ends first."""
    for line in proc.stdout:
        fields = json.loads(line) if line.startswith("{") else {}
        if key in fields:
            return fields
    pytest.fail(f"the peer ended (exit {proc.wait()}) before it said {key!r}")


@pytest.fixture
def peers():
    started: list[Popen] = []
    yield started
    for proc in started:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def go(proc: Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def test_a_store_client_waits_past_its_timeout_for_a_rank_0_not_listening_yet():
    """Why `_wait_for_rank0` polls the port before the store client is made: the client retries with a random
    back-off and fails up to several times later than its timeout, so a missing rank 0 would not be told within
    RENDEZVOUS_TIMEOUT."""
    timeout, took = 1.0, []

    def connect() -> None:
        start = time.monotonic()
        with pytest.raises(torch.distributed.DistError):
            torch.distributed.TCPStore("127.0.0.1", free_port(), None, False, timedelta(seconds=timeout))
        took.append(time.monotonic() - start)

    tries = [threading.Thread(target=connect) for _ in range(6)]
    for thread in tries:
        thread.start()
    for thread in tries:
        thread.join()
    assert len(took) == len(tries) and max(took) > 1.5 * timeout, f"torch {torch.__version__}: {sorted(took)} s"


def test_a_taken_port_fails_the_store_with_the_type_of_an_unreachable_rank_0():
    """Why `_refuse_port_taken` binds the port itself: the store that cannot listen raises the type a client
    that reaches no rank 0 raises, so only the message's words would tell a bad MASTER_PORT (exit 2) from a
    rank 0 that is not there (exit 1), and the job never classifies by words."""
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        with pytest.raises(torch.distributed.DistError) as taken:
            port = holder.getsockname()[1]
            torch.distributed.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=1), wait_for_workers=False)
    with pytest.raises(torch.distributed.DistError) as unreachable:
        torch.distributed.TCPStore("127.0.0.1", free_port(), None, False, timedelta(seconds=0.1))
    assert type(taken.value) is type(unreachable.value), f"torch {torch.__version__} tells them apart by type now"


@pytest.mark.integration  # two or three peer processes importing torch each
def test_a_store_call_to_a_stopped_rank_0_outlives_its_timeout(tmp_path, peers):
    """Why utils/cluster/collectives.py runs its rendezvous and heartbeat probe under a `watchdog` (utils/common/threads.py): a
    store call to a rank 0 that is stopped (not dead: SIGSTOP, a frozen node) stays in native code past its own
    timeout, where no Python signal handler reaches it."""
    peers += start_peers(tmp_path, "stopped-store", [2, 2])
    for proc in peers:
        said(proc, "ready")
    peers[0].send_signal(signal.SIGSTOP)
    go(peers[1])
    assert said(peers[1], "observed")["observed"] == {"returned": False}, f"torch {torch.__version__} keeps it now"


@pytest.mark.integration  # two or three peer processes importing torch each
def test_gloo_creates_the_group_with_a_peer_started_with_another_world_size(tmp_path, peers):
    """Why the ranks compare their settings in the store before the group is made: `init_process_group` lets
    rank 0 (WORLD_SIZE=2) in with a peer that expects three ranks, or keeps it waiting past its timeout (both
    seen), and the mismatch surfaces later as a lost peer (exit 143, restarted for ever) instead of a refusal
    naming WORLD_SIZE (exit 2)."""
    peers += start_peers(tmp_path, "world-size", [2, 3])
    seen = said(peers[0], "observed")["observed"]
    assert seen in ({"joined": True}, {}), f"torch {torch.__version__}: {seen} (a refusal naming the world size?)"


@pytest.mark.integration  # two or three peer processes importing torch each
def test_monitored_barrier_cannot_tell_a_stopped_peer_from_one_waiting_elsewhere(tmp_path, peers):
    """Why each rank beats a heartbeat in the store: after a gloo failure (a plain RuntimeError, the type of any
    crash), `monitored_barrier` names every rank not in it, the stopped one and the one alive in another
    collective alike; only a counter that moves tells a lost peer (exit 143) from a crash here (exit 1)."""
    peers += start_peers(tmp_path, "monitored", [3, 3, 3])
    for proc in peers:
        said(proc, "ready")
    peers[1].send_signal(signal.SIGSTOP)
    go(peers[0])
    seen = said(peers[0], "observed")["observed"]
    named = set(re.findall(r"\b[12]\b", seen.get("message", "")))
    assert seen["failed"] == "RuntimeError" and named == {"1", "2"}, f"torch {torch.__version__}: {seen}"


@pytest.mark.integration  # two or three peer processes importing torch each
def test_accelerates_main_process_first_does_not_carry_rank_0s_refusal(tmp_path, peers):
    """Why `Collectives.main_first` and `run_on_main` broadcast rank 0's outcome instead of Accelerate's
    `main_process_first`: when rank 0 stops with a refusal (exit 2 and its reason), the others fail in the
    barrier with a gloo error that carries neither, and exit with another code."""
    import accelerate

    peers += start_peers(tmp_path, "main-first", [2, 2])
    for proc in peers:
        said(proc, "ready")
    go(peers[0])  # rank 1 is on its way into the barrier
    seen = said(peers[1], "observed")["observed"]
    assert peers[0].wait(timeout=60) == 2
    # Rank 0's reason reaching the others would let main_first use it.
    assert seen["stopped"] is not None and "REFUSED-ON-RANK-0" not in seen.get("message", ""), (
        f"accelerate {accelerate.__version__}: {seen}"
    )


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
    """A run leaves DeepSpeed (under DDP or FSDP) and bitsandbytes (without 8-bit weights) out by setting them to None
    in sys.modules (utils/cluster/job.py): a library that imported one instead of asking would fail every such run."""
    import accelerate
    import peft
    import transformers

    where = f"accelerate {accelerate.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    result = run_command([sys.executable, "-c", LEFT_OUT], env=base_env(tmp_path))
    assert result.returncode == 0, f"{where}: importing the stack without them fails:\n{result.stderr[-3000:]}"
    seen = json.loads(result.stdout.splitlines()[-1])
    asked = ("accelerate deepspeed", "accelerate bitsandbytes", "transformers bitsandbytes", "peft bitsandbytes")
    assert seen == {**dict.fromkeys(asked, False), "loaded": []}, f"{where}: one left out is seen or loaded: {seen}"


@pytest.mark.parametrize("category", ["DeprecationWarning", "FutureWarning"])
def test_a_deprecation_in_the_jobs_code_fails_the_job_processes_the_tests_start(tmp_path, category):
    """pytest.ini's rule for this process holds in the job processes too (base_env): a deprecation attributed to the
    job's code fails, one inside a library stays the library's to fix."""
    warn = "import warnings; warnings.warn_explicit('going away', {category}, 'x.py', 1, module={module!r}); print('went on')"
    for module, code, says in [
        ("utils.training.trainer", 1, f"{category}: going away"),
        ("transformers.trainer", 0, "went on"),
    ]:
        result = run_command(
            [sys.executable, "-c", warn.format(category=category, module=module)], env=base_env(tmp_path)
        )
        assert result.returncode == code and says in result.stderr + result.stdout, (module, result.stderr)


def test_the_compiler_internals_the_fast_path_reads_are_there():
    """TORCH_COMPILE (utils/training/trainer.py) sets inductor's `fallback_random` (dropout masks drawn as eager draws them)
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


@pytest.mark.check
def test_label_names_map_by_name_where_datasets_class_encoding_does_not(tmp_path):
    """The label mapping (utils/training/data.py `resolve_label_names`, `_labels_as_ids`) matches names case and
    spaces aside, and keeps the data in memory. datasets' own, as of this version: `class_encode_column` makes
    `Positive ` and `positive` two classes, and `align_labels_with_mapping` fails on a ClassLabel whose names carry
    a space (KeyError); both run a map, which writes its cache beside the data (a read-only volume refuses it)."""
    where = f"datasets {datasets.__version__}"
    texts = datasets.Dataset.from_dict({"label": ["positive", "Positive ", "negative"]})
    assert len(texts.class_encode_column("label").features["label"].names) == 3, f"{where} now folds case and spaces"
    named = datasets.Features({"label": datasets.ClassLabel(names=[" Positive", "negative"])})
    classes = datasets.Dataset.from_dict({"label": [0, 1, 1]}, features=named)
    with pytest.raises(KeyError):
        classes.align_labels_with_mapping({"negative": 0, "positive": 1}, "label")
