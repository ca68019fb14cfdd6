"""OUTPUT_DIR's volume failing under a running job (a real tmpfs or ext4 image): full during a save or the cache
write, or turning read-only (ext4 `errors=remount-ro` and its `trigger_fs_error`: a remount,ro is EBUSY under a
job). One `error:` line, exit 2 on every rank, the checkpoints complete before the fault intact."""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.env import TIMEOUT, base_env, job_settings, tiny_run_settings, unavailable
from tests.support.outcomes import assert_refusal, complete_steps, error_lines
from tests.support.processes import Popen, run_command, run_main, start_main, wait_until
from utils.common.errors import volume_state
from utils.run_folder.checkpoints import checkpoint_damage

SAVE_EVERY = 5  # optimizer steps between checkpoints: a fault meets a save within a second
LONG_RUN = 100_000  # MAX_STEPS far beyond the test: the fault, not the end of training, stops the job


def mount(*args: str) -> None:
    """`mount ARGS`, or skip the test where this machine does not let it mount (not root, no such file system)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        unavailable("mounting a test volume needs root and mount(8)")
    done = run_command(["mount", *args])
    if done.returncode != 0:
        unavailable(f"mounting a test volume is not permitted here: mount {' '.join(args)}: {done.stderr.strip()}")


def unmount(target: Path) -> None:
    run_command(["umount", "-l", str(target)])


def fill(volume: Path) -> None:
    """Write to `volume` until it is full."""
    with open(volume / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * (1 << 20))
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def long_run(tiny_bert: Path, sst2_dir: Path, out: Path, **extra) -> dict[str, str]:
    settings = tiny_run_settings(tiny_bert, sst2_dir, out, MAX_STEPS=LONG_RUN, SAVE_STEPS=SAVE_EVERY, **extra)
    settings.pop("NUM_EPOCHS")
    return settings


def wait_for_complete_checkpoint(out: Path, procs: list[Popen], timeout: float = 300) -> None:
    wait_until(lambda: complete_steps(out), f"complete checkpoint in {out}", procs, timeout, every=0.1)


def assert_intact(out: Path, steps: list[int]) -> None:
    """Every checkpoint complete before the fault is still complete, each file as it was when marked."""
    assert steps and set(steps) <= set(complete_steps(out)), (steps, complete_steps(out))
    for step in steps:
        assert checkpoint_damage(out / "checkpoints" / f"checkpoint-{step}") is None


def test_a_volume_full_during_a_checkpoint_save_ends_every_rank_with_one_line_exit_2(
    tmp_path, tiny_bert, sst2_dir, replicas
):
    out = tmp_path / "out"
    out.mkdir()
    mount("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(out))
    try:
        settings = long_run(tiny_bert, sst2_dir, out, RENDEZVOUS_TIMEOUT=TIMEOUT)
        procs = replicas.start("full", settings)
        wait_for_complete_checkpoint(out, procs)
        before = complete_steps(out)
        fill(out)
        codes = [proc.wait(timeout=120) for proc in procs]
        assert codes == [2, 2], [stream.read_text()[-3000:] for stream in replicas.streams]
        named = set()
        for stream in replicas.streams:
            line = assert_refusal(stream.read_text(), [f"OUTPUT_DIR={out}", "no space left", "shared_volume"])
            named.add(int(re.search(r"it resumes from checkpoint-(\d+)", line).group(1)))
        # Every rank names the same checkpoint to resume from: the newest complete one.
        [step] = named
        assert step == max(complete_steps(out)) >= max(before)
        assert_intact(out, before)
        # The save the fault cut short is left without a COMPLETE marker; the volume freed, the next start
        # discards it and saves that step again whole, never into the half-written folder.
        cut_short = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("checkpoint-*"))
        cut_short = [s for s in cut_short if s > step]
        assert cut_short and not set(cut_short) & set(complete_steps(out)), (cut_short, complete_steps(out))
        (out / "filler").unlink()
        # Stands for a file of the cut-short save that the new save of that step would not overwrite.
        stale = [out / "checkpoints" / f"checkpoint-{lost}" / "stale-part" for lost in cut_short]
        for path in stale:
            path.touch()
        procs = replicas.start("again", settings)
        wait_until(lambda: max(complete_steps(out)) >= max(cut_short), "the cut-short step saved whole", procs)
        assert not any(path.exists() for path in stale)
        replicas.cleanup()  # the restart goes on saving and pruning: stopped, its checkpoints hold still
        console = replicas.streams[-2].read_text()
        for lost in cut_short:
            assert f"removed checkpoint-{lost}: its save never completed" in console, console[-3000:]
        assert f"resuming from step {step} " in console, console[-3000:]
        assert_intact(out, complete_steps(out))
    finally:
        replicas.cleanup()
        unmount(out)


@contextmanager
def failing_ext4(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """An ext4 volume mounted `errors=remount-ro` at tmp_path/out, and the switch that makes it fail."""
    for tool in ("mkfs.ext4", "losetup"):
        if shutil.which(tool) is None:
            unavailable(f"an ext4 test volume needs {tool}")
    image, out = tmp_path / "volume.ext4", tmp_path / "out"
    with open(image, "wb") as handle:
        handle.truncate(64 << 20)
    made = run_command(["mkfs.ext4", "-q", "-F", str(image)])
    assert made.returncode == 0, made.stderr
    out.mkdir()
    mount("-o", "loop,errors=remount-ro", str(image), str(out))
    try:
        device = Path(run_command(["findmnt", "-n", "-o", "SOURCE", str(out)]).stdout.strip())
        trigger = Path("/sys/fs/ext4") / device.name / "trigger_fs_error"
        if not trigger.exists():
            unavailable(f"{trigger} is missing: this kernel cannot make an ext4 volume fail on request")
        yield out, trigger
    finally:
        unmount(out)


def test_a_volume_turning_read_only_mid_run_is_one_line_exit_2(tmp_path, tiny_bert, sst2_dir):
    job = None
    with failing_ext4(tmp_path) as (out, trigger):
        try:
            stream = tmp_path / "job.txt"
            job = start_main(base_env(tmp_path, **long_run(tiny_bert, sst2_dir, out)), log=stream)
            wait_for_complete_checkpoint(out, [job])
            before = complete_steps(out)
            trigger.write_text("test: the volume fails\n")  # ext4 logs an error and remounts itself read-only
            assert job.wait(timeout=120) == 2, stream.read_text()[-3000:]
            text = stream.read_text()
            assert_refusal(text, [f"OUTPUT_DIR={out}", "read-only", "read-write"])
            # The lock could not be removed on the way out: a warning, never a traceback over the real error.
            assert "could not remove" in text and (out / ".job.lock").exists()
            assert_intact(out, before)
        finally:
            if job is not None and job.poll() is None:
                job.kill()
                job.wait()


@pytest.mark.check
def test_an_io_error_on_a_failed_volume_is_told_read_only_whatever_statvfs_says(tmp_path):
    """The write in flight when ext4 fails gets EIO; since Linux 6.9 statvfs does not say read-only: what the volume
    refuses decides."""
    with failing_ext4(tmp_path) as (out, trigger):
        # Healthy, the volume takes new files: an EIO alone is not a volume state.
        assert volume_state(OSError(errno.EIO, "Input/output error"), out) is None
        trigger.write_text("test: the volume fails\n")
        assert volume_state(OSError(errno.EIO, "Input/output error"), out) == "read-only"
        assert volume_state(RuntimeError("file write failed"), out) == "read-only"  # torch.save hides the errno
        assert sorted(path.name for path in out.iterdir()) == ["lost+found"]  # the probe left nothing


def test_a_full_cache_volume_costs_only_the_cache(tmp_path, job_env):
    """The tokenized cache is derived data: a full volume under cache/ is one warning, and the run finishes."""
    out = Path(job_env["OUTPUT_DIR"])
    cache = out / "cache"
    cache.mkdir(parents=True)
    mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(cache))
    try:
        result = run_main(job_settings(job_env))  # a few steps: the cache is written before the first
        assert result.code == 0, result.stderr[-3000:]
        assert error_lines(result.stderr) == [] and "Traceback" not in result.stderr
        warnings = [line for line in result.stderr.splitlines() if "could not write the tokenized cache" in line]
        assert len(warnings) == 1 and "No space left on device" in warnings[0], result.stderr[-3000:]
        assert (out / "metrics.json").is_file() and (out / "model" / "adapter_config.json").is_file()
        assert not list(cache.glob("tokenized-*"))  # nothing half-written left behind
    finally:
        unmount(cache)
