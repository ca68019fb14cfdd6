"""What the job writes and publishes is only what it created itself, inside OUTPUT_DIR.

A neighbour on the shared volume runs `main.py --dry-run` to learn the run name, then plants links in the
run folder: a symbolic link in tensorboard/RUN/ to a folder holding a token or to an SSH key, a link at
logs/rank-0.log or at logs/, a hard link at metrics.json or run.json to a file elsewhere. Each test runs
the real job (tiny model, local Hub stand-in) and checks that nothing was written through the link, that
nothing planted reached the Hub, and the exit code and `error:` line the job ends with.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.support.env import REPO_ID, job_settings, push_settings
from tests.support.outcomes import assert_refusal, assert_refused_as_bad_input, log_time
from tests.support.processes import run_main, start_main, wait_all, wait_until
from utils.run_folder.record import RUN_MARKER, RUN_RECORD_FORMAT

STOLEN_TOKEN = "hf_" + "s" * 34  # another user's token, kept beside the run folder
SSH_KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n-----END OPENSSH PRIVATE KEY-----\n"


@pytest.fixture
def secrets(tmp_path) -> dict[str, Path]:
    """Files outside OUTPUT_DIR a neighbour would like published: a folder with a token, an SSH key."""
    folder = tmp_path / "neighbour" / ".cache" / "huggingface"
    folder.mkdir(parents=True)
    (folder / "token").write_text(STOLEN_TOKEN)
    key = tmp_path / "neighbour" / ".ssh" / "id_ed25519"
    key.parent.mkdir()
    key.write_text(SSH_KEY)
    return {"token_folder": folder, "token": folder / "token", "key": key}


def run_folder(out: Path) -> Path:
    """OUTPUT_DIR as a start of the job killed before its first record leaves it (its marker): the neighbour
    plants into a folder of the job's, not one of its own (which the job refuses as not a run folder)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_MARKER).write_text("")
    return out


def run_name(env: dict[str, str]) -> str:
    """The run name as anyone with the settings learns it."""
    dry = run_main(env, "--dry-run")
    assert dry.code == 0, dry.stderr
    return dry.json()["config"]["run_name"]


def pushed_files(hub) -> dict[str, bytes]:
    return {name: data for commit in hub.commits for name, data in commit["files"].items()}


def assert_nothing_stolen(hub, secrets: dict[str, Path]) -> None:
    assert secrets["token"].read_text() == STOLEN_TOKEN and secrets["key"].read_text() == SSH_KEY
    for name, data in pushed_files(hub).items():
        assert STOLEN_TOKEN.encode() not in data and b"OPENSSH PRIVATE KEY" not in data, name


@pytest.mark.parametrize(
    "planted, target",
    [("cache-link", "token_folder"), ("id_ed25519", "key")],
    ids=["folder-with-a-token", "ssh-key"],
)
def test_a_link_planted_in_the_tensorboard_folder_before_the_run_is_refused(
    planted, target, job_env, hub, secrets, tmp_path
):
    env = {**job_env, **push_settings(hub)}
    link = run_folder(tmp_path / "out") / "tensorboard" / run_name(env) / planted
    link.parent.mkdir(parents=True)
    link.symlink_to(secrets[target])
    assert_refused_as_bad_input(env, [], names=[str(link), "symbolic link"], hub=hub)
    assert_nothing_stolen(hub, secrets)
    assert link.is_symlink()  # refused, not removed: the owner of the folder decides


def test_links_planted_in_the_tensorboard_folder_during_the_run_are_never_pushed(job_env, hub, secrets, tmp_path):
    env = job_settings(job_env, **push_settings(hub), MAX_STEPS="20")
    events = tmp_path / "out" / "tensorboard" / run_name(env)
    job = start_main(env, log=tmp_path / "job.txt")
    # The writer exists: training has begun.
    wait_until(
        lambda: any(events.glob("events.out.tfevents.*")), "TensorBoard event file", [job], 240, tmp_path / "job.txt"
    )
    (events / "cache-link").symlink_to(secrets["token_folder"])
    (events / "id_ed25519").symlink_to(secrets["key"])
    (events / "hf_token").symlink_to(secrets["token"])
    planted = time.time()
    assert wait_all([job], [tmp_path / "job.txt"]) == [0]
    assert log_time(tmp_path / "out" / "logs" / "rank-0.log", "pushing ") > planted  # the links were there to find
    [commit] = hub.commits
    assert commit["repo"] == REPO_ID
    runs = sorted(name for name in commit["files"] if name.startswith("runs/"))
    # The event files of the job's own writers (one for training, one for the final evaluation), nothing else.
    assert len(runs) == 2 and all(Path(name).name.startswith("events.out.tfevents.") for name in runs), runs
    assert "adapter_model.safetensors" in commit["files"] and "metrics.json" in commit["files"]
    assert_nothing_stolen(hub, secrets)


@pytest.mark.parametrize("planted", ["logs/rank-0.log", "logs"])
def test_a_linked_rank_log_or_logs_folder_is_not_written_through(planted, job_env, hub, tmp_path):
    outside = tmp_path / "neighbour" / "notes"  # a file for the rank log, a folder for logs/
    outside.parent.mkdir()
    outside.mkdir() if planted == "logs" else outside.write_text("my notes\n")
    link = run_folder(tmp_path / "out") / planted
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(outside)
    assert_refused_as_bad_input({**job_env, **push_settings(hub)}, [], names=[str(link), "symbolic link"], hub=hub)
    assert (list(outside.iterdir()) if planted == "logs" else outside.read_text()) in ([], "my notes\n")


@pytest.mark.parametrize("name", ["metrics.json", "run.json"])
def test_a_hard_linked_metrics_or_run_record_is_refused(name, job_env, hub, tmp_path):
    outside = tmp_path / "neighbour" / "settings.json"
    outside.parent.mkdir()
    outside.write_text('{"api_key": "not for the Hub"}\n')
    inside = run_folder(tmp_path / "out") / name
    os.link(outside, inside)
    for args in (["--dry-run"], []):
        assert_refusal(run_main({**job_env, **push_settings(hub)}, *args), [str(inside), "1 other hard link(s)"])
    assert outside.read_text() == '{"api_key": "not for the Hub"}\n' and os.stat(outside).st_nlink == 2
    assert hub.commits == [] and hub.count("/api/repos/create") == 0


def test_a_checkpoint_folder_linked_during_the_run_is_refused_at_the_save(job_env, hub, tmp_path):
    outside = tmp_path / "neighbour" / "somewhere"
    outside.mkdir(parents=True)
    out = tmp_path / "out"
    env = {**job_env, **push_settings(hub), "SAVE_STEPS": "5"}
    job = start_main(env, log=tmp_path / "job.txt")
    complete = out / "checkpoints" / "checkpoint-5" / "COMPLETE"
    wait_until(complete.exists, "complete checkpoint", [job], 240, tmp_path / "job.txt")
    link = out / "checkpoints" / "checkpoint-25"  # a name anyone can predict from SAVE_STEPS
    link.symlink_to(outside, target_is_directory=True)
    assert wait_all([job]) == [2], (tmp_path / "job.txt").read_text()[-3000:]
    assert_refusal((tmp_path / "job.txt").read_text(), [str(link), "symbolic link"])
    assert list(outside.iterdir()) == []
    assert hub.commits == []


@pytest.mark.check
def test_a_file_removed_while_the_folder_is_checked_is_not_an_error(tmp_path, monkeypatch):
    """Every rank checks OUTPUT_DIR for planted links while rank 0's write probe (logs/.write-test-PID) comes
    and goes: a name listed and gone before its lstat is nothing planted. (Seen in CI: rank 1 exited 1 with a
    FileNotFoundError traceback, and rank 0 waited out RENDEZVOUS_TIMEOUT for it.)"""
    from utils.common.errors import JobError
    from utils.run_folder.layout import RunDir

    run = RunDir(tmp_path / "out")
    run.logs.mkdir(parents=True)
    (run.logs / "rank-0.log").write_text("")
    listing = [(top, folders, [*files, ".write-test-12345"]) for top, folders, files in os.walk(run.root)]
    with monkeypatch.context() as patch:
        patch.setattr("utils.run_folder.layout.os.walk", lambda root: iter(listing))  # the probe, listed, then removed
        run.check_planted()
    os.symlink(tmp_path, run.logs / "planted")  # and a link that is there is still refused
    with pytest.raises(JobError, match="planted"):
        run.check_planted()


@pytest.mark.check
def test_no_nan_or_infinity_is_written_into_a_record(tmp_path):
    """A NaN metric (a Pearson correlation of constant predictions) is null in metrics.json: Python writes NaN, which
    no JSON reader takes."""
    from utils.run_folder.layout import RunDir

    run = RunDir(tmp_path)
    run.write_json(run.metrics, {"eval_pearson": float("nan"), "losses": [1.5, float("inf")], "eval_mse": 0.25})

    def refuse(name):
        raise ValueError(name)

    written = json.loads(run.metrics.read_text(), parse_constant=refuse)
    assert written == {"eval_pearson": None, "losses": [1.5, None], "eval_mse": 0.25}


# ------------------------------------------------------------------------------- a folder that is not a run of the job
def tree(out: Path) -> dict[str, str | None]:
    """Every entry under `out`: a file by the SHA-256 of its bytes, a folder as None, so that a file added,
    removed or rewritten (even a marker, a lock or an empty logs/) shows."""
    return {
        str(path.relative_to(out)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        for path in sorted(out.rglob("*"))
    }


# A run.json another tool writes, and one this job wrote before run.json had a format (the keys every version wrote).
ANOTHER_TOOLS_RECORD = json.dumps({"tool": "another-trainer", "settings": {"lr": 0.1}})
LEGACY_RECORD = json.dumps({"run_name": "tiny-r8", "settings": {"lora_r": 8}, "versions": {"torch": "2.13.0"}})
THEIRS = {"model/notes.txt": "their notes\n", "run.json": ANOTHER_TOOLS_RECORD}
FOLDERS = {  # id: what the folder holds beside a checkpoint with no COMPLETE manifest, what the refusal names
    # What it holds, and that a run folder of the job has a .run-folder or run.json: how to tell it apart.
    "no-run-json": ({"model/model.safetensors": "their weights"}, ["checkpoints, model", ".run-folder", "run.json"]),
    "unmarked": (THEIRS, ["run.json is not one the job writes", "empty or new folder"]),
    # the job's marker does not make another tool's record its own
    "marked": ({**THEIRS, RUN_MARKER: ""}, ["run.json is not one the job writes", "empty or new folder"]),
}


@pytest.mark.parametrize("holding", FOLDERS)
def test_a_folder_another_tool_filled_is_refused_and_left_byte_identical(holding, job_env, hub, tmp_path):
    """A run.json is the job's mark only when it is one the job writes: another tool's file of that name beside its
    checkpoint and notes (seen: exit 0, "removed checkpoint-500: its save never completed", model/notes.txt gone)."""
    files, names = FOLDERS[holding]
    out = tmp_path / "out"
    for name, text in {"checkpoints/checkpoint-500/optimizer.pt": "their optimizer state", **files}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = tree(out)
    for args in (["--dry-run"], [], ["--push-only"]):
        assert_refusal(run_main({**job_env, **push_settings(hub)}, *args), [f"OUTPUT_DIR={out}", *names])
        assert tree(out) == before, args
    assert hub.commits == [] and hub.count("/api/repos/create") == 0


def legacy_run(out: Path, layout: str) -> None:
    """Turn the unfinished run in `out` into what the job left before the run's identity existed: run.json with the
    settings (`layout` "training-settings": and the training settings apart) and no identity, plan or format,
    checkpoints marked without an identity, and no .run-folder (run.json alone marked such a folder)."""
    record = json.loads((out / "run.json").read_text())
    identity = record.pop("identity")
    del record["plan"], record["format"]
    derived = ("global_batch", "world_size", "data")
    if layout == "training-settings":
        record["training_settings"] = {name: value for name, value in identity.items() if name not in derived}
    (out / "run.json").write_text(json.dumps(record, indent=2))
    for marker in out.glob("checkpoints/checkpoint-*/COMPLETE"):
        manifest = json.loads(marker.read_text())
        del manifest["resume"]["identity"]
        marker.write_text(json.dumps(manifest))
    (out / RUN_MARKER).unlink()


@pytest.mark.parametrize("layout", ["training-settings", "settings-only"])
def test_a_run_from_before_the_identity_is_compared_by_what_its_run_json_recorded(layout, job_env, tmp_path):
    """A run folder from before the identity, restarted with another LORA_R (seen: "resuming from step 6", a size
    mismatch traceback, and run.json rewritten to the new settings, so that the old ones were refused from then on):
    refused on what its run.json recorded, nothing in the folder touched; its own settings resume it."""
    out = tmp_path / "out"
    env = job_settings(job_env, MAX_STEPS="4", SAVE_STEPS="2")
    first = run_main(env)
    assert first.code == 0, first.stderr[-3000:]
    shutil.rmtree(out / "model")  # stopped after its last checkpoint: not finished, a restart resumes
    (out / "metrics.json").unlink()
    legacy_run(out, layout)
    lora_r = json.loads((out / "run.json").read_text())["settings"]["lora_r"]
    before = tree(out)
    for args in (["--dry-run"], []):
        result = run_main({**env, "LORA_R": str(lora_r // 2)}, *args)
        assert_refusal(result, [f"OUTPUT_DIR={out}", f"LORA_R: {lora_r} -> {lora_r // 2}", "restore the old settings"])
        assert tree(out) == before, args
    resumed = run_main(env)
    assert resumed.code == 0, resumed.stderr[-3000:]
    assert "resuming from step 4" in (out / "logs" / "rank-0.log").read_text()
    record = json.loads((out / "run.json").read_text())
    assert record["format"] == RUN_RECORD_FORMAT and record["identity"]["lora_r"] == lora_r  # recorded as it is now


def test_a_checkpoint_of_another_run_is_refused_before_any_checkpoint_is_removed(job_env, tmp_path):
    """run.json deleted (as its damaged-record refusal suggests), and a start with another LORA_R: the newest complete
    checkpoint's identity refuses it before the checkpoints a kill cut short are removed, so nothing in checkpoints/
    changes."""
    out = tmp_path / "out"
    env = job_settings(job_env, MAX_STEPS="4", SAVE_STEPS="2")
    first = run_main(env)
    assert first.code == 0, first.stderr[-3000:]
    lora_r = json.loads((out / "run.json").read_text())["identity"]["lora_r"]
    shutil.rmtree(out / "model")
    for name in ("metrics.json", "run.json"):
        (out / name).unlink()
    (out / "checkpoints" / "checkpoint-5").mkdir()  # a save cut short
    (out / "checkpoints" / "checkpoint-5" / "optimizer.pt").write_bytes(b"half")
    before = tree(out / "checkpoints")
    result = run_main({**env, "LORA_R": str(lora_r // 2)})
    assert_refusal(result, [str(out / "checkpoints" / "checkpoint-4"), f"LORA_R: {lora_r} -> {lora_r // 2}"])
    assert tree(out / "checkpoints") == before and not (out / "run.json").exists()


def test_a_run_json_of_a_newer_version_of_the_job_is_refused(job_env, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"format": RUN_RECORD_FORMAT + 1, "identity": {"lora_r": 8}}))
    before = tree(out)
    for args in (["--dry-run"], []):
        assert_refusal(
            run_main(job_env, *args), [str(out / "run.json"), "newer version", f"format {RUN_RECORD_FORMAT + 1}"]
        )
    assert tree(out) == before


def test_links_in_a_folder_that_is_no_run_of_the_job_get_the_not_a_run_folder_refusal(job_env, hub, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / "data").symlink_to(tmp_path, target_is_directory=True)  # the user's own links, not planted ones
    names = [f"OUTPUT_DIR={out}", "data, notes.txt", ".run-folder"]  # not refused as a planted link
    result = assert_refused_as_bad_input({**job_env, **push_settings(hub)}, [], names=names, hub=hub)
    assert "symbolic link" not in result.stderr
    assert (out / "data").is_symlink() and sorted(p.name for p in out.iterdir()) == ["data", "notes.txt"]


@pytest.mark.check
def test_what_counts_as_a_run_folder_of_the_job(tmp_path):
    """New, empty (but for a file system's lost+found), marked by the job, holding run.json, or the empty
    skeleton of a start killed before its marker existed: a run folder. Anything else is someone else's."""
    from utils.run_folder.layout import RunDir
    from utils.run_folder.record import is_run_folder

    def folder(name: str, files: dict[str, str] | None = None, folders: tuple[str, ...] = ()) -> RunDir:
        root = tmp_path / name
        root.mkdir()
        for sub in folders:
            (root / sub).mkdir(parents=True)
        for path, text in (files or {}).items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        return RunDir(root)

    ours = [
        RunDir(tmp_path / "new"),
        folder("empty", folders=("lost+found",)),
        folder("marked", {RUN_MARKER: "", "checkpoints/checkpoint-5/model.safetensors": "x"}),
        folder("recorded", {"run.json": json.dumps({"format": RUN_RECORD_FORMAT}), "model/README.md": "x"}),
        folder("recorded-before-the-format", {"run.json": LEGACY_RECORD, "model/README.md": "x"}),
        folder("killed-early", {".job.lock": "{}"}, folders=("logs", "checkpoints", "cache")),
    ]
    theirs = [
        folder("another-tools-record", {"run.json": ANOTHER_TOOLS_RECORD, "checkpoints/checkpoint-500/x": "x"}),
        folder("another-tools-record-marked", {RUN_MARKER: "", "run.json": ANOTHER_TOOLS_RECORD}),
        folder("empty-record", {"run.json": "{}", "model/README.md": "x"}),
        folder("format-as-text", {"run.json": json.dumps({"format": str(RUN_RECORD_FORMAT)})}),
        folder("notes", {"notes.txt": "x"}),
        folder("their-checkpoint", {"checkpoints/checkpoint-500/optimizer.pt": "x"}),
        folder("their-logs", {"logs/train.log": "x"}, folders=("cache",)),
        folder("their-model", {"model/model.safetensors": "x"}),
    ]
    (tmp_path / "hard-linked-record").mkdir()
    (tmp_path / "elsewhere.json").write_text(json.dumps({"format": RUN_RECORD_FORMAT}))  # a job's record, elsewhere
    os.link(tmp_path / "elsewhere.json", tmp_path / "hard-linked-record" / "run.json")
    theirs.append(RunDir(tmp_path / "hard-linked-record"))
    (tmp_path / "link-marker").mkdir()
    (tmp_path / "link-marker" / RUN_MARKER).symlink_to(tmp_path / "marked" / RUN_MARKER)
    (tmp_path / "link-marker" / "x").write_text("x")
    theirs.append(RunDir(tmp_path / "link-marker"))
    assert [run.root.name for run in ours if not is_run_folder(run)] == []
    assert [run.root.name for run in theirs if is_run_folder(run)] == []


def replace_weights_in_place(model: Path) -> None:
    """The base's weights file rewritten with other values of the same names, shapes and dtypes."""
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    save_file(
        {name: tensor + 1 if tensor.is_floating_point() else tensor for name, tensor in weights.items()},
        model / "model.safetensors",
        metadata={"format": "pt"},
    )


def test_a_checkpoint_is_never_resumed_merged_or_published_over_another_base_or_label_mapping(job_env, tmp_path):
    """Through main.py: a finished run whose base weights were replaced in place (same shapes) is not merged
    (MERGE_ADAPTER=true) and a stopped one not resumed on them, nor with the label ids swapped; the same base by
    another spelling resumes it. Nothing in the folder is touched by a refusal."""
    model = tmp_path / "model"
    shutil.copytree(job_env["MODEL_NAME"], model)
    original = (model / "model.safetensors").read_bytes()
    out = tmp_path / "out"
    env = job_settings(job_env, MODEL_NAME=str(model), MAX_STEPS="4", SAVE_STEPS="2", LABEL_NAMES="negative,positive")
    first = run_main(env)
    assert first.code == 0, first.stderr[-3000:]

    replace_weights_in_place(model)
    before = tree(out)
    merged = run_main({**env, "MERGE_ADAPTER": "true"})
    assert_refusal(merged, [f"OUTPUT_DIR={out}", "base model: model.safetensors", "restore the base model"])
    assert tree(out) == before and not (out / "merged").exists()

    shutil.rmtree(out / "model")  # stopped after its last checkpoint: not finished, a restart resumes
    (out / "metrics.json").unlink()
    before = tree(out)
    resumed_on_another_base = run_main(env)
    assert_refusal(resumed_on_another_base, [f"OUTPUT_DIR={out}", "base model: model.safetensors"])
    (model / "model.safetensors").write_bytes(original)
    swapped = run_main({**env, "LABEL_NAMES": "positive,negative"})
    assert_refusal(swapped, [f"OUTPUT_DIR={out}", "LABEL_NAMES: negative,positive -> positive,negative"])
    assert tree(out) == before

    respelled = run_main({**env, "MODEL_NAME": f"{os.path.relpath(model)}/"})
    assert respelled.code == 0, respelled.stderr[-3000:]
    assert "resuming from step 4" in (out / "logs" / "rank-0.log").read_text()
