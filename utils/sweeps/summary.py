"""A sweep's answer, from its trial folders alone (every backend gets the same): summary.csv, summary.md (sorted by
the metric, the best trial's settings) and summary.png. A trial's status is its last run's, in `trial.json`:
complete (exit 0 and the metric in metrics.json), failed, pending, or running (or killed: rerun next time).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from utils.run_folder.layout import RunDir
from utils.run_folder.record import claim_run_dir, refuse_foreign
from utils.sweeps.spec import Spec, Trial, setting_value, trial_metric

TRIAL_RECORD = "trial.json"


@dataclass
class Row:
    trial: Trial
    status: str
    value: float | None


def record_trial(spec: Spec, trial: Trial, **fields) -> Path:
    """Write (or update) the trial's record in its folder, which it returns: settings, then its outcome."""
    folder = spec.output_dir / trial.name
    run = RunDir(folder.resolve())
    refuse_foreign(run, folder)  # main.py's own refusal of a folder another tool wrote
    folder.mkdir(parents=True, exist_ok=True)
    claim_run_dir(run)  # the trial's OUTPUT_DIR, marked the job's before the sweep's files go in
    record = run.read_json(run.root / TRIAL_RECORD) or {}
    record.update(trial=trial.name, index=trial.index, params=trial.params, settings=spec.trial_env(trial), **fields)
    run.write_json(run.root / TRIAL_RECORD, record)
    return folder


def collect_rows(spec: Spec, trials: list[Trial]) -> list[Row]:
    rows = []
    for trial in trials:
        folder = spec.output_dir / trial.name
        status = (RunDir(folder).read_json(folder / TRIAL_RECORD) or {}).get("status", "pending")
        # a metrics.json of an earlier run is not this run's result
        value = trial_metric(spec, folder) if status == "complete" else None
        if status == "complete" and value is None:
            status = "failed"  # metrics.json went, or never held the metric
        rows.append(Row(trial, status, value))
    return rows


def write_summary(spec: Spec, trials: list[Trial]) -> None:
    """Write summary.csv, summary.md and summary.png in the sweep's output_dir, and print the markdown."""
    rows = collect_rows(spec, trials)
    out = spec.output_dir
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", *spec.swept, "status", spec.metric])
        for row in rows:
            value = "" if row.value is None else repr(row.value)
            writer.writerow(
                [row.trial.name, *(setting_value(row.trial.params[k]) for k in spec.swept), row.status, value]
            )
    markdown = summary_markdown(spec, rows)
    (out / "summary.md").write_text(markdown)
    plot_summary(spec, rows, out / "summary.png")
    print(f"{markdown}\nsweep: wrote {out / 'summary.csv'}, summary.md and summary.png", flush=True)


def summary_markdown(spec: Spec, rows: list[Row]) -> str:
    sign = -1 if spec.direction == "maximize" else 1  # completed trials best first, then the others in trial order
    rows = sorted(rows, key=lambda r: (r.value is None, sign * (r.value or 0), r.trial.index))
    table = [["rank", "trial", *spec.swept, "status", spec.metric], ["---"] * (len(spec.swept) + 4)]
    for rank, row in enumerate(rows, 1):
        value = "" if row.value is None else f"{row.value:.4f}"
        swept = [setting_value(row.trial.params[k]) for k in spec.swept]
        table.append([str(rank) if row.value is not None else "-", row.trial.name, *swept, row.status, value])
    lines = [f"# Sweep {spec.name}: {spec.metric} ({spec.direction})", "", *(f"| {' | '.join(r)} |" for r in table)]
    counts = {s: sum(r.status == s for r in rows) for s in ("complete", "failed", "running", "pending")}
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n), ""]
    best = rows[0] if rows and rows[0].value is not None else None
    if best:
        lines += [
            f"Best: {best.trial.name}, {spec.metric} = {best.value:.4f}, in {spec.output_dir / best.trial.name}, with",
            "",
            "```",
            *(f"{k}={v}" for k, v in sorted(spec.trial_env(best.trial).items())),
            "```",
            "",
        ]
    else:
        lines += ["No trial has finished with the metric yet.", ""]
    return "\n".join(lines)


def plot_summary(spec: Spec, rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = spec.swept
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    done = [r for r in rows if r.value is not None]
    for ax, name in zip(axes[0], names, strict=True):
        xs = [r.trial.params[name] for r in done]
        numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs)
        if not numeric:  # categorical values: one position each, in the spec's order
            order = list(dict.fromkeys(setting_value(r.trial.params[name]) for r in rows))
            xs = [order.index(setting_value(x)) for x in xs]
            ax.set_xticks(range(len(order)), order, rotation=30, ha="right")
        ax.scatter(xs, [r.value for r in done])
        # a log range, or a grid of rates (1e-4, 1e-3, 1e-2), reads on a log axis; a grid of ranks (4, 8) need not
        wide = getattr(spec.random.get(name), "log", False) or min(xs, default=0) > 0 and max(xs) >= 100 * min(xs)
        if numeric and xs and wide:
            ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel(spec.metric)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{spec.name}: {len(done)} of {len(rows)} trials complete")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
