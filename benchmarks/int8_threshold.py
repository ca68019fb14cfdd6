"""main.py with bitsandbytes' LLM.int8 outlier threshold changed from its default (6.0), for the speed benchmark's
8-bit arms only: the job has no setting for it, and the threshold is what decides whether the int8 matmul looks
for outlier columns (a host sync each layer) and splits them off.

    python benchmarks/int8_threshold.py THRESHOLD main.py [main.py's arguments]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

threshold = float(sys.argv[1])
script = sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
sys.path[0] = str(Path(script).resolve().parent)  # as `python main.py` would have it: the repository's modules

from transformers import BitsAndBytesConfig  # noqa: E402

default_init = BitsAndBytesConfig.__init__


def init_with_threshold(self, *args, **kwargs):
    kwargs.setdefault("llm_int8_threshold", threshold)
    default_init(self, *args, **kwargs)


BitsAndBytesConfig.__init__ = init_with_threshold
runpy.run_path(script, run_name="__main__")
