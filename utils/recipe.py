"""The training recipe: the learning rate a run uses, and which weights train at which rate.

The learning rate follows the global batch (PER_DEVICE_BATCH_SIZE x world size x accumulation), so the
same settings train the same model on 1, 2, 4 or 8 replicas:

    learning_rate = BASE_LEARNING_RATE x (global batch / 64) ** 0.25     (LEARNING_RATE_SCALING=fourth-root)

64 is the reference batch, the global batch of one replica with the defaults, where BASE_LEARNING_RATE
(1e-3) was tuned. Four replicas take a quarter of the steps, each averaging four times the rows: Adam's
update size does not grow with the batch, so without a larger rate the run moves the weights a quarter as
far. How much larger was measured on real SST-2 on 4 replicas (docs/quality.md has the figures): the
square-root rule (Malladi et al. 2022, "On the SDEs and scaling rules for adaptive gradient algorithms";
`sqrt`) overshoots, the fourth root comes within a point of one replica. LoRA+ already trains the B
matrices at 8x the rate, which is likely why the gentler rule wins. `sqrt`, `linear` and `none` are there
to compare against. Warm-up is WARMUP_RATIO of
the steps, so it follows the step count by itself, but never all of them (`warmup_steps`).

A LEARNING_RATE set by the user is used exactly as given, on any number of replicas. A rate the rule
resolves passes LEARNING_RATE's own bounds: `linear` at a global batch of 1e8 would otherwise train at
1562.5, a rate the same setting typed by hand is refused at.

The head (the classifier and, with TRAIN_POOLER, the pooler) may train at HEAD_LEARNING_RATE_RATIO x
the rate, and LoRA+ trains each adapter's B matrix at LORAPLUS_LR_RATIO x the rate (Hayou et al. 2024;
peft's create_loraplus_optimizer puts the head's weights at 1x and its biases at the B rate, which is
why the groups are made here). Unset, the LoRA+ ratio follows the global batch too, the other way:

    loraplus_lr_ratio = 8 x min(1, (64 / global batch) ** 0.5), never below 1

At the larger batch the fourth-root rule raises A's rate, and B at 8x that rate was what held 4
replicas below one on whole sentences; B at 4x (the rule's value at 256) brought them level
(docs/quality.md). Below the reference batch the ratio stays at the 8 it was measured at.

The rule is plain arithmetic (no torch) because `--dry-run` must show the resolved rate without
importing torch; `optimizer_groups` imports nothing either and takes the model's named parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated

from pydantic import TypeAdapter, ValidationError

from utils.batching import plan_batches
from utils.errors import EXIT_BAD_INPUT, JobError
from utils.settings import MAX_GLOBAL_BATCH, Settings

REFERENCE_GLOBAL_BATCH = 64  # one replica with PER_DEVICE_BATCH_SIZE=64: where BASE_LEARNING_RATE was measured
REFERENCE_LORAPLUS_RATIO = 8.0  # the LoRA+ ratio measured best at the reference batch (docs/quality.md)
# The task head, trained in full: BERT's classifier and the pooler it reads, DistilBERT's pre_classifier.
HEAD_MODULES = ("classifier", "pre_classifier", "pooler")


def global_batch(settings: Settings, world_size: int) -> int:
    """GLOBAL_BATCH_SIZE, or PER_DEVICE_BATCH_SIZE x world size x accumulation (utils/batching.py)."""
    return plan_batches(settings, world_size).global_batch


def scaled_learning_rate(settings: Settings, world_size: int) -> float:
    """BASE_LEARNING_RATE at the reference batch, scaled to this job's global batch by LEARNING_RATE_SCALING."""
    ratio = global_batch(settings, world_size) / REFERENCE_GLOBAL_BATCH
    factor = {"fourth-root": ratio**0.25, "sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[
        settings.learning_rate_scaling
    ]
    return float(f"{settings.base_learning_rate * factor:.6g}")  # a readable number in logs, run.json and the card


def resolve_learning_rate(settings: Settings, world_size: int) -> float:
    """The rate this job trains at: LEARNING_RATE exactly when the user set it, else the scaling rule's rate,
    checked against LEARNING_RATE's bounds (a JobError naming the rule, the batch and the fix)."""
    if settings.learning_rate is not None:
        return settings.learning_rate
    rate = scaled_learning_rate(settings, world_size)
    refusal = _learning_rate_refusal(rate)
    if refusal:
        others = {
            rule: scaled_learning_rate(settings.model_copy(update={"learning_rate_scaling": rule}), world_size)
            for rule in ("fourth-root", "none")
            if rule != settings.learning_rate_scaling
        }
        rules = ", ".join(
            f"LEARNING_RATE_SCALING={rule} gives {value:g}"
            for rule, value in others.items()
            if not _learning_rate_refusal(value)
        )
        raise JobError(
            EXIT_BAD_INPUT,
            f"LEARNING_RATE_SCALING={settings.learning_rate_scaling} resolves the learning rate to {rate:g} at global batch "
            f"{global_batch(settings, world_size)} ({_batch_terms(settings, world_size)}; BASE_LEARNING_RATE "
            f"{settings.base_learning_rate:g} at batch {REFERENCE_GLOBAL_BATCH}), which LEARNING_RATE's own check refuses "
            f"({refusal}); set LEARNING_RATE to the rate to train at, or another rule ({rules})",
        )
    return rate


def resolve_loraplus_ratio(settings: Settings, world_size: int) -> float:
    """The LoRA+ ratio this job trains at: LORAPLUS_LR_RATIO exactly when the user set it, else 8 at the
    reference batch or below, falling as the square root of the global batch above it, never below 1."""
    if settings.loraplus_lr_ratio is not None:
        return settings.loraplus_lr_ratio
    shrink = min(1.0, (REFERENCE_GLOBAL_BATCH / global_batch(settings, world_size)) ** 0.5)
    return max(1.0, float(f"{REFERENCE_LORAPLUS_RATIO * shrink:.6g}"))


def _learning_rate_refusal(rate: float) -> str | None:
    """Why LEARNING_RATE would refuse `rate` (None: it takes it). The bounds are the field's own, so a rate
    the rule resolves and a rate typed by hand can never be held to different ones."""
    try:
        TypeAdapter(Annotated[(float, *Settings.model_fields["learning_rate"].metadata)]).validate_python(rate)
    except ValidationError as exc:
        return exc.errors()[0]["msg"].lower()
    return None


def _batch_terms(settings: Settings, world_size: int) -> str:
    """Where the global batch comes from, in the settings' own names."""
    if plan_batches(settings, world_size).fixed:
        return f"GLOBAL_BATCH_SIZE={settings.global_batch_size}"
    return (
        f"PER_DEVICE_BATCH_SIZE={settings.per_device_batch_size} x {world_size} replica(s) "
        f"x GRADIENT_ACCUMULATION_STEPS={settings.gradient_accumulation_steps}"
    )


def check_global_batch(settings: Settings, world_size: int, train_rows: int) -> None:
    """Refuse a global batch larger than the training split: one optimizer step would want more rows than exist.

    Each rank calls it with the same data, so every rank reaches the same decision without a collective."""
    plan = plan_batches(settings, world_size)
    if plan.global_batch <= train_rows:
        return
    fitting = train_rows // (world_size * settings.gradient_accumulation_steps)
    if plan.fixed:
        fix = f"set GLOBAL_BATCH_SIZE to {train_rows} or less, or train on more data"
    elif fitting >= 1:
        fix = f"set PER_DEVICE_BATCH_SIZE to {fitting} or less, lower GRADIENT_ACCUMULATION_STEPS, run fewer replicas, or train on more data"
    else:
        fix = "lower GRADIENT_ACCUMULATION_STEPS, run fewer replicas (even 1 row per device is too many), or train on more data"
    raise JobError(
        EXIT_BAD_INPUT,
        f"the global batch is {plan.global_batch} rows ({_batch_terms(settings, world_size)}) but the training split "
        f"has only {train_rows}: a step would take more rows than there are; {fix}",
    )


def warmup_steps(warmup_ratio: float, total_steps: int) -> int:
    """Warm-up steps for a run of `total_steps`: WARMUP_RATIO of them rounded up, as the Trainer counts them,
    but never all of them. A linear warm-up trains its first step at rate 0, so a 1-step run (MAX_STEPS=1,
    or one step an epoch) whose only step is warm-up would change no weight at all."""
    return max(0, min(math.ceil(total_steps * warmup_ratio), total_steps - 1))


def check_global_batch_bound(settings: Settings, world_size: int) -> None:
    """Refuse a global batch the settings make above GLOBAL_BATCH_SIZE's own bound: each factor has its range, but
    their product (x the replica count) would reach sizes no data set and no sampler index is made for."""
    batch = global_batch(settings, world_size)
    if batch > MAX_GLOBAL_BATCH:
        raise JobError(
            EXIT_BAD_INPUT,
            f"the global batch is {batch} rows ({_batch_terms(settings, world_size)}), above the {MAX_GLOBAL_BATCH} a "
            f"global batch may be (GLOBAL_BATCH_SIZE's range, 1 to {MAX_GLOBAL_BATCH}); lower PER_DEVICE_BATCH_SIZE or "
            "GRADIENT_ACCUMULATION_STEPS, or set GLOBAL_BATCH_SIZE",
        )


def apply_recipe(settings: Settings, world_size: int) -> Settings:
    """The settings with LEARNING_RATE and LORAPLUS_LR_RATIO resolved, so --dry-run, run.json, the logs and the
    model card show the values used; a global batch out of range is refused first."""
    check_global_batch_bound(settings, world_size)
    return settings.model_copy(
        update={
            "learning_rate": resolve_learning_rate(settings, world_size),
            "loraplus_lr_ratio": resolve_loraplus_ratio(settings, world_size),
        }
    )


def optimizer_groups(
    named_parameters: Iterable, settings: Settings, learning_rate: float, loraplus_ratio: float, weight_decay: float
) -> list[dict]:
    """AdamW parameter groups: adapters' A at the rate, B at `loraplus_ratio` x, the head at HEAD_LEARNING_RATE_RATIO x.

    Biases and LayerNorm weights (1-D tensors) never take weight decay, as in the Trainer's own grouping.
    """
    rates = {
        "lora_B": learning_rate * loraplus_ratio,
        "head": learning_rate * settings.head_learning_rate_ratio,
    }
    groups: dict[tuple[str, bool], list] = {}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        kind = (
            "head" if any(f".{m}." in f".{name}" for m in HEAD_MODULES) else "lora_B" if "lora_B" in name else "other"
        )
        groups.setdefault((kind, param.ndim > 1), []).append(param)
    return [
        {"params": params, "lr": rates.get(kind, learning_rate), "weight_decay": weight_decay if decays else 0.0}
        for (kind, decays), params in sorted(groups.items())
    ]


def lora_options(settings: Settings, module_names: Iterable[str]) -> dict:
    """LoraConfig keyword arguments beyond the adapter's shape: the pooler trained beside the classifier,
    rsLoRA / DoRA, and the initialisation. `module_names`: the model's named_modules() names."""
    options: dict = {"use_rslora": settings.lora_variant == "rslora", "use_dora": settings.lora_variant == "dora"}
    if settings.lora_init != "default":
        options["init_lora_weights"] = settings.lora_init
    # peft adds the classifier itself for SEQ_CLS, matching by suffix, so DistilBERT's pre_classifier trains too.
    # Models whose classifier reads no pooler (RoBERTa, DistilBERT) have none to train: nothing to add then.
    if settings.train_pooler and any(name.rsplit(".", 1)[-1] == "pooler" for name in module_names):
        options["modules_to_save"] = ["pooler"]
    return options


def describe_recipe(settings: Settings, world_size: int) -> str:
    """One log line: the rate used, where it came from, and the options around the adapter (recipe_summary)."""
    settings = apply_recipe(settings, world_size)  # the values used (resolving twice changes nothing)
    rate = settings.learning_rate
    batch = global_batch(settings, world_size)
    rule = scaled_learning_rate(settings, world_size)
    origin = (
        f"BASE_LEARNING_RATE {settings.base_learning_rate:g} x {settings.learning_rate_scaling} scaling from batch {REFERENCE_GLOBAL_BATCH}"
        if rate == rule
        else "LEARNING_RATE as set"
    )
    return f"learning rate {rate:g} at global batch {batch} ({origin}); {recipe_summary(settings)}"


def recipe_summary(settings: Settings) -> str:
    """The options around the adapter that shaped the model, for its card and the rank log: what it takes to train it
    again. `settings` as apply_recipe resolved them (the LoRA+ ratio used, not the rule)."""
    parts = [f"warm-up {settings.warmup_ratio:g} of the steps"]
    if settings.loraplus_lr_ratio not in (None, 1):
        parts.append(f"LoRA+ (B at x{settings.loraplus_lr_ratio:g} the rate)")
    if settings.head_learning_rate_ratio != 1:
        parts.append(f"head at x{settings.head_learning_rate_ratio:g} the rate")
    if settings.train_pooler:
        parts.append("pooler trained with the classifier")
    if settings.lora_variant != "lora":
        parts.append(settings.lora_variant)
    if settings.lora_init != "default":
        parts.append(f"{settings.lora_init} initialisation")
    if settings.weight_decay:
        parts.append(f"weight decay {settings.weight_decay:g}")
    if settings.model_dropout != "checkpoint":
        parts.append(f"base-model dropout {settings.model_dropout:g}")
    return ", ".join(parts)
