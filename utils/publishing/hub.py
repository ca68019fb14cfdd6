"""model/ (and merged/) saved on the volume, each whole or not at all, and pushed once each (run.json records it).

huggingface_hub does not retry `create_repo` or a commit on HTTP 503: transient failures (5xx, 429, dropped
connections, timeouts) are retried here with jittered backoff, within one deadline. The token is never formatted into a
message."""

from __future__ import annotations

import email.utils
import io
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import httpx2
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from pydantic import SecretStr
from tenacity import RetryCallState, retry, retry_if_exception, wait_random_exponential

from utils.common.errors import EXIT_OK, EXIT_PUSH_FAILED, BadInput, JobError, first_line
from utils.common.hub_token import Masker, url_secrets
from utils.common.threads import Deadline, within
from utils.config.identity import base_model_changes
from utils.config.plan import Plan
from utils.config.tasks import MULTI_LABEL
from utils.publishing.model_card import (
    PLOT_NAME,
    CardFacts,
    plot_training_curves,
    published_base,
    write_label_names,
    write_model_card,
)
from utils.run_folder.layout import RunDir, replace_dir
from utils.run_folder.model_files import BASE_NAME, read_base_fingerprint, write_base_fingerprint
from utils.run_folder.record import record_written, update_run_record, written_files

if TYPE_CHECKING:
    from transformers import Trainer

log = logging.getLogger(__name__)

TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
TOKEN_CHECK_SECONDS = 120  # the token check before training gives up within this: no GPU time waits on a silent Hub
# A host name that does not resolve: retried this long (a pod's DNS record appears within seconds of its start), said
# once; past it, a typo in HF_ENDPOINT or no route to a resolver is no reason to keep a job waiting for minutes.
NAME_RESOLUTION_SECONDS = 15
CONNECT_SECONDS = 10


def use_request_timeout(seconds: float) -> None:
    """A timeout on every huggingface_hub request: its client has none, and a silent Hub would block for ever."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    def client_with_timeout() -> httpx2.Client:
        client = default_client_factory()
        client.timeout = httpx2.Timeout(seconds, connect=min(CONNECT_SECONDS, seconds))
        return client

    set_client_factory(client_with_timeout)


def _status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, HfHubHTTPError):
        return _status(exc) in TRANSIENT_STATUS
    # The total deadline spent leaves nothing to retry with; OfflineModeIsEnabled is a ConnectionError, but
    # HF_HUB_OFFLINE=1 will not change by waiting.
    if isinstance(exc, (Deadline, OfflineModeIsEnabled)):
        return False
    return isinstance(exc, (httpx2.TransportError, ConnectionError, TimeoutError))


def retry_after(exc: BaseException) -> float | None:
    """The Hub's `Retry-After` in seconds (given as seconds or an HTTP date; huggingface_hub's parser reads only the
    first)."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    with suppress(ValueError):
        return max(0.0, float(value))
    with suppress(TypeError, ValueError):
        return max(0.0, (email.utils.parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds())
    return None


_backoff = wait_random_exponential(multiplier=1, max=60)  # 1 s, 2 s, 4 s ... with full jitter, capped at a minute


def _wait(state: RetryCallState) -> float:  # never sooner than the Hub's Retry-After
    asked = retry_after(state.outcome.exception()) if state.outcome and state.outcome.failed else None
    return max(asked or 0.0, _backoff(state))


def unresolved(exc: BaseException | None) -> bool:  # `exc`, or what it wraps, is a host name that did not resolve
    while exc is not None:
        if isinstance(exc, socket.gaierror):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _retrying(deadline: float, token: SecretStr | None):
    def stop(state: RetryCallState) -> bool:  # give up rather than sleep past the deadline
        if unresolved(state.outcome.exception()):
            return state.seconds_since_start + (state.upcoming_sleep or 0) >= NAME_RESOLUTION_SECONDS
        return time.monotonic() + (state.upcoming_sleep or 0) >= deadline

    def log_retry(state: RetryCallState) -> None:
        if unresolved(state.outcome.exception()) and state.attempt_number > 1:
            return  # said once: the same name does not resolve again
        failure = describe(state.outcome.exception(), token)
        log.warning(
            f"Hub {getattr(state.fn, '__name__', 'call')} failed ({failure}); "
            f"attempt {state.attempt_number}, retrying in {state.upcoming_sleep:.1f} s"
        )

    return retry(retry=retry_if_exception(is_transient), wait=_wait, stop=stop, before_sleep=log_retry, reraise=True)


def describe(exc: BaseException, token: SecretStr | None = None) -> str:
    """A one-line account of a Hub failure, the token masked should a message echo it."""
    status = _status(exc)
    if status in (401, 403):
        return f"the Hub refused HF_TOKEN (HTTP {status}); create a token with write access at https://huggingface.co/settings/tokens and set HF_TOKEN"
    detail = Masker(token, url_secrets())(first_line(exc, 200, ""))
    what = f"the Hub answered HTTP {status}" if status is not None else f"{type(exc).__name__} talking to the Hub"
    return f"{what}: {detail}" if detail else what


class Hub:
    def __init__(self, token: SecretStr | None, max_retry_seconds: float, request_timeout: float | None = None):
        """`max_retry_seconds` (PUSH_TIMEOUT) bounds a whole push (rank 0 alone then: no collective waits on it)."""
        if request_timeout is not None:
            use_request_timeout(request_timeout)
        self._token = token
        self._api = HfApi(token=token.get_secret_value() if token else False)
        self._max_retry_seconds = max_retry_seconds

    def check_write_access(self, repo_id: str) -> str:
        """Fail before any GPU time when the token is wrong or read-only, or the Hub does not answer."""
        seconds = min(TOKEN_CHECK_SECONDS, self._max_retry_seconds)
        try:
            me = within(seconds, _retrying(time.monotonic() + seconds, self._token)(self._api.whoami), "hub-call")
        except Exception as exc:
            if _status(exc) in (401, 403):
                raise BadInput(f"checking HF_TOKEN failed: {describe(exc, self._token)}") from None
            if unresolved(exc):
                host = httpx2.URL(constants.ENDPOINT).host
                raise BadInput(
                    f"the Hub's host {host} (HF_ENDPOINT={constants.ENDPOINT}) does not resolve to an address "
                    f"(retried for {NAME_RESOLUTION_SECONDS} s); check HF_ENDPOINT and this machine's DNS, or unset "
                    "RESULT_MODEL_ID to train without pushing (push later with --push-only)",
                ) from None
            raise BadInput(
                f"the Hub at {constants.ENDPOINT} could not be reached to check HF_TOKEN within {seconds:.0f} s ({describe(exc, self._token)}); "
                "check HF_ENDPOINT and the network route to the Hub, or unset RESULT_MODEL_ID to train without pushing (push later with --push-only)",
            ) from None
        access = me.get("auth", {}).get("accessToken", {})
        role = access.get("role")
        # A fine-grained token writes where a scope grants repo.write on the namespace or on the repo itself.
        places = (repo_id.split("/")[0] if "/" in repo_id else me.get("name"), repo_id)
        scopes = (access.get("fineGrained") or {}).get("scoped", [])
        writes = any(
            s.get("entity", {}).get("name") in places and "repo.write" in s.get("permissions", []) for s in scopes
        )
        if role == "read" or (role == "fineGrained" and not writes):
            raise BadInput(
                f"HF_TOKEN of '{me.get('name')}' cannot write to RESULT_MODEL_ID={repo_id} ({role} token); "
                "create a token with write access to that namespace at https://huggingface.co/settings/tokens",
            )
        log.info("HF_TOKEN belongs to '%s' (%s)", me.get("name"), role or "unknown role")
        return me.get("name", "")

    def describe(self, exc: BaseException) -> str:
        return describe(exc, self._token)

    def push_files(
        self,
        files: dict[str, Path],
        repo_id: str,
        private: bool,
        message: str,
        card: ModelCard | None = None,
        open_file: Callable[[Path], BinaryIO] | None = None,
    ) -> str:
        """create_repo, the Hub's check of the card, then `files` (path in the repo -> local file, read through
        `open_file`) in one commit; each call retried, all within one deadline. Returns the commit URL."""
        deadline = time.monotonic() + self._max_retry_seconds
        retrying = _retrying(deadline, self._token)

        def commit() -> str:
            # Fresh operations for every attempt: create_commit records upload state on them.
            with ExitStack() as opened:
                operations = [
                    CommitOperationAdd(
                        path_in_repo=path,
                        path_or_fileobj=opened.enter_context(open_file(local)) if open_file else str(local),
                    )
                    for path, local in sorted(files.items())
                ]
                info = self._api.create_commit(repo_id=repo_id, operations=operations, commit_message=message)
            return str(info.commit_url if hasattr(info, "commit_url") else info)

        def push() -> str:
            retrying(self._api.create_repo)(repo_id=repo_id, private=private, exist_ok=True)
            if card is not None:  # the Hub's own check of its YAML: a card it would reject fails here, not on the page
                retrying(card.validate)(repo_type="model")
            return retrying(commit)()

        return within(self._max_retry_seconds, push, "hub-call")


def save_model(
    run: RunDir,
    card: CardFacts,
    plan: Plan,
    trainer: Trainer,
    metrics: dict,
    state_dict: dict | None = None,
    *,
    base_fingerprint: dict[str, str] | str,
    repo_id: str | None,
):
    """Write model/ (adapter, tokenizer, label names, base fingerprint, training curves, card) and metrics.json.
    `state_dict`: a sharded model's gathered weights (None: the model's own)."""
    staged = run.make_dir(run.root / ".model.partial", fresh=True)
    model = trainer.model
    # The adapter names its base by Hub id, so it loads anywhere; else by the folder's absolute path, so predict.py
    # finds it from any working directory (a relative MODEL_NAME names a folder only from where the run started).
    base = published_base(metrics, plan) or os.path.abspath(os.path.expanduser(card.model_name))
    model.peft_config["default"].base_model_name_or_path = base
    model.save_pretrained(staged, state_dict=state_dict)
    trainer.processing_class.save_pretrained(staged)
    write_label_names(staged, metrics, card.label_names, card.text_columns, card.label_column)
    write_base_fingerprint(staged, base_fingerprint)
    plot_training_curves(trainer.state.log_history, staged / PLOT_NAME)
    write_model_card(staged, card, plan, metrics, repo_id)
    _replace_with(run, staged, run.model)
    run.write_json(run.metrics, metrics)  # last: a finished run is one with metrics.json (RunDir.is_finished)
    log.info("saved %s and %s", run.model, run.metrics)


def save_merged(run: RunDir, card: CardFacts, plan: Plan, problem_type: str, repo_id: str | None) -> None:
    """MERGE_ADAPTER: merged/, the base with model/'s adapter merged in, full precision."""
    from utils.training.model import merge_adapter  # seconds to import; the Hub client alone needs none of it

    # The base at MODEL_NAME may have been replaced since the adapter was trained, and the same shapes would load.
    if changed := base_model_changes(read_base_fingerprint(run.model), card.model_name):
        raise BadInput(
            f"MODEL_NAME={card.model_name} is not the base model the adapter in {run.model} was trained on: its "
            f"{changed} changed since (added, removed or edited; {BASE_NAME} there records the SHA-256 of each "
            "weights, config and tokenizer file the adapter was trained on), so nothing was merged; restore that base "
            "at MODEL_NAME (or point MODEL_NAME at an unchanged copy of it) and run again to merge, or train again "
            "on this base in a new OUTPUT_DIR",
        )
    staged = run.make_dir(run.root / ".merged.partial", fresh=True)
    merge_adapter(card.model_name, run.model, card.label_names, problem_type == MULTI_LABEL, staged)
    write_model_card(staged, card, plan, run.read_json(run.metrics) or {}, repo_id, merged=True)
    _replace_with(run, staged, run.merged)
    log.info("saved %s (adapter merged into the base, full precision)", run.merged)


def _replace_with(run: RunDir, staged: Path, folder: Path) -> None:
    """`folder` replaced by `staged`, its files recorded: a push sends only what was just written."""
    files = run.files_in(staged)
    replace_dir(staged, folder)
    record_written(run, folder.name, [f"{folder.name}/{name}" for name in files], replace=True)


PUSH_RECORD = {False: "pushed", True: "pushed_merged"}  # run.json keys: what was pushed where


def files_to_push(run: RunDir, metrics: dict, folder: Path) -> dict[str, Path]:
    """Path in the repo -> file: `folder`'s, metrics.json, the masked run.json and this run's TensorBoard events (the
    Hub's training-metrics tab); those the job recorded writing, never what a walk finds."""
    recorded = written_files(run, folder.name)
    if recorded is None:  # a model saved before the job recorded its files: the folder as written, links refused
        recorded = [folder / name for name in run.files_in(folder)]
    files = {str(path.relative_to(folder)): path for path in recorded}
    files |= {"metrics.json": run.metrics, "run.json": run.run_record}
    events = run.tensorboard / metrics["run_name"]
    return files | {
        f"runs/{metrics['run_name']}/{path.relative_to(events)}": path
        for path in written_files(run, "tensorboard") or []
        if path.parent == events
    }


def adapter_config_for_hub(run: RunDir, base: str | None) -> dict[Path, bytes]:
    """model/adapter_config.json as pushed where it names a local base folder: the pushed copy names `base`."""
    path = run.model / "adapter_config.json"
    config = run.read_json(path) or {}
    if not base or config.get("base_model_name_or_path") in (None, base):
        return {}
    log.info(
        f"the pushed adapter_config.json names its base {base}, as the card does ({path} keeps "
        f"{config['base_model_name_or_path']}, for use on this cluster)"
    )
    return {path: (json.dumps({**config, "base_model_name_or_path": base}, indent=2, sort_keys=True) + "\n").encode()}


@dataclass(frozen=True)
class PushTargets:
    """Where the models go (Settings.select builds it)."""

    result_model_id: str | None
    result_merged_model_id: str | None
    hub_private: bool


def push_model(run: RunDir, card: CardFacts, plan: Plan, targets: PushTargets, hub: Hub) -> int:
    """Push model/ (and merged/) unless already pushed; exit 3 if a push fails after retries."""
    code = EXIT_OK
    metrics = run.read_json(run.metrics) or {}
    for merged, repo_id in ((False, targets.result_model_id), (True, targets.result_merged_model_id)):
        pushed = (run.read_json(run.run_record) or {}).get(PUSH_RECORD[merged]) or {}
        if not repo_id or pushed.get("repo_id") == repo_id:
            continue
        folder = run.merged if merged else run.model
        files = files_to_push(run, metrics, folder)
        # A file planted since it was written (a link, a hard link) is refused before anything is written or sent.
        for path in files.values():
            run.check_owned(path)
        # The card again, now naming the repo it is pushed to (after --push-only too).
        written = write_model_card(folder, card, plan, metrics, repo_id, merged=merged)
        sent = {} if merged else adapter_config_for_hub(run, published_base(metrics, plan))

        def open_file(path: Path, sent=sent) -> BinaryIO:  # not following a link: what was checked is what is sent
            return io.BytesIO(sent[path]) if path in sent else run.open(path, "rb")

        log.info("pushing %s to %s", folder, repo_id)
        try:
            url = hub.push_files(
                files, repo_id, targets.hub_private, f"Upload {metrics['run_name']}", written, open_file
            )
        except JobError:  # a file planted since the check above: refused, not a failed push to retry
            raise
        except Exception as exc:
            log.error("push to %s failed: %s", repo_id, hub.describe(exc))
            fix = f"the model is in {folder}: rerun with --push-only"
            print(f"error: push to {repo_id} failed ({hub.describe(exc)}); {fix}", file=sys.stderr)
            code = EXIT_PUSH_FAILED
            continue
        update_run_record(run, **{PUSH_RECORD[merged]: {"repo_id": repo_id, "commit": url}})
        log.info("pushed to %s", url)
    return code
