"""Offline stand-ins for bert-base-uncased and SST-2: a synthetic SST-2-shaped data set and a tiny BERT.

    python scripts/make_demo_assets.py data  examples/sst2-synthetic      # the bundled sample (committed)
    python scripts/make_demo_assets.py model .demo/tiny-bert --data examples/sst2-synthetic

The data set has GLUE SST-2's shape (columns sentence, label, idx; labels 0/1) and a similar length
profile (3 to ~40 words, most around 10), and no real SST-2 row: every sentence is drawn from word
lists, and its label is the sentiment of the adjective in it, a task a tiny model learns in minutes.
The model is a 2-layer, 64-wide BERT with a word-level vocabulary built from the data, saved with
`save_pretrained` so `AutoModelForSequenceClassification` and `AutoTokenizer` load it like a Hub model.
Tests import these functions, so the demo and the tests build the same things.
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

POSITIVE = "good great wonderful moving delightful funny charming superb brilliant touching warm clever gorgeous".split()
NEGATIVE = "bad awful boring dull tedious clumsy lifeless stupid painful flat messy bland hollow".split()
SUBJECTS = "the film;this movie;the story;the cast;the script;its director;the ending;every scene;the whole thing".split(";")
VERBS = "is;feels;was;seems;remains;looks".split(";")
FILLER = "and the a of to in it with its that for as on but by an this".split()
NOUNS = "plot actors music camera dialogue pace characters hero villain soundtrack cinematography".split()


def synthetic_sentence(rng: random.Random) -> tuple[str, int]:
    label = rng.randint(0, 1)
    adjective = rng.choice(POSITIVE if label else NEGATIVE)
    words = [*rng.choice(SUBJECTS).split(), rng.choice(VERBS), adjective]
    # SST-2 is mostly short phrases with a long tail: pad with a geometric number of filler words.
    while rng.random() < 0.82 and len(words) < 40:
        words.append(rng.choice(FILLER + NOUNS))
    return " ".join(words), label


def write_dataset(folder: Path, train_rows: int = 2000, validation_rows: int = 301, seed: int = 0) -> Path:
    """train.csv and validation.csv with GLUE SST-2's columns (validation odd-sized on purpose)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train_rows), ("validation", validation_rows)):
        with open(folder / f"{split}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["sentence", "label", "idx"])
            for idx in range(rows):
                writer.writerow([*synthetic_sentence(rng), idx])
    return folder


def write_tiny_bert(folder: Path, data_folder: Path | None = None, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A randomly initialised BERT with a word-level vocabulary covering the synthetic data."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast, set_seed

    words = set(POSITIVE + NEGATIVE + VERBS + FILLER + NOUNS + " ".join(SUBJECTS).split())
    if data_folder is not None:
        for path in Path(data_folder).glob("*.csv"):
            with open(path) as handle:
                words.update(w for row in csv.DictReader(handle) for w in row["sentence"].lower().split())
    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # `vocab=` (a path), not `vocab_file=`, which transformers 5 ignores, leaving a 5-token vocabulary.
    tokenizer = BertTokenizerFast(vocab=str(folder / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(folder)
    set_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=512,
        num_labels=2,
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["data", "model"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--data", type=Path, help="data folder whose words the tiny model's vocabulary covers")
    args = parser.parse_args()
    out = write_dataset(args.folder) if args.what == "data" else write_tiny_bert(args.folder, args.data)
    print(out)
