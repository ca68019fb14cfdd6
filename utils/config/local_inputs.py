"""What a start can check on the local disk without torch, datasets or the network: a MODEL_NAME folder, the local
data, its split files and their columns; `--dry-run` and the run call the same functions, so refuse with one line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from utils.common.delimited import FILE_FORMATS, data_files, read_records
from utils.common.errors import BadInput, JobError, first_line
from utils.config.settings import REPO_ID_PATTERN
from utils.config.tasks import validation_splits

# The files a tokenizer is built from (WordPiece, BPE, SentencePiece): a folder without any of them loads a
# tokenizer that knows only its special tokens.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model", "spm.model")
TOKENIZER_FILES += ("sentencepiece.bpe.model",)
MODEL_FIX = (
    "point MODEL_NAME at a folder holding the model's config.json, tokenizer and weights "
    "(e.g. `hf download MODEL --local-dir FOLDER`), or give a Hub id"
)


def _listing(folder: Path) -> str:
    return ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"


def check_model_folder(model_name: str) -> None:
    """A local MODEL_NAME (a folder by that name, or a name no Hub id can be) holds a config.json and a tokenizer."""
    folder = Path(model_name).expanduser()
    if not (folder.exists() or model_name.startswith(("/", ".", "~")) or not REPO_ID_PATTERN.match(model_name)):
        return
    if not folder.exists():
        raise BadInput(f"MODEL_NAME={model_name} does not exist (no such folder, and no Hub id); {MODEL_FIX}")
    if not folder.is_dir():
        raise BadInput(f"MODEL_NAME={model_name} is a file, not a folder; {MODEL_FIX}")
    config = folder / "config.json"
    if not config.is_file():
        raise BadInput(f"MODEL_NAME={model_name} has no config.json (it holds {_listing(folder)}); {MODEL_FIX}")
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
        if not isinstance(parsed, dict):
            raise ValueError(f"it holds a JSON {type(parsed).__name__}, not an object")
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadInput(
            f"MODEL_NAME={model_name}: its config.json cannot be read as a JSON object ({type(exc).__name__}: "
            f"{first_line(exc, 120, '')}); copy the model's files there again "
            "(e.g. `hf download MODEL --local-dir FOLDER`)",
        ) from None
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise no_tokenizer(model_name)


def no_tokenizer(model_name: str) -> JobError:
    return BadInput(
        f"MODEL_NAME={model_name} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), so every word would "
        "be [UNK]; save the base model's tokenizer into it (tokenizer.json or vocab.txt, tokenizer_config.json: "
        "AutoTokenizer.from_pretrained(base).save_pretrained(folder))",
    )


def check_data_file(setting: str, path: Path, split: str) -> str:
    rows = "training" if split == "train" else split
    if not path.exists():
        raise BadInput(f"{setting}={path} does not exist; point it at the {rows} rows' file")
    if not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file (a broken link, a pipe?)"
        raise BadInput(
            f"{path} is {kind}; the '{split}' split must be one data file: write its rows to {path.name} "
            "as a file, or move it out of DATASET_PATH",
        )
    if path.suffix.lower() not in FILE_FORMATS:
        raise BadInput(
            f"{setting}={path} is not a data file the job reads; write the {rows} rows as .csv .tsv .json .jsonl or .parquet",
        )
    if path.stat().st_size == 0:
        raise BadInput(f"{path} is empty (0 bytes); each split needs at least one row")
    return str(path)


def local_files(folder: Path, splits: tuple[str, ...]) -> dict[str, str]:
    files = {}
    for split in splits:
        found = data_files(folder, (split,))  # the files the loader reads, and the identity hashes
        if not found:
            carve = (
                ", or set VALIDATION_SPLIT=0.1 to hold out a tenth of the training rows" if split != "train" else ""
            )
            raise BadInput(
                f"DATASET_PATH={folder} has no '{split}' split (it holds {_listing(folder)}); add {split}.csv (or .tsv .json .jsonl .parquet) "
                f"or point DATASET_PATH at a save_to_disk DatasetDict{carve}",
            )
        if len(found) > 1:
            raise BadInput(
                f"DATASET_PATH={folder} has {len(found)} files for the '{split}' split ({', '.join(p.name for p in found)}); "
                "which one to train on is ambiguous: keep one and move the others out of the folder",
            )
        files[split] = check_data_file("DATASET_PATH", found[0], split)
    suffixes = {Path(f).suffix.lower() for f in files.values()}
    if len({FILE_FORMATS[s] for s in suffixes}) > 1:
        raise BadInput(
            f"DATASET_PATH={folder} mixes file formats ({sorted(suffixes)}); use one format for train and validation",
        )
    return files


def read_splits(validation_split: float | None, validation: tuple[str, ...]) -> tuple[str, ...]:
    """train and the task's validation split(s), or train alone when VALIDATION_SPLIT carves the validation rows."""
    return ("train",) if validation_split is not None else ("train", *validation)


def check_carve(
    present: Iterable[str], where: str, validation_split: float | None, validation: tuple[str, ...]
) -> None:
    """VALIDATION_SPLIT carves only where the data has no validation rows of its own (dropped without a word else)."""
    if validation_split is not None and (given := sorted(split for split in present if split in validation)):
        raise BadInput(
            f"VALIDATION_SPLIT={validation_split} carves validation rows out of the training rows, and "
            f"{where} holds {', '.join(given)} rows already; unset VALIDATION_SPLIT, or remove the validation rows",
        )


def split_files(
    dataset_path: str | None,
    train_file: str | None,
    validation_file: str | None,
    validation_split: float | None,
    validation: tuple[str, ...],
) -> dict[str, str] | None:
    """Each split's data file, checked: TRAIN_FILE (or a DATASET_PATH file) with VALIDATION_FILE, or a DATASET_PATH
    folder's split files. None for the Hub's data set or a save_to_disk folder (checked by check_splits)."""
    if train_file:
        train = ("TRAIN_FILE", train_file)
    elif not dataset_path:
        return None
    elif not Path(dataset_path).exists():
        raise BadInput(
            f"DATASET_PATH={dataset_path} does not exist; point it at the data's folder (train and validation files, "
            "or a save_to_disk DatasetDict), or unset it to load DATASET_NAME from the Hub",
        )
    elif Path(dataset_path).is_file():
        if validation_file is None and validation_split is None:
            raise BadInput(
                f"DATASET_PATH={dataset_path} is one file, the training rows; set VALIDATION_FILE to the "
                "validation rows' file, or VALIDATION_SPLIT=0.1 to hold out a tenth of the training rows (or point "
                "DATASET_PATH at a folder of train and validation files)",
            )
        train = ("DATASET_PATH", dataset_path)
    else:
        folder = Path(dataset_path)
        if validation_file:
            raise BadInput(
                f"VALIDATION_FILE={validation_file} goes with the training rows as one file, and "
                f"DATASET_PATH={folder} is a folder; point DATASET_PATH (or TRAIN_FILE) at the training file, or unset VALIDATION_FILE",
            )
        if (folder / "dataset_dict.json").exists():
            return None
        present = {p.stem for p in data_files(folder, validation)}
        check_carve(present, f"DATASET_PATH={folder}", validation_split, validation)
        return local_files(folder, read_splits(validation_split, validation))
    files = {"train": check_data_file(train[0], Path(train[1]), "train")}
    if validation_file:
        files[validation[0]] = check_data_file("VALIDATION_FILE", Path(validation_file), validation[0])
    return files


def test_split_file(dataset_path: str | None, test_file: str | None) -> Path | None:
    """The test split's file, checked: TEST_FILE, or the one `test.*` file of a DATASET_PATH folder; None if none."""
    folder = Path(dataset_path) if dataset_path else None
    found = data_files(folder, ("test",)) if folder and folder.is_dir() else []
    if test_file and found:
        raise BadInput(
            f"TEST_FILE={test_file} and DATASET_PATH={folder}'s {found[0].name} both name the test rows; "
            f"unset TEST_FILE to answer {found[0].name}, or move {found[0].name} out of the folder",
        )
    if test_file:
        return Path(check_data_file("TEST_FILE", Path(test_file), "test"))
    if len(found) > 1:
        raise BadInput(
            f"DATASET_PATH={folder} has {len(found)} files for the 'test' split ({', '.join(p.name for p in found)}); "
            "which one to answer is ambiguous: keep one and move the others out of the folder",
        )
    return Path(check_data_file("DATASET_PATH", found[0], "test")) if found else None


def check_test_columns(path: Path, text_columns: tuple[str, ...]) -> None:
    """The test split's file has the text column(s); its label column is optional (without it, no metrics)."""
    names = file_columns(path, text_columns)
    if missing := [column for column in text_columns if names is not None and column not in names]:
        raise BadInput(
            f"the test split ({path}) has no column '{missing[0]}' (columns: {names}); give it the text column(s) "
            f"the run trains on ({','.join(text_columns)}), or move it away to train without answering it",
        )


def check_splits(present: Iterable[str], splits: tuple[str, ...]) -> None:
    if missing := [split for split in splits if split not in present]:
        raise BadInput(f"the data set has no {missing} split (it has {sorted(present)}); provide it")


def check_columns(
    split: str, column_names: list[str], text_columns: tuple[str, ...], label_columns: tuple[str, ...]
) -> None:
    """The split has the text and label column(s) (LABEL_COLUMNS: a multi-label problem's 0/1 columns)."""
    label_setting = "LABEL_COLUMNS" if len(label_columns) > 1 else "LABEL_COLUMN"
    for setting, column in [
        *(("TEXT_COLUMN", column) for column in text_columns),
        *((label_setting, column) for column in label_columns),
    ]:
        if column not in column_names:
            raise BadInput(
                f"the {split} split has no column '{column}' (columns: {column_names}); set {setting} to the right one"
                + (" (TEXT_COLUMN=first,second names a sentence pair)" if setting == "TEXT_COLUMN" else ""),
            )


def file_columns(path: Path, needed: Iterable[str]) -> list[str] | None:
    """The columns the loader will read from one split's file, in order: a csv/tsv header, the first JSON record's keys
    (all records' when a needed one is missing), a parquet schema. None where the run's loader will say what is wrong."""
    suffix = path.suffix.lower()
    try:
        if FILE_FORMATS[suffix] == "csv":
            with path.open(encoding="utf-8-sig", newline="") as handle:
                header, _ = read_records(handle, path, suffix)
            # The loader (pandas) names a column without a name by its place
            return None if header is None else [name or f"Unnamed: {i}" for i, name in enumerate(header)]
        if FILE_FORMATS[suffix] == "parquet":
            import pyarrow.parquet  # only here: a fifth of a second that a csv's --dry-run does not pay

            return list(pyarrow.parquet.read_schema(path).names)
        with path.open(encoding="utf-8-sig") as handle:
            first = next((line for line in handle if line.strip()), "")
        if not first.lstrip().startswith("["):
            keys = list(json.loads(first))
            if set(needed) <= set(keys):
                return keys
            text = path.read_text(encoding="utf-8-sig")
            records = map(json.loads, filter(str.strip, text.splitlines()))
        else:
            records = json.loads(path.read_text(encoding="utf-8-sig"))
        columns: dict[str, None] = {}
        for record in records:
            columns.update(dict.fromkeys(record))
        return list(columns)
    except JobError:  # a header naming a column twice: refused as the run's reader refuses it
        raise
    except Exception:  # not UTF-8, not JSON, not parquet (ArrowInvalid): the run's loader refuses it with its reason
        return None


def saved_columns(folder: Path) -> dict[str, list[str] | None] | None:
    """A save_to_disk DatasetDict's splits and columns (None where unreadable: the run's loader names the damage)."""
    try:
        splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    columns: dict[str, list[str] | None] = {}
    for split in splits:
        try:
            info = json.loads((folder / split / "dataset_info.json").read_text(encoding="utf-8"))
            columns[split] = list(info["features"])
        except (OSError, ValueError, KeyError, TypeError):
            columns[split] = None
    return columns


@dataclass(frozen=True)
class LocalData:
    """The local data and its columns (Settings.select builds it)."""

    dataset_path: str | None
    train_file: str | None
    validation_file: str | None
    test_file: str | None
    validation_split: float | None
    task: str | None
    text_columns: tuple[str, ...]
    label_source_columns: tuple[str, ...]


def check_dataset(data: LocalData) -> None:
    """What --dry-run checks of the local data, by the functions the run's loader calls: each split's file (or the
    DatasetDict's splits) and the columns named; the test split's file and text columns."""
    text_columns, label_columns = data.text_columns, data.label_source_columns
    dataset_path, carve, validation = data.dataset_path, data.validation_split, validation_splits(data.task)
    if (test := test_split_file(dataset_path, data.test_file)) is not None:
        check_test_columns(test, text_columns)
    columns: Mapping[str, list[str] | None]
    if (files := split_files(dataset_path, data.train_file, data.validation_file, carve, validation)) is not None:
        columns = {split: file_columns(Path(p), [*text_columns, *label_columns]) for split, p in files.items()}
    elif not dataset_path or (saved := saved_columns(Path(dataset_path))) is None:
        return  # the Hub's data set (no network here), or a DatasetDict its loader refuses
    else:
        check_carve(saved, f"DATASET_PATH={dataset_path}", carve, validation)
        check_splits(saved, read_splits(carve, validation))
        columns = saved
    for split in read_splits(carve, validation):
        if (names := columns.get(split)) is not None:
            check_columns(split, names, text_columns, label_columns)
