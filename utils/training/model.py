"""The model: a sequence classifier (one output per label, or one score) wrapped in LoRA, optionally in 8-bit."""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import pickle
import shutil
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BitsAndBytesConfig,
    PretrainedConfig,
)
from transformers.models.auto.tokenization_auto import get_tokenizer_config

from utils.common.errors import BadInput, JobError, first_line
from utils.config.local_inputs import check_model_folder, no_tokenizer
from utils.config.recipe import lora_options
from utils.config.tasks import MULTI_LABEL
from utils.run_folder.model_files import INPUTS_NAME, REGRESSION_LABEL, read_label_names

log = logging.getLogger(__name__)

CLASSIFIER = "classifier"  # the head of every family here: kept in full precision and trained alongside the adapters
# The query and value projections by each architecture's names, for the families peft's table lacks (ModernBERT
# fuses query, key and value into one layer, adapted whole).
QUERY_VALUE = {"distilbert": ("q_lin", "v_lin"), "modernbert": ("Wqkv",)}
DROPOUT_ATTRIBUTES = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout")
# No code from a model runs, and transformers never asks on stdin whether it may (it does when this is unset).
NO_REMOTE_CODE = {"trust_remote_code": False}


@dataclass(frozen=True)
class ModelChoices:
    """The settings build_model reads (Settings.select). `given`: LORA_TARGET_MODULES unset means the architecture's
    names (lora_targets)."""

    model_name: str
    model_dropout: float | str
    label_names: tuple[str, ...]
    problem_type: str
    train_pooler: bool
    gradient_checkpointing: bool
    int8_threshold: float
    lora_r: int
    lora_alpha: int
    lora_dropout: float
    lora_target_modules: tuple[str, ...]
    lora_variant: str
    lora_init: str
    given: frozenset[str]


@contextmanager
def _loading(model_name: str) -> Iterator[None]:
    """Loading MODEL_NAME fails as one refusal line, never a traceback."""
    try:
        yield
    except pickle.UnpicklingError as exc:
        raise _unsafe_weights(model_name, "pytorch_model.bin", exc) from None
    except (OSError, ValueError) as exc:
        raise BadInput(
            f"cannot load MODEL_NAME={model_name} ({type(exc).__name__}: {first_line(exc)}); "
            "give a Hub id or a local folder holding config.json and the weights (on an offline cluster, a folder on the shared volume)",
        ) from None


def load_tokenizer(model_name: str, max_seq_length: int, lora_r: int):
    """The model's tokenizer, after the model folder and its config are checked against the settings."""
    check_model(model_name, max_seq_length, lora_r)
    with _loading(model_name):
        tokenizer = AutoTokenizer.from_pretrained(model_name, **NO_REMOTE_CODE)
    # A folder without tokenizer files still loads one that knows only its special tokens: every word [UNK].
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
        raise no_tokenizer(model_name)
    # Saved with model/ and merged/: whoever loads the model truncates where training did (many folders say 1e30).
    tokenizer.model_max_length = max_seq_length
    return tokenizer


def check_model(model_name: str, max_seq_length: int, lora_r: int) -> None:
    """Before any step: a folder without what a model needs, custom code, unreadable weights, settings it cannot take."""
    check_model_folder(model_name)
    refuse_custom_code(model_name)
    folder = Path(model_name)
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.name.endswith((".safetensors", ".bin", ".pt", ".pth")):
                _check_weights_file(model_name, path)
    with _loading(model_name):
        config = AutoConfig.from_pretrained(model_name, **NO_REMOTE_CODE)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and max_seq_length > positions:
        raise BadInput(
            f"MAX_SEQ_LENGTH={max_seq_length} but MODEL_NAME={model_name} has position embeddings for {positions} tokens "
            f"(max_position_embeddings); set MAX_SEQ_LENGTH to {positions} or less",
        )
    hidden = getattr(config, "hidden_size", None)
    if isinstance(hidden, int) and lora_r > hidden:
        raise BadInput(
            f"LORA_R={lora_r} is above the hidden size {hidden} of MODEL_NAME={model_name}: an adapter of that rank "
            f"is larger than the layer it adapts; set LORA_R to {hidden} or less (8 or 16 is usual)",
        )


def refuse_custom_code(model_name: str) -> None:
    """A model whose config.json or tokenizer_config.json has an `auto_map` (Python files of its own) is refused,
    read as JSON: trust_remote_code=False would still load it silently with transformers' own classes."""
    with _loading(model_name):
        config, _ = PretrainedConfig.get_config_dict(model_name)
        tokenizer_config = get_tokenizer_config(model_name)
    found = {
        name: data["auto_map"]
        for name, data in (("config.json", config), ("tokenizer_config.json", tokenizer_config))
        if data.get("auto_map")
    }
    if found:
        names = " and ".join(found)
        raise BadInput(
            f"MODEL_NAME={model_name} needs custom code: auto_map in {names} names Python files of its own "
            f"({json.dumps(list(found.values()))[:160]}), and the job never runs code from a model; use a model that "
            f"transformers supports itself (e.g. bert-base-uncased), or delete auto_map from {names} if the model_type "
            "is one transformers knows",
        )


def _check_weights_file(model_name: str, path: Path) -> None:
    """A weights file the loader would call missing or fail on with a traceback; a pickle is tried with torch's
    weights-only unpickler on the meta device, as transformers loads it."""
    problem, fix = None, " and make them readable by the job"
    if path.is_symlink() and not path.exists():
        problem = f"is a link to {os.readlink(path)}, which does not exist"
    elif not path.is_file():
        problem = "is not a regular file"
    elif not os.access(path, os.R_OK):
        problem = f"is not readable by uid {os.getuid()} (mode {stat.filemode(path.stat().st_mode)})"
    elif path.stat().st_size == 0:
        problem = "is empty"
    elif path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt"):
                pass  # the header and the tensor offsets are checked against the file's size
        except Exception as exc:  # SafetensorError: a truncated, torn or foreign file
            problem = f"is damaged or truncated ({first_line(exc, 120)})"
    elif path.name.startswith("pytorch_model") and path.suffix == ".bin":  # what transformers unpickles as weights
        try:
            torch.load(path, map_location="meta", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise _unsafe_weights(model_name, path.name, exc) from None
        except Exception as exc:  # RuntimeError from torch's zip reader, EOFError ...: a truncated or foreign file
            problem = f"is damaged or not a PyTorch weights file ({type(exc).__name__}: {first_line(exc, 120)})"
            fix = ", preferably its model.safetensors from a trusted source"
    if problem:
        raise BadInput(
            f"MODEL_NAME={model_name}: the weights file {path.name} {problem}; copy the model's files there "
            f"again (e.g. `hf download MODEL --local-dir FOLDER`){fix}",
        )


def _unsafe_weights(model_name: str, name: str, exc: pickle.UnpicklingError) -> JobError:
    lines = str(exc).splitlines()
    what = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "")
    return BadInput(
        f"MODEL_NAME={model_name}: the weights file {name} is a pickle that would run code when loaded "
        f"({what.strip()[:160]}), which the job refuses; use safetensors weights (model.safetensors) of the model "
        "from a trusted source",
    )


def label_config(names: Sequence[str], multi_label: bool = False) -> dict:
    """The head's size and label names (a pipeline says 'positive', not 'LABEL_1'); `()` or `[score]`: regression."""
    regression = list(names) in ([], [REGRESSION_LABEL])
    names = [REGRESSION_LABEL] if regression else list(names)
    problem = "regression" if regression else MULTI_LABEL if multi_label else "single_label_classification"
    return {
        "num_labels": len(names),
        "problem_type": problem,
        "id2label": dict(enumerate(names)),
        "label2id": {name: index for index, name in enumerate(names)},
    }


def load_base(
    name: str, labels: Sequence[str] | None, restored: Iterable[str], multi_label: bool = False, **kwargs
) -> torch.nn.Module:
    """`name` with a head for `labels` (None: the checkpoint's own). A head of another size starts anew (training
    trains it, an adapter restores its own). transformers' LOAD REPORT is held back when every weight it names
    belongs to a module in `restored` (a head trained in full); one naming any other weight is shown."""
    heads = label_config(labels, multi_label) if labels is not None else {}
    if heads and AutoConfig.from_pretrained(name, **NO_REMOTE_CODE).num_labels != heads["num_labels"]:
        heads["ignore_mismatched_sizes"] = True
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            held.append(record)
            return False
        return True

    source = logging.getLogger("transformers.modeling_utils")
    source.addFilter(hold)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            name, output_loading_info=True, **heads, **NO_REMOTE_CODE, **kwargs
        )
    finally:
        source.removeFilter(hold)
    reported = [*info["missing_keys"], *(key for key, *_ in info["mismatched_keys"])]
    if any(not set(key.split(".")) & set(restored) for key in reported):
        for record in held:
            source.handle(record)
    return model


def _base_dropout(model_dropout: float | str, model_name: str, config: PretrainedConfig) -> dict:
    """The base model's dropout set to MODEL_DROPOUT (none for `checkpoint`): one epoch of LoRA underfits SST-2
    (docs/quality.md), and the base's own dropout only slows the adapter."""
    if model_dropout == "checkpoint":
        return {}
    dropout = {name: model_dropout for name in DROPOUT_ATTRIBUTES if isinstance(getattr(config, name, None), float)}
    if not dropout:
        log.warning(
            f"MODEL_DROPOUT={model_dropout:g}: the config of {model_name} has none of "
            f"{', '.join(DROPOUT_ATTRIBUTES)}; its dropout is left as it is"
        )
    return dropout


def build_model(
    choices: ModelChoices, quantization: str, device: torch.device, labels: tuple[str, ...] | None = None
) -> PeftModel:
    """AutoModelForSequenceClassification (one output per label, or one score) + LoRA; quantized base weights where
    the plan's `quantization` is 8bit or 4bit."""
    name, pooler, quantize = choices.model_name, choices.train_pooler, quantization in ("8bit", "4bit")
    with _loading(name):
        config = AutoConfig.from_pretrained(name, **NO_REMOTE_CODE)
    kwargs: dict = {"attn_implementation": attention(config), **_base_dropout(choices.model_dropout, name, config)}
    if quantize:
        kwargs |= quantized_loading(quantization, choices.int8_threshold, pooler, device)
    head = (CLASSIFIER, "score", *(["pooler"] if pooler else []))  # trained in full, started fresh here
    with _loading(name):
        multi_label = choices.problem_type == MULTI_LABEL
        model = load_base(name, choices.label_names if labels is None else labels, head, multi_label, **kwargs)
    if quantization == "4bit" and device.type == "cpu":
        # bitsandbytes 0.50 repacks a 4-bit weight for its CPU inference kernel at the first forward without gradients
        # (an evaluation) and leaves it so: the training step after it fails ("a view of a leaf Variable ... in-place").
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    if quantize:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=choices.gradient_checkpointing)
    targets = lora_targets(
        choices.lora_target_modules, "lora_target_modules" in choices.given, model.config.model_type
    )
    lora = LoraConfig(
        task_type=TaskType.SEQ_CLS,  # marks the classifier head trainable (modules_to_save)
        r=choices.lora_r,
        lora_alpha=choices.lora_alpha,
        lora_dropout=choices.lora_dropout,
        target_modules=list(targets),
        # pooler, rsLoRA/DoRA, init
        **lora_options(dict(model.named_modules()), choices.lora_variant, choices.lora_init, pooler),
    )
    return add_lora(model, lora, targets, name, pooler)


def quantized_loading(quantization: str, int8_threshold: float, train_pooler: bool, device: torch.device) -> dict:
    """from_pretrained arguments for quantized base weights on this rank's device; the head is skipped
    (`llm_int8_skip_modules`, which 4-bit reads too): LoRA cannot train an int8 or NF4 head."""
    skipped = [CLASSIFIER, *(["pooler.dense"] if train_pooler else [])]
    if quantization == "4bit":
        # QLoRA's recipe: NF4, double quantization, bf16 matmuls where the GPU has it (fp32 on the CPU).
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        compute = torch.bfloat16 if bf16 else torch.float16 if device.type == "cuda" else torch.float32
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
            llm_int8_skip_modules=skipped,
        )
    else:
        config = BitsAndBytesConfig(
            load_in_8bit=True, llm_int8_skip_modules=skipped, llm_int8_threshold=int8_threshold
        )
        # bitsandbytes warns of this cast at every int8 matmul (72 a step): said once here instead.
        logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
        log.info(
            "8-bit weights: bitsandbytes casts each int8 matmul's input to fp16 (INT8_THRESHOLD=%g)", int8_threshold
        )
    # Pinned to this rank's device, not "auto" across GPUs.
    return {"quantization_config": config, "device_map": {"": device.index if device.type == "cuda" else "cpu"}}


def add_lora(
    model: torch.nn.Module, lora: LoraConfig, targets: tuple[str, ...], model_name: str, train_pooler: bool
) -> PeftModel:
    """`lora` on `model`, every name in `targets` checked to have given an adapter."""
    modules = dict(model.named_modules())
    check_target_modules(model_name, modules, adapted=None, targets=targets)
    try:
        model = get_peft_model(model, lora)
    except ValueError as exc:  # names that match modules LoRA cannot adapt (a LayerNorm, say)
        raise BadInput(
            f"LORA_TARGET_MODULES={','.join(targets)}: peft cannot adapt them in {model_name} "
            f"({first_line(exc)}); name linear layers: {', '.join(linear_layer_names(modules))}",
        ) from None
    # peft passes over a name that matches nothing when another one matches, and skips modules it trains in
    # full (the head): every name must have given at least one adapter.
    check_target_modules(model_name, modules, adapted=model.targeted_module_names, targets=targets)
    if train_pooler and "pooler" not in (lora.modules_to_save or []):
        log.info(
            "TRAIN_POOLER: %s has no pooler (its classifier reads the first token); the classifier alone is trained in full",
            model.config.model_type,
        )
    trainable, total = model.get_nb_trainable_parameters()
    log.info("trainable parameters: %d of %d (%.3f%%)", trainable, total, 100 * trainable / total)
    return model


def lora_targets(target_modules: tuple[str, ...], given: bool, model_type: str) -> tuple[str, ...]:
    """LORA_TARGET_MODULES when `given`; else the query and value by this architecture's names."""
    if given:
        return target_modules
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    targets = tuple(QUERY_VALUE.get(model_type) or PEFT_TARGETS.get(model_type) or target_modules)
    if targets != target_modules:
        log.info("LORA_TARGET_MODULES unset: adapting %s, the query and value of %s", ",".join(targets), model_type)
    return targets


def attention(config: PretrainedConfig) -> str:
    """SDPA where offered, asked for by name so no library change falls back silently; else eager (DeBERTa-v2)."""
    try:
        supports = AutoModelForSequenceClassification._model_mapping[type(config)]._supports_sdpa
    except KeyError:
        return "sdpa"  # from_pretrained says what is wrong with the model
    if not supports:
        log.info("%s offers no SDPA attention: the eager attention is used", config.model_type)
    return "sdpa" if supports else "eager"


def linear_layer_names(modules: dict[str, torch.nn.Module]) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, module in modules.items() if isinstance(module, torch.nn.Linear)})


def matches_target(target: str, names: Iterable[str]) -> bool:
    return any(name == target or name.endswith(f".{target}") for name in names)


def check_target_modules(
    model_name: str, modules: dict[str, torch.nn.Module], adapted: list[str] | None, targets: tuple[str, ...]
) -> None:
    """Every name in `targets` matches a module (`adapted` None), or an adapted one: a typo (`query,vlaue`) would
    train `query` alone and exit 0."""
    linear = linear_layer_names(modules)
    problems = []
    for target in targets:
        if not matches_target(target, modules):
            close = difflib.get_close_matches(target.rsplit(".", 1)[-1], linear, n=3, cutoff=0.5)
            problems.append(f"'{target}' matches no module" + (f" (closest: {', '.join(close)})" if close else ""))
        elif adapted is not None and not matches_target(target, adapted):
            problems.append(f"'{target}' matches only modules that take no adapter (the head, trained in full)")
    if problems:
        raise BadInput(
            f"LORA_TARGET_MODULES={','.join(targets)}: {'; '.join(problems)} in MODEL_NAME={model_name}, "
            f"whose linear layers are named {', '.join(linear)}; set LORA_TARGET_MODULES to the layers to adapt "
            "(BERT's are query,value)",
        )


def trainable_checksum(model: torch.nn.Module, weights: dict[str, torch.Tensor] | None = None) -> str:
    """A hash of the trainable weights, the same on every rank when they were synchronised. `weights`: gathered
    already (DeepSpeed); under FSDP each is gathered here, a collective every rank calls."""
    if weights is None:
        weights = {
            name: param.full_tensor() if hasattr(param, "full_tensor") else param
            for name, param in sorted(model.named_parameters())
            if param.requires_grad
        }
    digest = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def load_adapted(model_name: str, adapter_dir: Path, labels: Sequence[str], multi_label: bool) -> PeftModel:
    """The base in full precision (merging into 8-bit would round the update away) with the adapter on it, the
    head named by the labels saved beside it (`labels` for an older model): what is merged, and what predicts."""
    saved = read_label_names(adapter_dir)
    labels = [saved[index] for index in sorted(saved)] if saved else labels
    with _loading(model_name):
        base = load_base(model_name, labels, (CLASSIFIER, "score"), multi_label, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir))


def load_pipeline(model_name: str, adapter_dir: Path, labels: Sequence[str], multi_label: bool):
    """A text-classification pipeline over `load_adapted` and the saved tokenizer, on the GPU when there is one."""
    from transformers import pipeline

    tokenizer = AutoTokenizer.from_pretrained(adapter_dir, **NO_REMOTE_CODE)
    device = 0 if torch.cuda.is_available() else -1
    return pipeline(
        "text-classification",
        model=load_adapted(model_name, adapter_dir, labels, multi_label),
        tokenizer=tokenizer,
        device=device,
    )


def merge_adapter(model_name: str, adapter_dir: Path, labels: Sequence[str], multi_label: bool, out_dir: Path) -> None:
    """The adapter merged into the base, saved to `out_dir`: plain float weights for servers without peft."""
    merged = load_adapted(model_name, adapter_dir, labels, multi_label).merge_and_unload()
    merged.save_pretrained(out_dir)  # safetensors: transformers 5's only format
    AutoTokenizer.from_pretrained(adapter_dir, **NO_REMOTE_CODE).save_pretrained(out_dir)
    if (adapter_dir / INPUTS_NAME).is_file():  # what one input is: predict.py reads it from either folder
        shutil.copyfile(adapter_dir / INPUTS_NAME, out_dir / INPUTS_NAME)
