"""Offline stand-ins for bert-base-uncased and GLUE: synthetic SST-2, MNLI and STS-B-shaped data sets and a tiny BERT.

    python scripts/make_demo_assets.py data  examples/sst2-synthetic      # the bundled samples (committed)
    python scripts/make_demo_assets.py data  examples/mnli-synthetic --task mnli
    python scripts/make_demo_assets.py data  examples/stsb-synthetic --task stsb
    python scripts/make_demo_assets.py model .demo/sst2/tiny-bert --data examples/sst2-synthetic
    python scripts/make_demo_assets.py data  /tmp/sst2-like --profile sst2 --rows 67349     # benchmark data
    python scripts/make_demo_assets.py model /tmp/bert-base-random --data /tmp/sst2-like --base

The data set has GLUE SST-2's shape (columns sentence, label, idx; labels 0/1) and a similar length
profile (PROFILES below), and no real SST-2 row: every sentence is drawn from word lists, and its
label is the sentiment of the adjective in it, a task a tiny model learns in minutes.
The MNLI and STS-B samples (`--task`, 600 train and 100 rows per validation split) have those tasks' columns,
labels and splits, and are as easy on purpose: the first sentence says what a film is about, the second alone
decides the label (MNLI: a positive adjective entails, a negative one contradicts, a plain fact is neutral;
STS-B: the score is 5 x the share of positive adjectives in it). They show the pipeline of a pair task (three
classes and two validation splits; a 0-5 regression), not what a model can learn.
The model is a 2-layer, 64-wide BERT with a word-level vocabulary built from the data, saved with
`save_pretrained` so `AutoModelForSequenceClassification` and `AutoTokenizer` load it like a Hub model;
`--base` gives bert-base's dimensions instead (`BertConfig()`: the FLOPs of bert-base-uncased, random
weights), the stand-in for speed measurements where the Hub cannot be reached.
Tests and benchmarks/ import these functions, so the demo, the tests and the benchmark build the same things.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
from pathlib import Path

POSITIVE = (
    "good great wonderful moving delightful funny charming superb brilliant touching warm clever gorgeous".split()
)
NEGATIVE = "bad awful boring dull tedious clumsy lifeless stupid painful flat messy bland hollow".split()
SUBJECTS = (
    "the film;this movie;the story;the cast;the script;its director;the ending;every scene;the whole thing".split(";")
)
VERBS = "is;feels;was;seems;remains;looks".split(";")
FILLER = "and the a of to in it with its that for as on but by an this".split()
NOUNS = "plot actors music camera dialogue pace characters hero villain soundtrack cinematography".split()


# Length profiles: (probability of one more filler word, most words in a sentence). A sentence is a
# 2-3 word subject, a verb and an adjective, then a geometric number of filler words; with the word-level
# vocabulary every word is one token, plus [CLS] and [SEP]. Token counts over 67,349 rows (seed 0):
#   demo: mean 10.7, median 9, p90 17, p99 29, max 42  (short: the demo and the tests run fast)
#   sst2: mean 13.1, median 11, p90 23, p99 40, max 62  (GLUE SST-2's train split averages about 13
#         bert-base-uncased tokens with a long tail, mostly short phrases: the benchmark's stand-in)
PROFILES = {"demo": (0.82, 40), "sst2": (0.875, 60)}


def synthetic_sentence(rng: random.Random, profile: str = "demo") -> tuple[str, int]:
    more, most = PROFILES[profile]
    label = rng.randint(0, 1)
    adjective = rng.choice(POSITIVE if label else NEGATIVE)
    words = [*rng.choice(SUBJECTS).split(), rng.choice(VERBS), adjective]
    # SST-2 is mostly short phrases with a long tail: pad with a geometric number of filler words.
    while rng.random() < more and len(words) < most:
        words.append(rng.choice(FILLER + NOUNS))
    return " ".join(words), label


def write_dataset(
    folder: Path, train_rows: int = 2000, validation_rows: int = 301, seed: int = 0, profile: str = "demo"
) -> Path:
    """train.csv and validation.csv with GLUE SST-2's columns (validation odd-sized on purpose)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train_rows), ("validation", validation_rows)):
        with open(folder / f"{split}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["sentence", "label", "idx"])
            for idx in range(rows):
                writer.writerow([*synthetic_sentence(rng, profile), idx])
    return folder


def pair_rows(task: str, rng: random.Random, count: int):
    """MNLI-shaped (premise, hypothesis, label 0-2) or STS-B-shaped (sentence1, sentence2, score 0-5) rows, with idx.
    The first sentence says what a film is about, without sentiment; the second's few adjectives (four of each
    sentiment, so a tiny model learns them in a minute) decide the label."""
    positive_words, negative_words = POSITIVE[:4], NEGATIVE[:4]
    for idx in range(count):
        first = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} about the {rng.choice(NOUNS)}"
        if task == "mnli":  # entailment, neutral, contradiction: GLUE's label ids
            label = rng.randrange(3)
            verb = rng.choice(VERBS)
            claim = (
                f"{verb} {rng.choice(positive_words)}",
                f"shows the {rng.choice(NOUNS)}",
                f"{verb} {rng.choice(negative_words)}",
            )
            yield first, f"it {claim[label]}", label, idx
        else:
            positive = rng.randint(0, 4)
            adjectives = [rng.choice(positive_words) for _ in range(positive)]
            adjectives += [rng.choice(negative_words) for _ in range(4 - positive)]
            rng.shuffle(adjectives)
            yield first, f"it {rng.choice(VERBS)} {' and '.join(adjectives)}", 5 * positive / 4, idx


PAIR_TASKS = {  # the columns and validation splits GLUE gives each task (utils/config/tasks.py reads the same names)
    "mnli": (["premise", "hypothesis", "label", "idx"], ("validation_matched", "validation_mismatched")),
    "stsb": (["sentence1", "sentence2", "label", "idx"], ("validation",)),
}


def write_pair_dataset(
    folder: Path, task: str, train_rows: int = 600, validation_rows: int = 100, seed: int = 0
) -> Path:
    """train.csv and each validation split of `task` (mnli or stsb) in GLUE's columns."""
    rng = random.Random(seed)
    header, validation = PAIR_TASKS[task]
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train_rows), *((name, validation_rows) for name in validation)):
        with open(folder / f"{split}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(pair_rows(task, rng, rows))
    return folder


def write_tiny_bert(
    folder: Path,
    data_folder: Path | None = None,
    layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    base: bool = False,
    num_labels: int = 2,
) -> Path:
    """A randomly initialised BERT with a word-level vocabulary covering the synthetic data.

    `base=True`: `BertConfig()`'s dimensions (768 wide, 12 heads, 3072-wide FFN, a 30522-row embedding
    table like bert-base-uncased's, of which the small vocabulary uses the first rows) with `layers`
    layers and `hidden` ignored; 12 layers is bert-base.
    """
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast, set_seed

    words = set(POSITIVE + NEGATIVE + VERBS + FILLER + NOUNS + " ".join(SUBJECTS).split())
    if data_folder is not None:
        for path in Path(data_folder).glob("*.csv"):
            with open(path) as handle:
                for row in csv.DictReader(handle):  # every text column (sentence; premise, hypothesis; ...)
                    words.update(w for k, v in row.items() if k not in ("label", "idx") for w in v.lower().split())
    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # `vocab=` (a path), not `vocab_file=`, which transformers 5 ignores, leaving a 5-token vocabulary.
    tokenizer = BertTokenizerFast(vocab=str(folder / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(folder)
    set_seed(seed)
    if base:
        config = BertConfig(num_hidden_layers=layers, num_labels=num_labels)
    else:
        config = BertConfig(
            vocab_size=len(vocab),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            intermediate_size=hidden * 2,
            max_position_embeddings=512,
            num_labels=num_labels,
        )
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["data", "model"])
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--task", choices=["sst2", *PAIR_TASKS], default="sst2", help="the GLUE task's data shape, and its model head"
    )
    parser.add_argument("--data", type=Path, help="data folder whose words the tiny model's vocabulary covers")
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="demo", help="data: the sentence length profile"
    )
    parser.add_argument("--rows", type=int, default=2000, help="data: training rows (SST-2 has 67349)")
    parser.add_argument(
        "--base", action="store_true", help="model: bert-base dimensions (BertConfig()) instead of 2x64"
    )
    parser.add_argument("--layers", type=int, help="model: encoder layers (default 2, or 12 with --base)")
    args = parser.parse_args()
    # Building a tiny BERT needs neither: left out as main.py leaves them out (utils/cluster/job.leave_out), their imports'
    # CPU and notices (bitsandbytes' missing optional 4-bit CPU kernel) go with them.
    for name in ("bitsandbytes", "deepspeed"):
        sys.modules.setdefault(name, None)
    if args.what == "data" and args.task != "sst2":
        out = write_pair_dataset(args.folder, args.task)
    elif args.what == "data":
        out = write_dataset(
            args.folder,
            train_rows=args.rows,
            validation_rows=872 if args.profile == "sst2" else 301,
            profile=args.profile,
        )
    else:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # saving a 0.5 MB model: a bar for nothing
        layers = args.layers or (12 if args.base else 2)
        # The task's head (MNLI 3 classes, STS-B one score), so loading it for the task reinitialises nothing.
        labels = {"mnli": 3, "stsb": 1}.get(args.task, 2)
        out = write_tiny_bert(args.folder, args.data, layers=layers, base=args.base, num_labels=labels)
    print(out)
