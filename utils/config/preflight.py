"""The checks before anything loads that look beyond the settings: a push needs a token and a reachable Hub, a
tracker its package and, for MLflow, a store that answers. Bad input (exit 2) with the fix, before data and GPU time.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
import urllib.request

from utils.common.errors import BadInput, JobError
from utils.common.hub_token import mask_urls
from utils.common.threads import Deadline, within
from utils.config.settings import Settings


def check_push_possible(settings: Settings, base_model_id: str | None) -> None:
    """A push that cannot happen (no token, offline mode, an adapter nobody could load) is bad input now.
    `base_model_id`: the plan's (None: a folder that records no Hub id)."""
    repos = {"RESULT_MODEL_ID": settings.result_model_id, "RESULT_MERGED_MODEL_ID": settings.result_merged_model_id}
    pushes = " and ".join(f"{name}={value}" for name, value in repos.items() if value)
    if pushes and settings.hub_token is None:
        raise BadInput(
            f"{pushes} ask(s) for a push but no token is set; "
            "set HF_TOKEN (or HF_TOKEN_PATH to a file holding it), or unset them to keep the model on the volume",
        )
    if pushes and os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        raise BadInput(
            f"{pushes} ask(s) for a push but HF_HUB_OFFLINE is set; "
            "unset HF_HUB_OFFLINE where the Hub is reachable, or unset them (push later with --push-only)",
        )
    if settings.result_model_id and base_model_id is None:
        raise BadInput(
            f"MODEL_NAME={settings.model_name} is a local folder that does not record the base model's Hub id, and an adapter "
            f"pushed to {settings.result_model_id} would name this path as its base (nobody else could load it); "
            "set BASE_MODEL_ID to the Hub id these weights came from (e.g. bert-base-uncased)",
        )


TRACKER_PACKAGES = {"mlflow": "mlflow-skinny", "wandb": "wandb", "trackio": "trackio"}  # module: pip name


def check_trackers(report_to: tuple[str, ...]) -> None:
    """A tracker REPORT_TO names whose package is missing is bad input now, not a traceback in the Trainer."""
    import importlib.util

    for name in report_to:
        package = TRACKER_PACKAGES.get(name)
        if package and importlib.util.find_spec(name) is None:
            raise BadInput(
                f"REPORT_TO={','.join(report_to)} needs the {package} package, which is not installed; "
                f"pip install {package} (in the image: add it to requirements.txt), or drop {name} from REPORT_TO",
            )


# MLflow's client retries a silent server for minutes (7 retries, exponential back-off): the check gives up sooner.
TRACKER_CHECK_SECONDS = 30


def check_tracker_uri(report_to: tuple[str, ...], timeout_s: float = TRACKER_CHECK_SECONDS) -> None:
    """REPORT_TO=mlflow: MLflow accepts MLFLOW_TRACKING_URI and its store answers within `timeout_s` (else MLflow
    fails at the Trainer's first log call, after loading). Read-only, so every rank may run it: a server is asked for
    one experiment; a database store is not opened, since opening it creates and migrates it."""
    if "mlflow" not in report_to:
        return
    import mlflow

    uri = mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI, or MLflow's own default
    shown = (
        f"MLFLOW_TRACKING_URI={mask_urls(uri)}" if os.environ.get("MLFLOW_TRACKING_URI") else f"MLflow's default {uri}"
    )
    fix = (
        "set MLFLOW_TRACKING_URI to a running MLflow tracking server (e.g. http://mlflow.example:5000) or a "
        "database file (e.g. sqlite:////pvc-home/mlflow.db), or drop mlflow from REPORT_TO"
    )

    def refused(why: str) -> JobError:
        return BadInput(mask_urls(f"REPORT_TO=mlflow but {why}; {fix}"))

    def cause(exc: BaseException) -> str:
        first = (str(exc).strip().splitlines() or [""])[0]
        first = first if len(first) <= 300 else first[:300] + " ..."
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__

    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.split("+")[0]
    if scheme in ("sqlite", "postgresql", "mysql", "mssql"):
        return
    if scheme in ("http", "https"):
        if not parts.hostname:
            raise refused(f"{shown} names no host")
        proxied = urllib.request.getproxies().get(scheme) and not urllib.request.proxy_bypass(parts.hostname)
        if not proxied:  # a refused connection answers at once; MLflow's client would retry it for minutes
            try:
                port = parts.port or (443 if scheme == "https" else 80)
                socket.create_connection((parts.hostname, port), timeout=min(10.0, timeout_s)).close()
            except (OSError, ValueError) as exc:
                raise refused(f"no tracking server answers at {shown} ({cause(exc)})") from None

    def probe() -> None:
        try:
            client = mlflow.MlflowClient(tracking_uri=uri)  # resolves the store: an unknown scheme fails here
        except BaseException as exc:  # whatever MLflow raises there is a refusal
            raise refused(f"MLflow has no tracking store for {shown} ({cause(exc)})") from None
        try:
            client.search_experiments(max_results=1)
        except BaseException as exc:
            raise refused(f"MLflow refuses {shown} ({cause(exc)})") from None

    try:
        within(timeout_s, probe, "tracker-check")
    except Deadline:
        raise refused(f"the tracking server at {shown} did not answer within {timeout_s:g} s") from None
