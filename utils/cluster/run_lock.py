"""One job per OUTPUT_DIR: a lock file with a heartbeat, held by rank 0 for the whole run and by every start that
publishes without training. A file, not `flock`, which NFS and cloud file systems do not share across hosts.

A second job takes over a lock held on this host by a process that no longer exists (or a newer one under the
same pid) at once; otherwise it watches the heartbeat: moving, the job is refused (exit 2, naming the holder);
still for STALE_SECONDS, the lock is taken over, so a restart after a kill is never locked out.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid

import psutil

from utils.common.errors import BadInput, JobError
from utils.common.threads import Heartbeat
from utils.run_folder.layout import LOCK_NAME, RunDir

log = logging.getLogger(__name__)

BEAT_SECONDS = 2.0
STALE_SECONDS = 3 * BEAT_SECONDS + 1  # three missed beats: a live holder on a busy machine still beats within this


def _process_started(pid: int) -> float | None:
    try:
        return round(psutil.Process(pid).create_time(), 2)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


class RunLock:
    def __init__(self, run: RunDir):
        # Opened through the run folder: a link planted at the lock's name is refused.
        self.run = run
        self.path = run.root / LOCK_NAME
        self.me = {
            "job": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_started": _process_started(os.getpid()),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "beat": 0,
        }
        self._heartbeat: Heartbeat | None = None

    def acquire(self) -> None:
        """Take the lock, or raise JobError (exit 2) naming the live holder."""
        while not self._create():
            holder = self._read()
            if holder is None:  # torn or just removed: look again
                time.sleep(0.2)
                if self._read() is not None:
                    continue
                stale = "an unreadable lock file"
            elif (live := self._live_holder(holder)) is not None:
                raise BadInput(
                    f"OUTPUT_DIR={self.path.parent} is in use by another job (host {live.get('host')}, pid {live.get('pid')}, "
                    f"since {live.get('since')}); wait for it to finish or stop it, or give this job another OUTPUT_DIR",
                )
            else:
                stale = f"the lock of host {holder.get('host')} pid {holder.get('pid')} (no longer running)"
            log.warning("OUTPUT_DIR lock: took over %s", stale)
            self._write()
            break
        self._heartbeat = Heartbeat(self._beat, BEAT_SECONDS, "output-dir-lock")

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(wait=5)
        holder = self._read()
        if holder is not None and holder.get("job") == self.me["job"]:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as exc:
                # On the way out of a failure, a read-only volume's error must not replace the real one.
                log.warning("could not remove %s (%s); the next start takes it over", self.path, exc.strerror)

    def _create(self) -> bool:
        try:
            handle = self.run.open(self.path, "x")
        except FileExistsError:
            return False
        with handle:
            json.dump(self.me, handle)
        return True

    def _write(self) -> None:
        self.run.write_text(self.path, json.dumps(self.me))

    def _read(self) -> dict | None:
        try:
            with self.run.open(self.path) as handle:
                return json.loads(handle.read())
        except (OSError, ValueError):
            return None

    def _live_holder(self, holder: dict) -> dict | None:
        """The job that holds the lock now (a new holder's record, if one took over meanwhile), or None when gone."""
        if holder.get("host") == self.me["host"]:
            pid = holder.get("pid")
            started = _process_started(pid) if isinstance(pid, int) else None
            if started is None or started != holder.get("process_started") or pid == os.getpid():
                return None  # gone, or the pid now belongs to another process (this one, in a restarted container)
        beat = holder.get("beat")
        deadline = time.monotonic() + STALE_SECONDS
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self._read()
            if now is None:  # released meanwhile
                return None
            if now.get("job") != holder.get("job") or now.get("beat") != beat:
                return now
        return None

    def _beat(self) -> None:
        self.me["beat"] += 1
        try:
            self._write()
        except (OSError, JobError) as exc:  # a full or flaky volume (or a planted link) must not kill the run
            log.warning("could not refresh %s: %s", self.path, exc)
