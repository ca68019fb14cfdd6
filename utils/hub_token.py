"""The Hub token: read from HF_TOKEN or HF_TOKEN_PATH, checked, and masked in everything the job prints or logs.

The token is never formatted into a message on purpose, but libraries do it for us: an exception about
a header shows the token `repr`-escaped, a URL shows it percent-encoded, a setting (RUN_NAME) can hold
it by mistake. So the job refuses a token that could not be a header value (control characters, a
second line) before anything uses it, refuses settings that contain it, and masks every form of it in
stdout, stderr and the rank logs.

Imports nothing heavy: main.py installs the masking before torch is imported.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from pydantic import SecretStr

from utils.errors import EXIT_BAD_INPUT, JobError

MASK = "***"
# A Hub token is one printable ASCII word (hf_ + letters and digits). Anything else (a newline, a tab,
# a second line of the token file) cannot go in an HTTP header and would only ever be echoed back.
TOKEN_PATTERN = re.compile(r"[\x21-\x7e]+")
MIN_TOKEN_LENGTH = 8  # Hub tokens are 37 characters; a shorter value is a mistake, and masking it would garble output


def read_token() -> SecretStr | None:
    """HF_TOKEN, else the file HF_TOKEN_PATH names (as huggingface_hub reads them); None when neither is set.

    A value that cannot be a token is bad input, reported without showing it.
    """
    token = os.environ.get("HF_TOKEN", "").strip()
    source = "HF_TOKEN"
    path = os.environ.get("HF_TOKEN_PATH", "").strip()
    if not token and path:
        source = f"the file HF_TOKEN_PATH={path}"
        try:
            token = Path(path).expanduser().read_bytes().decode("utf-8").strip()
        except OSError as exc:
            raise JobError(
                EXIT_BAD_INPUT,
                f"HF_TOKEN_PATH={path} cannot be read ({exc.strerror}); mount the token file there or set HF_TOKEN",
            ) from None
        except UnicodeDecodeError:
            raise JobError(
                EXIT_BAD_INPUT,
                f"HF_TOKEN_PATH={path} is not a text file (not UTF-8); it must hold the token alone, on one line",
            ) from None
    if not token:
        return None
    if not TOKEN_PATTERN.fullmatch(token):
        raise JobError(
            EXIT_BAD_INPUT,
            f"{source} holds a newline, space, control or non-ASCII character (the value is not shown); "
            "it must hold the Hub token alone, on one line: copy it again from https://huggingface.co/settings/tokens",
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise JobError(
            EXIT_BAD_INPUT, f"{source} is {len(token)} characters long, too short for a Hub token; set the whole token"
        )
    return SecretStr(token)


def token_forms(token: str) -> list[str]:
    """Every way the token can appear in text: raw, repr/JSON-escaped, percent-encoded (longest first)."""
    forms = {
        token,
        repr(token)[1:-1],
        json.dumps(token)[1:-1],
        urllib.parse.quote(token, safe=""),
        urllib.parse.quote_plus(token, safe=""),
    }
    return sorted((form for form in forms if form), key=len, reverse=True)


class Masker:
    """Replaces every form of the token with ***; a no-op when no token is set."""

    def __init__(self, token: SecretStr | None):
        forms = token_forms(token.get_secret_value()) if token is not None else []
        self._pattern = re.compile("|".join(re.escape(form) for form in forms)) if forms else None

    def __call__(self, text: str) -> str:
        return self._pattern.sub(MASK, text) if self._pattern is not None and text else text

    def holds_secret(self, text: str) -> bool:
        return self._pattern is not None and bool(self._pattern.search(text))


class MaskedStream:
    """A text stream that masks the token in everything written to it (tracebacks, warnings, progress bars)."""

    def __init__(self, stream: TextIO, masker: Masker):
        self._stream, self._mask = stream, masker

    def write(self, text: str) -> int:
        self._stream.write(self._mask(text))
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
    """Mask the token on stdout and stderr of this process from now on (reads and checks the token).

    Returns the Masker, for the log handlers the run adds later (the rank logs are files, not stderr).
    """
    masker = Masker(read_token())
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, MaskedStream):
            setattr(sys, name, MaskedStream(stream, masker))
    return masker


def refuse_token_in_settings(values: dict[str, Any]) -> None:
    """A setting that holds the token would put it in folder names, run.json, the model card and the
    trackers: refuse it by name, without showing it."""
    token = Masker(read_token())
    holding = [name for name, value in values.items() if name != "hf_token" and token.holds_secret(str(value))]
    if holding:
        names = ", ".join(name.upper() for name in holding)
        verb = "holds" if len(holding) == 1 else "hold"
        raise JobError(
            EXIT_BAD_INPUT,
            f"{names} {verb} the Hub token; the token belongs only in HF_TOKEN or HF_TOKEN_PATH: set {names} to something else",
        )
