"""Exit codes the orchestrators act on (docs/reliability.md), the exceptions that carry them, and the environment
faults that map onto them (a full or read-only OUTPUT_DIR volume)."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_BAD_INPUT = 2  # permanent: restarting will not help, so restartPolicy: ExitCode does not restart it
EXIT_PUSH_FAILED = 3  # trained and saved; `--push-only` retries the upload
# 128 + SIGTERM, also for a peer lost mid-training: orchestrators restart on >= 128, and the run resumes.
EXIT_PREEMPTED = 143


class JobError(Exception):
    """An error with a known exit code and a one-line message that says how to fix it."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message
        self.stage: str | None = None  # the part of the start-up that refused it (`stage`); None: no part named


@contextlib.contextmanager
def stage(name: str):
    """Names the part of the start-up (the innermost) a JobError raised inside comes from: tests/test_refusals.py
    holds each refusal to its part, so a check that moves later in the start-up fails there."""
    try:
        yield
    except JobError as exc:
        exc.stage = exc.stage or name
        raise


class BadInput(JobError):
    """Bad input, settings or credentials (exit 2): restarting will not help; the message says the fix."""

    def __init__(self, message: str):
        super().__init__(EXIT_BAD_INPUT, message)


def first_line(exc: BaseException, limit: int | None = 200, blank: str | None = None) -> str:
    """The start of an error's message for a one-line refusal; `blank` (its type's name when None) when it has none."""
    return (str(exc).strip().splitlines() or [type(exc).__name__ if blank is None else blank])[0][:limit]


class Preempted(BaseException):
    """SIGTERM or SIGINT: leave with 128 + the signal so the orchestrator restarts the job. A BaseException, like
    KeyboardInterrupt: no library's `except Exception` eats it."""

    def __init__(self, message: str, code: int = EXIT_PREEMPTED):
        super().__init__(message)
        self.message, self.code = message, code  # 128 + the signal: 143 after SIGTERM, 130 after SIGINT


# A full or read-only volume will not heal by itself (a restart would fail the same way, or loop): exit 2, like
# bad input; once someone repairs it, the job resumes from the last complete checkpoint.
VOLUME_ERRNOS = {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EROFS: "read-only"}
# Free space below this, right after a failed write, means the write filled the volume (a partial file is
# left taking the rest): torch.save and safetensors report ENOSPC as a RuntimeError or their own error type.
NEARLY_FULL_BYTES = 1 << 20
IO_ERROR_LOOKS = 30  # 3 s: how long an EIO waits to see the volume turn read-only


def volume_state(exc: BaseException, folder: str | os.PathLike) -> str | None:
    """Whether `exc` came from OUTPUT_DIR's volume filling up or turning read-only: "full", "read-only" or None.
    Told by an errno in the exception's chain, or, where a library hides it (torch.save), by the volume itself right
    after the failure; never by the words of a message."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    io_error = False
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in VOLUME_ERRNOS:
            return VOLUME_ERRNOS[cause.errno]
        io_error = io_error or (isinstance(cause, OSError) and cause.errno == errno.EIO)
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    # A file system that fails (ext4 errors=remount-ro) answers the write in flight with EIO and turns
    # read-only as it handles the error: look again for a moment before calling it something else.
    for _ in range(IO_ERROR_LOOKS if io_error else 1):
        try:
            volume = os.statvfs(folder)
        except OSError:
            return None
        refused = _refuses_new_files(folder)
        if volume.f_flag & os.ST_RDONLY or refused == "read-only":
            return "read-only"
        if refused == "full" or volume.f_bavail * volume.f_frsize < NEARLY_FULL_BYTES:
            return "full"
        if io_error:
            time.sleep(0.1)
    return None


def _refuses_new_files(folder: str | os.PathLike) -> str | None:
    """What creating an empty file in `folder` meets now: since Linux 6.9 a failed ext4 volume refuses writes with
    EROFS but no longer tells statvfs it is read-only."""
    probe = os.path.join(folder, f".volume-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        return VOLUME_ERRNOS.get(exc.errno)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def volume_error(state: str, folder: str | os.PathLike, doing: str, resume: str) -> JobError:
    """The one `error:` line for a volume that is `state` ("full" or "read-only"); `resume`: what a restart does."""
    what, fix = (
        "turned read-only (its volume was remounted read-only, usually after a file-system error: see the node's kernel log)",
        "repair the volume or mount it read-write again",
    )
    if state == "full":
        what = "is full (no space left on its volume)"
        fix = "free space there (e.g. remove other runs' folders) or give the job a larger volume (shared_volume size in config.yaml, the PVC's storage in k8s/)"
    return BadInput(
        f"OUTPUT_DIR={folder} {what} while {doing}; {fix}, then start the job again: {resume} (exit {EXIT_BAD_INPUT}: a restart before that fails the same way)",
    )


def quiet_volume_faults_in_threads() -> None:
    """Let a background writer thread die of a full or read-only volume without a traceback: TensorBoard's writer
    hands the error to the training thread too, which reports it once."""
    default = threading.excepthook
    if getattr(default, "quiet_volume_faults", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and args.exc_value.errno in VOLUME_ERRNOS:
            return
        default(args)

    hook.quiet_volume_faults = True
    threading.excepthook = hook
