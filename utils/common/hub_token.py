"""The Hub token and the other secrets the job is given: read, checked, and masked in everything it prints or logs.

Libraries print the token for us: an exception shows it `repr`-escaped, a URL percent-encoded, a setting can hold
it by mistake. So a token that could not be a header value is refused, a setting holding it is refused, and
every form of it (and any URL credential) is masked in stdout, stderr and the rank logs. Imports nothing heavy.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import stat
import sys
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from pydantic import SecretStr

from utils.common.errors import BadInput, JobError

MASK = "***"
# One printable ASCII word: anything else cannot go in an HTTP header and would only ever be echoed back.
TOKEN_PATTERN = re.compile(r"[\x21-\x7e]+")
MIN_TOKEN_LENGTH = 8  # Hub tokens are 37 characters; a shorter value is a mistake, and masking it would garble output
MAX_TOKEN_FILE_BYTES = 4096  # a token file holds one line; more is the wrong file (and /dev/zero never ends)

# Variables holding URLs that libraries print back: the credentials inside them are secrets.
URL_VARIABLES = (
    *("HF_ENDPOINT", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "WANDB_BASE_URL", "HTTP_PROXY", "HTTPS_PROXY"),
    *("ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"),
)
# Variables that are secrets as a whole, read by the trackers themselves.
SECRET_VARIABLES = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY")
# A shorter password is masked only where it sits in a URL: masking a short word everywhere would garble output.
MIN_SECRET_LENGTH = 6
# Query parameters that carry a credential (?token=, &api_key=, &sig= of a signed URL ...).
SECRET_PARAMETER = r"[\w.-]*(?:token|key|secret|password|passwd|pwd|sig|signature|credential|auth)[\w.-]*"
URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?:(?P<user>[^\s/?#@:]*):)?[^\s/?#]*@")
URL_SECRET_QUERY = re.compile(rf"(?P<name>[?&;]{SECRET_PARAMETER}=)[^&;#\s\"'<>]+", re.IGNORECASE)


# Not huggingface_hub.get_token: it joins a token's lines into one and reads a stored login the job must not use.
def read_token() -> SecretStr | None:
    """HF_TOKEN, else the file HF_TOKEN_PATH names; None when neither is set. A bad value is refused unshown."""
    token, source = os.environ.get("HF_TOKEN", "").strip(), "HF_TOKEN"
    path = os.environ.get("HF_TOKEN_PATH", "").strip()
    if not token and path:
        source = f"the file HF_TOKEN_PATH={path}"
        try:
            token = read_small_text(path, MAX_TOKEN_FILE_BYTES).strip()
        except (OSError, UnfitFile) as exc:
            why = f"cannot be read ({exc.strerror})" if isinstance(exc, OSError) else str(exc)
            raise BadInput(
                f"HF_TOKEN_PATH={path} {why}; point it at a regular file holding the Hub token alone, on one line "
                "(a mounted Secret's key is one), or set HF_TOKEN",
            ) from None
    if not token:
        return None
    if not TOKEN_PATTERN.fullmatch(token):
        raise BadInput(
            f"{source} holds a newline, space, control or non-ASCII character (the value is not shown); "
            "it must hold the Hub token alone, on one line: copy it again from https://huggingface.co/settings/tokens",
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise BadInput(f"{source} is {len(token)} characters long, too short for a Hub token; set the whole token")
    return SecretStr(token)


class UnfitFile(ValueError):
    """A path that names no small text file; the message says what it is."""


def read_small_text(path: str | Path, limit: int) -> str:
    """The text of a regular file of at most `limit` bytes: a FIFO would block for ever, /dev/zero never end.
    Raises OSError as the system says it, UnfitFile for anything else."""
    fd = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device"
        raise UnfitFile(f"is not a regular file ({kind})")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnfitFile(f"holds more than {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UnfitFile("is not a text file (not UTF-8)") from None


def any_form_of(secrets: Iterable[str]) -> re.Pattern | None:
    """Every way each secret can appear in text (raw, escaped, percent-encoded), longest first: masked whole."""
    forms: set[str] = set()
    for secret in secrets:
        quoted = (urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret, safe=""))
        forms |= {secret, repr(secret)[1:-1], json.dumps(secret)[1:-1], *quoted} - {""}
    return re.compile("|".join(map(re.escape, sorted(forms, key=len, reverse=True)))) if forms else None


def url_secrets(environ: dict[str, str] | None = None) -> list[str]:
    """What else the job must never print: the credentials inside the URLs of URL_VARIABLES (the Basic-auth header
    a client makes of user:password too), and the values of SECRET_VARIABLES."""
    environ = os.environ if environ is None else environ
    secrets = [environ[name].strip() for name in SECRET_VARIABLES if environ.get(name, "").strip()]
    for name in URL_VARIABLES:
        value = environ.get(name, "").strip()
        if not value:
            continue
        try:
            parts = urllib.parse.urlsplit(value if "://" in value else f"//{value}")
        except ValueError:  # not a URL the clients could use either; the generic patterns still apply
            continue
        user, password = parts.username, parts.password
        if password:
            plain_user, plain_password = urllib.parse.unquote(user or ""), urllib.parse.unquote(password)
            secrets += [password, plain_password]
            secrets.append(base64.b64encode(f"{plain_user}:{plain_password}".encode()).decode())
        elif user:  # https://TOKEN@host: the user name is the credential
            secrets += [user, urllib.parse.unquote(user)]
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=False)
        secrets += [v for k, v in query if re.fullmatch(SECRET_PARAMETER, k, re.IGNORECASE)]
    return [secret for secret in secrets if len(secret) >= MIN_SECRET_LENGTH]


def mask_urls(text: str) -> str:
    """`scheme://user:***@host` and `?token=***` for credentials inside any URL in `text`."""
    text = URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user'] + ':' if m['user'] else ''}{MASK}@", text)
    return URL_SECRET_QUERY.sub(lambda m: f"{m['name']}{MASK}", text)


class Masker:
    """Replaces every form of the token (and of `secrets`) with ***, and credentials inside any URL."""

    def __init__(self, token: SecretStr | None, secrets: Iterable[str] = ()):
        self._pattern = any_form_of([token.get_secret_value()] if token is not None else [])
        self._others = any_form_of(secrets)

    def __call__(self, text: str) -> str:
        if self._pattern is not None:
            text = self._pattern.sub(MASK, text)
        if "://" in text or "=" in text:
            text = mask_urls(text)
        return self._others.sub(MASK, text) if self._others is not None else text

    def holds_secret(self, text: str) -> bool:
        """Whether `text` holds the token (the other secrets are only masked)."""
        return self._pattern is not None and bool(self._pattern.search(text))


# Lines orchestrators and people look for: each starts a line of its own, even right after a progress bar.
OWN_LINE_PREFIXES = ("error: ", "preempted: ")


class MaskedStream:
    """A text stream that masks secrets in everything written to it. An `error:` line after a progress bar (which
    leaves the cursor at its line's end) gets a newline first, not to be glued to the bar."""

    def __init__(self, stream: TextIO, masker: Masker):
        self._stream, self._mask = stream, masker
        self._mid_line = False  # the last character written was not a line end

    def write(self, text: str) -> int:
        if not text:
            return 0
        masked = self._mask(text)
        if self._mid_line and masked.startswith(OWN_LINE_PREFIXES):
            masked = "\n" + masked
        self._stream.write(masked)
        self._mid_line = masked[-1] not in "\n\r"
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding ...: the real stream's
        return getattr(self._stream, name)


class MaskingFilter(logging.Filter):
    """Masks the token in a log record before any handler formats it (the rank logs are files)."""

    def __init__(self, masker: Masker):
        super().__init__()
        self._mask = masker

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = self._mask(message)
        if masked != message:
            record.msg, record.args = masked, ()
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = self._mask(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def install_masking() -> Masker:
    """Mask the token (read and checked here) and URL credentials on stdout and stderr; the Masker is for the rank
    logs' handlers."""
    try:
        token = read_token()
    except JobError:
        # A malformed token is refused, but --help still answers: until then whatever HF_TOKEN holds is masked.
        raw = os.environ.get("HF_TOKEN", "").strip()
        _mask_streams(
            Masker(None, [*(line.strip() for line in raw.splitlines() if line.strip()), raw, *url_secrets()])
        )
        raise
    masker = Masker(token, url_secrets())
    _mask_streams(masker)
    return masker


def _mask_streams(masker: Masker) -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, MaskedStream):
            stream = stream._stream  # the masker replaced, not stacked
        setattr(sys, name, MaskedStream(stream, masker))


def refuse_token_in_settings(values: dict[str, Any], token: SecretStr | None) -> None:
    """A setting holding the token would put it in folder names, run.json, the card: refused by name, unshown."""
    masker = Masker(token)
    holding = [name for name, value in values.items() if name != "hf_token" and masker.holds_secret(str(value))]
    if holding:
        names = ", ".join(name.upper() for name in holding)
        raise BadInput(
            f"{names} {'holds' if len(holding) == 1 else 'hold'} the Hub token; the token belongs only in HF_TOKEN or HF_TOKEN_PATH: set {names} to something else",
        )
