"""Exit codes the orchestrators act on (DESIGN contract), and the exceptions that carry them."""

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
        self.code = code
        self.message = message


class Preempted(BaseException):
    """SIGTERM (preemption, eviction) or SIGINT: leave with 128 + the signal so the orchestrator restarts the job.

    A BaseException, like KeyboardInterrupt: raised from the signal handler, it must not be swallowed
    by a library's `except Exception` on its way out.
    """

    def __init__(self, message: str, code: int = EXIT_PREEMPTED):
        super().__init__(message)
        self.message = message
        self.code = code  # 128 + the signal: 143 after SIGTERM, 130 after SIGINT
