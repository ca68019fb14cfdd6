"""The published model as a user of the Hub repo meets it, from the suite's one finished run (`finished_run`: its
first pushes refused, sent again by --push-only): what was pushed, the card, the labels, merged weights, predict.py."""

from __future__ import annotations

import ast
import csv
import io
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.env import BASE_ID, LABELS, MERGED_ID, REPO, REPO_ID, base_env, push_settings
from tests.support.hub_stub import HubStub
from tests.support.outcomes import assert_refusal, assert_token_absent, error_lines, rank_record, succeeded
from tests.support.processes import Result, run_command, run_main, run_predict

SENTENCES = ["a wonderful , moving film", "a dull and tedious mess", "the cast is superb"]


def commit(hub: HubStub, repo: str) -> dict[str, bytes]:
    [files] = [c["files"] for c in hub.commits if c["repo"] == repo]
    return files


def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---")[1])


def test_push_sends_the_whole_artifact_in_one_commit_and_a_retry_sends_the_same(finished_run):
    tmp, out, hub = finished_run.tmp, finished_run.out, finished_run.hub
    # The refused pushes ended the run in exit 3 and committed nothing; --push-only then sent one commit a repo.
    assert finished_run.first.code == 3 and "--push-only" in error_lines(finished_run.first.stderr)[0]
    assert sorted(c["repo"] for c in hub.commits) == sorted([REPO_ID, MERGED_ID])
    assert hub.created[0].get("visibility") == "private" or hub.created[0].get("private") is True  # HUB_PRIVATE
    assert json.loads((out / "run.json").read_text())["pushed"]["repo_id"] == REPO_ID
    files = commit(hub, REPO_ID)
    run_name = json.loads((out / "run.json").read_text())["run_name"]
    sent = "adapter_model.safetensors adapter_config.json tokenizer.json tokenizer_config.json README.md"
    assert {*sent.split(), "training_curves.png", "id2label.json", "metrics.json", "run.json"} <= set(files)
    events = [path for path in files if path.startswith(f"runs/{run_name}/") and "tfevents" in path]
    assert events, sorted(files)  # what the Hub's training-metrics tab reads
    assert files["training_curves.png"].startswith(b"\x89PNG")
    assert json.loads(files["metrics.json"]) == json.loads((out / "metrics.json").read_text())
    assert json.loads(files["run.json"])["settings"]["hf_token"] == "***"
    # The set the refused first push would have sent is the set --push-only sent: the volume's files.
    on_volume = {str(p.relative_to(out / "model")) for p in (out / "model").iterdir()}
    assert set(files) == on_volume | {"metrics.json", "run.json", *events}
    # Outputs, checkpoints, logs, HF_HOME and both runs' captured stdout and stderr, and every pushed file.
    assert_token_absent(hub.token, [tmp], hub)


def test_the_adapter_names_its_base_by_hub_id_not_by_the_volume_path(finished_run):
    hub = finished_run.hub
    config = json.loads(commit(hub, REPO_ID)["adapter_config.json"])
    assert config["base_model_name_or_path"] == BASE_ID  # loads where the training folder never existed
    assert front_matter(commit(hub, REPO_ID)["README.md"].decode())["base_model"] == BASE_ID


def test_card_is_validated_names_the_repo_and_holds_every_metric(finished_run):
    out, hub = finished_run.out, finished_run.hub
    card = commit(hub, REPO_ID)["README.md"].decode()
    assert card in hub.validated  # checked by the Hub's YAML route before the commit
    meta = front_matter(card)
    [result] = meta["model-index"][0]["results"]
    metrics = json.loads((out / "metrics.json").read_text())
    names = ("accuracy", "f1", "precision", "recall", "matthews_correlation")
    assert {m["type"]: m["value"] for m in result["metrics"]} == {
        name: round(metrics[f"eval_{name}"], 4) for name in names
    }
    # local data is not passed off as GLUE from the Hub
    assert result["dataset"]["type"] == "local" and "datasets" not in meta
    assert f'model="{REPO_ID}"' in card and "path/to" not in card  # refreshed at push time with the real repo id
    assert "![Training loss and validation accuracy](training_curves.png)" in card
    data = metrics["data"]
    assert f"local data ({data['train_rows']} training and {data['validation_rows']} validation rows" in card
    # What actually ran, not `auto`.
    assert "| precision | fp32 |" in card and "| quantization | none |" in card and "| learning rate | 0.003 |" in card
    assert "| global batch | 16 rows a step (" in card and "| world size (replicas) | 1 |" in card
    recipe = "warm-up 0.06 of the steps, LoRA+ (B at x8 the rate), pooler trained with the classifier"
    assert f"| recipe | {recipe}, base-model dropout 0 |" in card
    # Each table renders as one: no blank line between its header and its last row.
    for header, last in (
        ("| metric (validation split", "| matthews_correlation |"),
        ("| setting | value |", "| run name |"),
    ):
        block = card[card.index(header) :]
        assert last in block.split("\n\n")[0], f"the table starting {header!r} is cut before {last!r}"


def test_metrics_and_evaluation_during_training_reach_metrics_json_and_tensorboard(finished_run):
    out = finished_run.out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = json.loads((out / "metrics.json").read_text())
    assert {"eval_accuracy", "eval_f1", "eval_precision", "eval_recall", "eval_samples", "world_size"} <= set(metrics)
    run_name = json.loads((out / "run.json").read_text())["run_name"]
    events = EventAccumulator(str(out / "tensorboard" / run_name)).Reload()
    steps = [event.step for event in events.Scalars("eval/accuracy")]
    # 125 steps an epoch: evaluated every 31 steps during 2 epochs (EVAL_STEPS unset), then once more at the end.
    assert steps[:8] == [31 * n for n in range(1, 9)] and steps[-1] == 250, steps
    assert {"eval/f1", "eval/precision", "eval/recall"} <= set(events.Tags()["scalars"])


def test_the_rank_log_holds_the_settings_each_logged_loss_the_evaluation_and_the_outcome(finished_run):
    out = finished_run.out
    log = (out / "logs" / "rank-0.log").read_text()
    record = json.loads((out / "run.json").read_text())
    [shown] = re.findall(r" utils\.run: the run's identity: (\{.*\})$", log, re.M)
    shown = ast.literal_eval(shown)
    assert shown == record["identity"] and {"base_model", "lora_r", "seed", "global_batch", "data"} <= set(shown)
    assert all(shown[name] == record["settings"][name] for name in ("lora_r", "seed"))
    logged = [
        (int(step), ast.literal_eval(v)) for step, v in re.findall(r" utils\.run: step (\d+): (\{.*\})$", log, re.M)
    ]
    last = max(out.glob("checkpoints/checkpoint-*"), key=lambda path: int(path.name.rsplit("-", 1)[1]))
    history = json.loads((last / "trainer_state.json").read_text())["log_history"]
    losses = [(entry["step"], entry["loss"], entry["learning_rate"]) for entry in history if "loss" in entry]
    assert len(losses) > 2 and [(s, v["loss"], v["learning_rate"]) for s, v in logged if "loss" in v] == losses
    evaluations = [values for _, values in logged if "eval_accuracy" in values]
    assert len(evaluations) == len(history) - len(losses) + 1  # the evaluations during training, and the final one
    metrics = json.loads((out / "metrics.json").read_text())
    assert [evaluations[-1][key] for key in ("eval_accuracy", "eval_loss")] == [
        metrics["eval_accuracy"],
        metrics["eval_loss"],
    ]
    # No library's INFO records (transformers' config and weights dumps, datasets' builder steps) but the Trainer's.
    sources = {name for name in re.findall(r"^\S+ \S+ rank0 (?:INFO|DEBUG) (\S+):", log, re.M)}
    assert {name for name in sources if not name.startswith("utils.")} == {"transformers.trainer"}, sources
    # On the console, one line per evaluation and none per logged loss (those are the rank log's).
    console = finished_run.first
    assert "'loss': " not in console.stdout + console.stderr and not re.search(
        r"utils\.run: step \d+:", console.stderr
    )
    evaluated = re.findall(r"utils\.run: step \d+/\d+ \(epoch [\d.]+\): eval_accuracy=", console.stderr)
    assert len(evaluated) == len(evaluations)
    # The outcome: the exit code the first start ended with (the Hub refused the push) and where the model is.
    [outcome] = [line for line in log.splitlines() if rank_record(out, 0)["trainable_checksum"] in line]
    assert f"exit {finished_run.first.code}" in outcome and str(out / "model") in outcome


def test_merged_model_loads_without_peft_and_predicts_as_the_adapter(finished_run, tiny_bert, tmp_path):
    out, hub = finished_run.out, finished_run.hub
    merged = commit(hub, MERGED_ID)
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", "metrics.json"} <= set(merged)
    assert front_matter(merged["README.md"].decode())["library_name"] == "transformers"
    config = json.loads((out / "merged" / "config.json").read_text())
    assert config["id2label"] == {"0": "bad", "1": "good"} and "quantization_config" not in config
    # Plain transformers in a process that cannot import peft.
    script = (
        "import sys; sys.modules['peft'] = None\n"
        "import torch; from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        f"m = AutoModelForSequenceClassification.from_pretrained({str(out / 'merged')!r}).eval()\n"
        f"t = AutoTokenizer.from_pretrained({str(out / 'merged')!r})\n"
        f"print(m(**t({SENTENCES!r}, return_tensors='pt', padding=True)).logits.softmax(-1)[:, 1].tolist())"
    )
    plain = run_command([sys.executable, "-c", script], env=base_env(tmp_path), timeout=120)
    assert plain.returncode == 0, plain.stderr[-2000:]
    merged_scores = json.loads(plain.stdout.strip().splitlines()[-1])
    adapter = [
        json.loads(line)
        for line in predict(tmp_path, out / "model", "--base-model", str(tiny_bert)).stdout.splitlines()
    ]
    adapter_scores = [p["score"] if p["label"] == "good" else 1 - p["score"] for p in adapter]
    assert merged_scores == pytest.approx(adapter_scores, abs=1e-3)


def predict(tmp: Path, model: Path | str, *args: str, stdin: str = "\n".join(SENTENCES), **env: str) -> Result:
    return run_predict(base_env(tmp, **env), model, *args, stdin=stdin, cwd=tmp)


def test_predict_prints_labels_by_name_for_adapter_and_merged_folders(finished_run, tmp_path, tiny_bert):
    out = finished_run.out
    answers = {}
    # the adapter's base is a Hub id the test cannot reach: the local folder stands in for it
    for folder, args in (("model", ["--base-model", str(tiny_bert)]), ("merged", [])):
        result = predict(tmp_path, out / folder, *args)
        assert result.code == 0, result.stderr[-2000:]
        answers[folder] = [json.loads(line) for line in result.stdout.splitlines()]
        assert [a["text"] for a in answers[folder]] == SENTENCES
        # The run scores over 0.8 on sentences of these words: each is told right, by the run's LABEL_NAMES.
        assert [a["label"] for a in answers[folder]] == ["good", "bad", "good"], answers[folder]
        assert all(0.5 <= a["score"] <= 1 for a in answers[folder])
    assert [a["label"] for a in answers["model"]] == [a["label"] for a in answers["merged"]]
    # A column of a csv file, and the adapter's base named explicitly.
    table = tmp_path / "reviews.csv"
    table.write_text('id,review\n1,a wonderful film\n2,"a dull, tedious mess"\n')
    result = predict(tmp_path, out / "model", str(table), "--text-column", "review", "--base-model", str(tiny_bert))
    assert result.code == 0, result.stderr[-2000:]
    assert [json.loads(line)["text"] for line in result.stdout.splitlines()] == [
        "a wonderful film",
        "a dull, tedious mess",
    ]


def test_the_pushed_repos_load_on_a_machine_that_never_saw_the_volume(finished_run, hub, tmp_path, tiny_bert):
    """The adapter (its base from the base's repo) and the merged model from a Hub serving exactly what was pushed,
    with an empty cache: AutoPeftModel as the card says, and predict.py with the labels by name."""
    out = finished_run.out
    hub.serve(BASE_ID, tiny_bert)
    for repo in (REPO_ID, MERGED_ID):
        hub.served[repo] = commit(finished_run.hub, repo)
    elsewhere = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "empty-cache")}
    script = (
        "from peft import AutoPeftModelForSequenceClassification\n"
        f"m = AutoPeftModelForSequenceClassification.from_pretrained({REPO_ID!r})\n"
        "print(m.peft_config['default'].base_model_name_or_path)"
    )
    loaded = run_command(
        [sys.executable, "-c", script], env=base_env(tmp_path, **elsewhere), cwd=tmp_path, timeout=180
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip().splitlines()[-1] == BASE_ID
    local = [json.loads(line) for line in predict(tmp_path, out / "merged").stdout.splitlines()]
    for repo in (REPO_ID, MERGED_ID):
        result = predict(tmp_path, repo, **elsewhere)
        assert result.code == 0, result.stderr[-2000:]
        answers = [json.loads(line) for line in result.stdout.splitlines()]
        assert [a["label"] for a in answers] == [a["label"] for a in local]
        assert {a["label"] for a in answers} <= set(LABELS)
        assert [a["score"] for a in answers] == pytest.approx([a["score"] for a in local], abs=1e-3)
    assert hub.count(f"/{BASE_ID}/resolve/") > 0  # the base really came from its Hub repo


@pytest.mark.parametrize(
    "args, names",
    [
        (["/nonexistent/model"], ["/nonexistent/model"]),
        (["MODEL", "/nonexistent/file.txt"], ["/nonexistent/file.txt"]),
        (["MODEL", "TABLE", "--text-column", "text"], ["t.csv", "'text'", "['sentence']", "--text-column"]),
        ([], ["model"]),
    ],
)
def test_predict_bad_input_is_one_error_line_and_exit_2(finished_run, tmp_path, args, names):
    out = finished_run.out
    table = tmp_path / "t.csv"
    table.write_text("sentence\nfine\n")
    args = [str(out / "model") if a == "MODEL" else str(table) if a == "TABLE" else a for a in args]
    result = run_predict(base_env(tmp_path), *args, cwd=tmp_path)
    assert result.stdout == ""
    assert_refusal(result, names)


def test_a_push_from_a_folder_that_records_no_hub_id_is_refused_before_training(job_env, hub, tmp_path, tiny_bert):
    env = {**job_env, **push_settings(hub)}
    env.pop("BASE_MODEL_ID")
    for args in (["--dry-run"], []):
        result = run_main(env, *args)
        assert_refusal(result, [f"MODEL_NAME={tiny_bert}", REPO_ID, "BASE_MODEL_ID"])
    assert hub.count("/api/whoami-v2") == 0 and not (tmp_path / "out" / "checkpoints").exists()
    # A Hub cache snapshot records its id in its path: no BASE_MODEL_ID needed.
    snapshot = tmp_path / "hub" / "models--tester--tiny-bert" / "snapshots" / "0123abcd"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(tiny_bert, target_is_directory=True)
    assert run_main({**env, "MODEL_NAME": str(snapshot)}, "--dry-run").code == 0


def test_labels_and_trackers_are_checked_as_settings(job_env):
    same = run_main({**job_env, "LABEL_NAMES": "ok,ok"}, "--dry-run")
    assert_refusal(same, ["LABEL_NAMES=ok,ok", "'ok'"])
    both = run_main({**job_env, "REPORT_TO": "none,mlflow"}, "--dry-run")
    assert_refusal(both, ["REPORT_TO=none,mlflow"])
    merged_push = run_main({**job_env, "RESULT_MERGED_MODEL_ID": MERGED_ID}, "--dry-run")
    assert_refusal(merged_push, [f"RESULT_MERGED_MODEL_ID={MERGED_ID}", "MERGE_ADAPTER=true"])
    dry = run_main({**job_env, "REPORT_TO": "tensorboard, mlflow", "LABEL_NAMES": "bad,good"}, "--dry-run").json()
    dry = dry["config"]
    assert dry["report_to"] == ["tensorboard", "mlflow"] and dry["label_names"] == ["bad", "good"]
    assert re.fullmatch(r"[a-z0-9-]+-lora-r8-[0-9a-f]{8}", dry["run_name"])


# ------------------------------------------------------------------------------- a finished run publishes its own records
AGAIN_ID, MERGED_AGAIN_ID = "tester/sst2-lora-again", "tester/sst2-merged-again"


def test_a_finished_run_publishes_the_label_names_it_was_trained_with(finished_run, hub, tmp_path):
    """LABEL_NAMES against a finished run's trained mapping are refused (--dry-run, a restart, --push-only); without
    them merged/, the card and the push carry the recorded ones."""
    out = tmp_path / "out"
    shutil.copytree(finished_run.out, out, symlinks=True)
    shutil.rmtree(out / "merged")  # as a run stopped before the merge: the restart writes it
    env = {**finished_run.env, **push_settings(hub), "OUTPUT_DIR": str(out)}
    env |= {"RESULT_MODEL_ID": AGAIN_ID, "RESULT_MERGED_MODEL_ID": MERGED_AGAIN_ID}
    flipped = ",".join(reversed(LABELS))
    for args in (["--dry-run"], [], ["--push-only"]):
        result = run_main(env, *args, "--merge-adapter", "true", "--label-names", flipped)
        # Where, and the label mapping the run was trained with against the one asked for (the run's identity).
        names = [f"OUTPUT_DIR={out}", f"LABEL_NAMES: {','.join(LABELS)} -> {flipped}"]
        assert_refusal(result, names)
    assert not (out / "merged").exists() and hub.commits == []

    env.pop("LABEL_NAMES")  # the default names now: the recorded ones are published
    succeeded(run_main(env, "--push-only"))
    recorded = {"0": LABELS[0], "1": LABELS[1]}
    assert json.loads((out / "merged" / "config.json").read_text())["id2label"] == recorded
    adapter = commit(hub, AGAIN_ID)
    assert json.loads(adapter["id2label.json"]) == recorded
    snippet = f""""id2label": {{0: '{LABELS[0]}', 1: '{LABELS[1]}'}}"""
    assert snippet in adapter["README.md"].decode()  # the usage snippet
    assert json.loads(commit(hub, MERGED_AGAIN_ID)["config.json"])["id2label"] == recorded


@pytest.fixture
def unpushed_run(job_env, tmp_path, sst2_dir, tiny_bert) -> dict[str, str]:
    """The environment of a short air-gapped run (no push, no BASE_MODEL_ID, MODEL_NAME relative) on its own data."""
    data = shutil.copytree(sst2_dir, tmp_path / "data")
    env = {**job_env, "DATASET_PATH": str(data), "MAX_STEPS": "2", "MODEL_NAME": os.path.relpath(tiny_bert, REPO)}
    env.pop("NUM_EPOCHS")
    succeeded(run_main(env))
    return env


def test_push_only_with_base_model_id_pushes_an_adapter_that_names_the_base_the_card_names(
    unpushed_run, hub, tmp_path, tiny_bert
):
    """The adapter on the volume names its local base folder; --push-only and a pushing restart send one naming
    BASE_MODEL_ID, the base the card names, so it loads off the cluster."""
    out = tmp_path / "out"
    on_volume = json.loads((out / "model" / "adapter_config.json").read_text())
    assert on_volume["base_model_name_or_path"] == str(tiny_bert)  # the relative MODEL_NAME, made absolute
    # So predict.py finds the base from any folder, with no --base-model.
    answers = run_predict(base_env(tmp_path), out / "model", stdin="\n".join(SENTENCES), cwd=tmp_path)
    assert answers.code == 0 and len(answers.stdout.splitlines()) == len(SENTENCES), answers.stderr[-3000:]
    for args, repo in ((["--push-only"], REPO_ID), ([], AGAIN_ID)):
        succeeded(run_main({**unpushed_run, **push_settings(hub), "RESULT_MODEL_ID": repo}, *args))
        files = commit(hub, repo)
        assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == BASE_ID
        assert front_matter(files["README.md"].decode())["base_model"] == BASE_ID
        assert json.loads(files["adapter_config.json"]) == {**on_volume, "base_model_name_or_path": BASE_ID}
    assert json.loads((out / "model" / "adapter_config.json").read_text()) == on_volume  # the cluster's copy kept
    # A base the adapter records by Hub id is the truth: another BASE_MODEL_ID is refused, not pushed over it.
    recorded = tmp_path / "recorded"
    shutil.copytree(out, recorded, symlinks=True)
    config = recorded / "model" / "adapter_config.json"
    config.write_text(json.dumps({**on_volume, "base_model_name_or_path": BASE_ID}))
    other_base = {"OUTPUT_DIR": str(recorded), "BASE_MODEL_ID": "tester/other-bert"}
    other = run_main({**unpushed_run, **push_settings(hub), **other_base}, "--push-only")
    assert_refusal(other, ["BASE_MODEL_ID=tester/other-bert", f"OUTPUT_DIR={recorded}", BASE_ID])
    assert len(hub.commits) == 2


def test_a_finished_run_is_finished_only_for_the_data_it_was_trained_on(unpushed_run, hub, tmp_path):
    """Labels changed in the training file since the run finished: a rerun is refused with the fix, not 'already
    holds a finished run'; --push-only still publishes what the volume holds."""
    train = Path(unpushed_run["DATASET_PATH"]) / "train.csv"
    original = train.read_bytes()
    rows = list(csv.reader(io.StringIO(original.decode())))
    rows[1][rows[0].index("label")] = str(1 - int(rows[1][rows[0].index("label")]))  # one row's label flipped
    with train.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    for args in (["--dry-run"], []):
        result = run_main(unpushed_run, *args)
        names = [
            f"OUTPUT_DIR={unpushed_run['OUTPUT_DIR']}",
            "data files: train.csv",
            "restore the data it was trained on",
        ]
        assert_refusal(result, names)
    succeeded(run_main({**unpushed_run, **push_settings(hub)}, "--push-only"))
    train.write_bytes(original)  # restored as it was
    again = run_main(unpushed_run)
    assert again.code == 0 and "already holds a finished run" in again.stderr


def test_every_file_and_folder_the_job_writes_follows_the_umask(job_env, tmp_path):
    """The volume is shared: under umask 027 every file the job leaves is 0640 and every folder 0750, the weights
    too (safetensors writes 0600 whatever the umask)."""
    env = {**job_env, "MAX_STEPS": "2", "SAVE_STEPS": "1", "MERGE_ADAPTER": "true", "EVAL_STEPS": "1"}
    env.pop("NUM_EPOCHS", None)
    command = f"umask 027 && exec {shlex.quote(sys.executable)} {shlex.quote(str(REPO / 'main.py'))}"
    result = run_command(["bash", "-c", command], env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = Path(env["OUTPUT_DIR"])
    written = [out, *out.rglob("*")]
    assert {"model.safetensors", "adapter_model.safetensors"} <= {path.name for path in written}
    assert any(path.parent.name.startswith("checkpoint-") and path.suffix == ".safetensors" for path in written)
    modes = {path: path.stat().st_mode & 0o777 for path in written if not path.is_symlink()}
    wrong = {
        str(p.relative_to(out)): oct(mode) for p, mode in modes.items() if mode != (0o750 if p.is_dir() else 0o640)
    }
    assert not wrong, f"not as umask 027 gives them: {wrong}"
