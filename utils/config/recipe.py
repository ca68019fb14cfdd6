"""The training recipe around the adapter: which weights train at which of the plan's rates, and the LoRA options.
The groups are made here because peft's create_loraplus_optimizer puts the head's weights at 1x and its biases at B's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from utils.config.plan import Plan
from utils.config.settings import Settings


@dataclass(frozen=True)
class RecipeOptions:
    """The settings recipe_summary reads (Settings.select builds it; the card's facts extend it)."""

    warmup_ratio: float
    head_learning_rate_ratio: float
    train_pooler: bool
    lora_variant: str
    lora_init: str
    weight_decay: float
    model_dropout: float | str
    class_weights: str


# The task head, trained in full: BERT's classifier and the pooler it reads, DistilBERT's pre_classifier.
HEAD_MODULES = ("classifier", "pre_classifier", "pooler")


def optimizer_groups(named_parameters: Iterable, rates: dict[str, float], weight_decay: float) -> list[dict]:
    """AdamW parameter groups at the plan's `rates`: adapters' B at "lora_B", the head at "head", the rest (A) at
    "base"; biases and LayerNorm weights (1-D) take no weight decay, as in the Trainer's own grouping."""
    groups: dict[tuple[str, bool], list] = {}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        head = any(f".{module}." in f".{name}" for module in HEAD_MODULES)
        kind = "head" if head else "lora_B" if "lora_B" in name else "other"
        groups.setdefault((kind, param.ndim > 1), []).append(param)
    return [
        {"params": params, "lr": rates.get(kind, rates["base"]), "weight_decay": weight_decay if decays else 0.0}
        for (kind, decays), params in sorted(groups.items())
    ]


def lora_options(module_names: Iterable[str], lora_variant: str, lora_init: str, train_pooler: bool) -> dict:
    """LoraConfig keyword arguments beyond the adapter's shape (TRAIN_POOLER, LORA_VARIANT, LORA_INIT).
    `module_names`: the model's named_modules() names."""
    options: dict = {"use_rslora": lora_variant == "rslora", "use_dora": lora_variant == "dora"}
    if lora_init != "default":
        options["init_lora_weights"] = lora_init
    # peft adds the classifier itself for SEQ_CLS, matching by suffix, so DistilBERT's pre_classifier trains too.
    # Models whose classifier reads no pooler (RoBERTa, DistilBERT) have none to train: nothing to add then.
    if train_pooler and any(name.rsplit(".", 1)[-1] == "pooler" for name in module_names):
        options["modules_to_save"] = ["pooler"]
    return options


def describe_recipe(settings: Settings, plan: Plan) -> str:
    """One log line: the rate used, where it came from, and the options around the adapter (recipe_summary)."""
    return f"learning rate {plan.learning_rate:g} at global batch {plan.batch.global_batch} ({plan.learning_rate_source}); {recipe_summary(settings.select(RecipeOptions), plan.loraplus_ratio)}"


def recipe_summary(options: RecipeOptions, loraplus_ratio: float | None, pooler: bool | None = None) -> str:
    """The options around the adapter that shaped the model, for its card and the rank log. `loraplus_ratio`: the
    plan's. `pooler`: whether the saved adapter trained one; None before the model is read (RoBERTa has none)."""
    parts = [f"warm-up {options.warmup_ratio:g} of the steps"]
    if loraplus_ratio not in (None, 1):
        parts.append(f"LoRA+ (B at x{loraplus_ratio:g} the rate)")
    if options.head_learning_rate_ratio != 1:
        parts.append(f"head at x{options.head_learning_rate_ratio:g} the rate")
    if pooler or (pooler is None and options.train_pooler):
        parts.append("pooler trained with the classifier" + (" where the model has one" if pooler is None else ""))
    if options.lora_variant != "lora":
        parts.append(options.lora_variant)
    if options.lora_init != "default":
        parts.append(f"{options.lora_init} initialisation")
    if options.weight_decay:
        parts.append(f"weight decay {options.weight_decay:g}")
    if options.model_dropout != "checkpoint":
        parts.append(f"base-model dropout {options.model_dropout:g}")
    if options.class_weights != "none":
        parts.append(f"{options.class_weights} class weights in the loss")
    return ", ".join(parts)
