"""The documented `python predict.py` commands, found where users read them and made runnable here."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from tests.support.env import REPO

PREDICT = f"{shlex.quote(sys.executable)} {shlex.quote(str(REPO / 'predict.py'))}"  # `python predict.py`, here


def readme_predict_command(fragment: str) -> str:
    """The README's one `python predict.py` line holding `fragment`, without its comment."""
    lines = (REPO / "README.md").read_text().splitlines()
    [command] = [
        line.split(" #")[0].strip() for line in lines if line.startswith("python predict.py") and fragment in line
    ]
    return command


def runnable(command: str, output_dir: Path) -> str:
    """`command` as bash runs it here: this checkout's predict.py under this Python, OUTPUT_DIR the run's folder."""
    return command.replace("OUTPUT_DIR", str(output_dir)).replace("python predict.py", PREDICT)
