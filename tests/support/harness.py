"""The job's start-up in this process (`make check` stays one process): `configured` (settings and the plan) and
`start_in_process` (everything up to the first training step)."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

from tests.support.outcomes import error_lines


def exactly(monkeypatch, env: dict[str, str]) -> None:
    """This process's environment made exactly `env` for the test (monkeypatch restores it)."""
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))


def configured(monkeypatch, env: dict[str, str], argv: list[str] | None = None):
    """What main.py resolves before torch (`main.configure`: settings, ranks, the plan) in a process whose
    environment is exactly `env`; bad input raises JobError."""
    from main import configure

    exactly(monkeypatch, env)
    return configure(list(argv or []))


class ReachedTraining(BaseException):
    """Raised where `start_in_process` stops the job: every check of its start-up passed. Not an Exception, so
    main() lets it through, and the run's own clean-up (the OUTPUT_DIR lock, the process group) runs on the way."""

    def __init__(self, ready):
        super().__init__("the start-up accepted the run")
        self.ready = ready


@dataclass
class InProcessStart:
    code: int | None  # main()'s exit code; None: it reached the first training step
    layer: str | None  # the part of the start-up that refused (JobError.stage): settings, output, device, join, ...
    error: str | None  # the `error:` line's message
    stderr: str
    ready: object | None  # utils.run.Ready, when it reached training


def start_in_process(monkeypatch, env: dict[str, str], argv: list[str] | tuple = ()) -> InProcessStart:
    """`main.main(argv)` in this process, whose environment is exactly `env`, up to the first training step: the
    job's own start-up in its order (settings, OUTPUT_DIR, device and numerics, the strategy, Hub and tracker checks,
    the rendezvous, tokenizer, data, model, the checkpoint to resume, the Trainer, run.json), nothing re-implemented;
    it stops where training would begin (main's `before_training`), and a refusal names its part (`refused`). What a
    start changes in the process (its stop-signal handlers, masked streams, logging, exported variables, libraries
    left out, the frozen heap) is undone or kept out, so that `make check` stays one process."""
    import gc
    import io
    from contextlib import redirect_stderr, redirect_stdout

    import main
    from utils.cluster.preemption import Preemption

    exactly(monkeypatch, env)
    refusals = []

    def stop(ready):
        raise ReachedTraining(ready)

    monkeypatch.setattr(Preemption, "install", lambda self: None)  # no signal reaches this process's test
    monkeypatch.setattr(gc, "freeze", lambda: None)
    environ = dict(os.environ)
    modules = {name: sys.modules.get(name, REMOVED) for name in ("deepspeed", "bitsandbytes")}
    root, transformers_log = logging.getLogger(), logging.getLogger("transformers")
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in ("utils", "transformers.trainer")}
    library = (list(transformers_log.handlers), transformers_log.propagate)
    out, err = io.StringIO(), io.StringIO()
    ready = None
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = main.main(list(argv), before_training=stop, refused=refusals.append)
    except ReachedTraining as reached:
        code, ready = None, reached.ready
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for name, module in modules.items():
            if module is REMOVED and sys.modules.get(name, REMOVED) is None:  # left out by the start
                del sys.modules[name]
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, was in levels.items():
            logging.getLogger(name).setLevel(was)
        transformers_log.handlers[:], transformers_log.propagate = library
    errors = error_lines(err.getvalue())
    layer = refusals[0].stage if refusals else None
    return InProcessStart(code, layer, errors[0].removeprefix("error: ") if errors else None, err.getvalue(), ready)


REMOVED = object()
