"""What a run left behind, read and checked: its `error:` lines, each rank's logs/rank-R.json, run.json's plan, the
checkpoints, and the places a token must not be."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from tests.support.hub_stub import HubStub
from tests.support.processes import Result, run_main
from utils.common.errors import EXIT_BAD_INPUT


def rank_record(out: Path, rank: int) -> dict:
    """What rank `rank` of the run in `out` wrote at its end (OUTPUT_DIR/logs/rank-R.json): rank, local_rank,
    node_rank, world_size, source, samples_trained, trainable_checksum, first_step, seconds_to_first_step,
    trained_with."""
    path = out / "logs" / f"rank-{rank}.json"
    assert path.is_file(), f"{path} is missing: rank {rank} did not finish a run in {out}"
    return json.loads(path.read_text())


def trained_plan(out: Path, ranks=(0,)) -> dict:
    """run.json's plan, once every rank in `ranks` is seen to have trained with it: the batch split, the steps, the
    warm-up, each optimizer group's rate and the precision each Trainer read back at the end of training
    (logs/rank-R.json's `trained_with`)."""
    plan = json.loads((out / "run.json").read_text())["plan"]
    planned = {key: plan["batch"][key] for key in ("micro_batch", "accumulation")}
    planned |= {key: plan[key] for key in ("steps", "warmup_steps", "precision")}
    planned["rates"] = sorted(set(plan["rates"].values()))
    for rank in ranks:
        assert rank_record(out, rank)["trained_with"] == planned, f"rank {rank} trained otherwise than planned"
    return plan


def complete_steps(out: Path) -> list[int]:
    """The steps of the checkpoints in `out` marked complete (a resume may use them), oldest first."""
    return sorted(
        int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("checkpoint-*") if (p / "COMPLETE").exists()
    )


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def assert_refusal(result: Result | str, names: Iterable[str] = (), code: int | None = EXIT_BAD_INPUT) -> str:
    """A refusal checked by what it must name, not by its wording: exit `code` (for a `Result`; a stream's code is
    the test's to check), one `error:` line, no traceback, and each of `names` in that line: the setting (its
    variable or flag), the offending value, the path, what the user acts on. Returns the line."""
    text = result if isinstance(result, str) else result.stderr
    if not isinstance(result, str) and code is not None:
        assert result.code == code, text[-3000:]
    errors = error_lines(text)
    assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
    missing = [name for name in names if name not in errors[0]]
    assert not missing, f"{missing} not named in: {errors[0]}"
    return errors[0]


def assert_refused_as_bad_input(env: dict[str, str], args: list[str], names: Iterable[str], hub: HubStub) -> Result:
    """Run the job with `env` (None values: variables removed) and check the bad-input contract: exit 2, one
    `error:` line naming each of `names` (`assert_refusal`), no training step, nothing pushed, the token not shown."""
    env = {name: value for name, value in env.items() if value is not None}
    result = run_main(env, *args, timeout=180)
    assert_refusal(result, names)
    assert "Traceback" not in result.stdout
    assert hub.commits == [] and hub.count("/api/repos/create") == 0  # nothing pushed
    out = Path(env["OUTPUT_DIR"])
    assert not list(out.glob("checkpoints/checkpoint-*")) and not (out / "model").exists()  # no training step taken
    assert not any("first training step" in log.read_text() for log in out.glob("logs/rank-*.log"))
    assert hub.token not in result.stderr + result.stdout
    return result


def log_time(log: Path, fragment: str) -> float:
    """Epoch seconds of the first log line (rank log or console stream) containing `fragment`."""
    line = next(line for line in log.read_text().splitlines() if fragment in line)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def assert_token_absent(token: str, roots: list[Path], hub: HubStub | None = None) -> None:
    """Every file under `roots` (outputs, checkpoints, TensorBoard events, logs, captured stdout/stderr,
    HF_HOME) and every file pushed to the Hub, searched as bytes."""
    needle = token.encode()
    files = [path for root in roots for path in root.rglob("*") if path.is_file()]
    names = " ".join(path.name for path in files)
    kinds = "events.out.tfevents optimizer.pt rng_state training_args.bin rank-0.log run.json metrics.json README.md"
    for kind in kinds.split():
        assert kind in names, f"nothing like {kind} was searched"  # the search really covered a run's outputs
    leaks = [str(path) for path in files if needle in path.read_bytes()]
    if hub is not None:
        leaks += [f"hub:{name}" for commit in hub.commits for name, data in commit["files"].items() if needle in data]
    assert not leaks, f"HF_TOKEN found in {leaks}"


def rank_report(out: Path, world: int) -> list[dict]:
    """Per rank, from its logs/rank-R.json: who it was (rank, world, local rank, node, launcher) and what it trained."""
    names = dict(rank="rank", world="world_size", local_rank="local_rank", node="node_rank", source="source")
    names |= dict(samples="samples_trained", checksum="trainable_checksum")
    return [
        {name: record[key] for name, key in names.items()} for record in map(rank_record, [out] * world, range(world))
    ]


def succeeded(result: Result) -> Result:
    """`result`, checked to have exited 0 (the tail of its stderr shown when not)."""
    assert result.code == 0, result.stderr[-3000:]
    return result
