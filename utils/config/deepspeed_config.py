"""STRATEGY=deepspeed: the DeepSpeed config a run uses, built from ZERO_STAGE and ZERO_OFFLOAD or read from
DEEPSPEED_CONFIG, and checked against the settings at --dry-run, before anything is loaded.

What the settings own (OWNED: batches, rate and schedule, clipping, precision) is "auto" in the config, and the
Trainer fills it in from its TrainingArguments. A user's file may leave such a field "auto", leave it out (the job
writes "auto": DeepSpeed's defaults would train other numbers), or pin the value the settings resolve to; any other
value is refused (exit 2), as is every "auto" nothing fills in: what transformers compares with its TrainingArguments
(HfTrainerDeepSpeedConfig) is compared here, not after the model has loaded. The file's ZeRO stage and offload
become ZERO_STAGE and ZERO_OFFLOAD (`deepspeed_overrides`), recorded and compared on a resume like any setting.

The job's config has no optimizer or scheduler block: the Trainer builds its own AdamW with the recipe's groups
(LoRA+, the head's rate) and its warm-up, and hands them to DeepSpeed (zero_allow_untested_optimizer): torch's
AdamW (no nvcc at run time), or DeepSpeedCPUAdam under ZERO_OFFLOAD, compiled once with g++. No torch import here.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from utils.common.errors import BadInput
from utils.config.plan import Plan
from utils.config.settings import Settings

DEEPSPEED_PIN = "deepspeed==0.19.8"  # requirements.txt's pin, named in the fix when it is missing
# The Trainer's defaults, which the job keeps.
GRADIENT_CLIPPING = 1.0  # max_grad_norm
ADAM_BETAS = [0.9, 0.999]  # adam_beta1, adam_beta2
ADAM_EPSILON = 1e-8
# The DeepSpeed schedulers that warm up to the job's rate -> the params each takes (as keywords) and, of those, the
# ones transformers fills in from the run (left out, DeepSpeed's defaults would train instead).
SCHEDULERS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    kind: (frozenset(f"warmup_num_steps warmup_type last_batch_iteration {taken}".split()), tuple(filled.split()))
    for kind, taken, filled in (
        ("WarmupLR", "warmup_min_lr warmup_max_lr", "warmup_max_lr warmup_num_steps"),
        (
            "WarmupDecayLR",
            "warmup_min_lr warmup_max_lr total_num_steps",
            "warmup_max_lr warmup_num_steps total_num_steps",
        ),
        ("WarmupCosineLR", "warmup_min_ratio cos_min_ratio total_num_steps", "warmup_num_steps total_num_steps"),
    )
}
# The fields the settings decide -> the setting to change (None: a Trainer default the job keeps).
OWNED = {
    "train_micro_batch_size_per_gpu": "PER_DEVICE_BATCH_SIZE (or GLOBAL_BATCH_SIZE)",
    "gradient_accumulation_steps": "GRADIENT_ACCUMULATION_STEPS (or GLOBAL_BATCH_SIZE)",
    "train_batch_size": "GLOBAL_BATCH_SIZE",
    "gradient_clipping": None,
    "bf16.enabled": "PRECISION",
    "fp16.enabled": "PRECISION",
    "optimizer.params.lr": "LEARNING_RATE",
    "optimizer.params.weight_decay": "WEIGHT_DECAY",
    "scheduler.params.warmup_max_lr": "LEARNING_RATE",
    "scheduler.params.warmup_num_steps": "WARMUP_RATIO (or MAX_STEPS)",
    "scheduler.params.total_num_steps": "MAX_STEPS",
}
# Other "auto" values the Trainer or Accelerate (the bucket sizes) fill in; any other reaches DeepSpeed as a string.
FILLED_ELSEWHERE = frozenset(
    "optimizer.params.betas optimizer.params.eps scheduler.params.warmup_min_lr zero_optimization.reduce_bucket_size "
    "zero_optimization.stage3_prefetch_bucket_size zero_optimization.stage3_param_persistence_threshold".split()
)
# ZERO_OFFLOAD -> (optimizer state on the CPU, weights on the CPU)
OFFLOADS = {"none": (False, False), "optimizer": (True, False), "optimizer+parameters": (True, True)}
OFFLOAD_SETTING = {where: setting for setting, where in OFFLOADS.items()}


def build_config(zero_stage: int, zero_offload: str) -> dict[str, Any]:
    """The config the job builds from ZERO_STAGE and ZERO_OFFLOAD; "auto" where the Trainer fills in the settings."""
    zero: dict[str, Any] = {"stage": zero_stage}
    for block, offloaded in zip(("offload_optimizer", "offload_param"), OFFLOADS[zero_offload], strict=True):
        if offloaded:
            zero[block] = {"device": "cpu", "pin_memory": True}
    if zero_stage == 3:
        # The job gathers the trainable weights itself (strategy.full_state_dict); the whole 16-bit model at every
        # checkpoint would cost the memory ZeRO-3 saves.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    return {
        **complete_config({}, "the job's config"),  # "auto" for every field the settings own
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,  # the Trainer logs the loss; DeepSpeed's own step lines would repeat it
        "wall_clock_breakdown": False,
    }


def read_deepspeed_config(path: str) -> dict[str, Any]:
    """DEEPSPEED_CONFIG parsed, its ZeRO block checked; a missing, unreadable or non-JSON file is bad input."""
    try:
        config = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        problem = f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    except json.JSONDecodeError as exc:
        problem = f"is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
    else:
        if isinstance(config, dict):
            check_zero(config, f"DEEPSPEED_CONFIG={path}")
            return config
        problem = f"holds a JSON {type(config).__name__}, not an object"
    raise BadInput(
        f"DEEPSPEED_CONFIG={path} {problem}; set DEEPSPEED_CONFIG to a readable ds_config.json, or unset it to let "
        "ZERO_STAGE and ZERO_OFFLOAD build one",
    )


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def owned_values(plan: Plan, weight_decay: float) -> dict[str, Any]:
    """Config field -> the plan's value (the precision and the step counts once known)."""
    rate = plan.learning_rate
    owned: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": plan.batch.micro_batch,
        "gradient_accumulation_steps": plan.batch.accumulation,
        "train_batch_size": plan.batch.global_batch,
        "gradient_clipping": GRADIENT_CLIPPING,
        "optimizer.params.lr": rate,
        "optimizer.params.betas": ADAM_BETAS,
        "optimizer.params.eps": ADAM_EPSILON,
        "optimizer.params.weight_decay": weight_decay,
        "scheduler.params.warmup_max_lr": rate,
    }
    if plan.max_steps:  # else the step counts follow the data set's size, known once it is loaded
        owned["scheduler.params.total_num_steps"] = plan.steps
        # At least 1, as the Trainer's DeepSpeed integration writes it.
        owned["scheduler.params.warmup_num_steps"] = max(1, plan.warmup_steps)
    if plan.precision != "auto":
        owned["bf16.enabled"] = plan.precision == "bf16"
        owned["fp16.enabled"] = plan.precision == "fp16"
    return owned


def check_config(config: Mapping[str, Any], plan: Plan, deepspeed_config: str, weight_decay: float) -> None:
    """Refuse DEEPSPEED_CONFIG's config where it pins a value the plan resolves otherwise, or cannot apply."""
    where = f"DEEPSPEED_CONFIG={deepspeed_config}"
    check_pinned(config, plan, deepspeed_config, weight_decay)
    check_scheduler(config, where)
    for path in _auto_paths(config):
        if path not in OWNED and path not in FILLED_ELSEWHERE:
            raise BadInput(
                f'{where} sets {path}: "auto", which neither the job nor the Trainer fills in (DeepSpeed would read '
                f'the word "auto" as its value); write a value for {path}, or drop it for DeepSpeed\'s default',
            )
    if "optimizer" in config and (plan.loraplus_ratio != 1 or plan.head_ratio != 1):
        raise BadInput(
            f"{where} has an optimizer block, which replaces the job's AdamW and with it the recipe's per-group rates "
            f"(LORAPLUS_LR_RATIO={plan.loraplus_ratio:g}, HEAD_LEARNING_RATE_RATIO={plan.head_ratio:g}); "
            "drop the optimizer block (the job's AdamW runs under DeepSpeed), or set both ratios to 1",
        )


def check_pinned(config: Mapping[str, Any], plan: Plan, deepspeed_config: str, weight_decay: float) -> None:
    """Refuse a value DEEPSPEED_CONFIG pins that the plan resolves otherwise: at --dry-run, and again in Job.start
    once the precision is known."""
    where = f"DEEPSPEED_CONFIG={deepspeed_config}"
    owned = owned_values(plan, weight_decay)
    for field in ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"):
        theirs = _get(config, field)
        if field not in owned and theirs not in (None, "auto"):
            raise BadInput(
                f"{where} pins {field}: {json.dumps(theirs)}, but without MAX_STEPS the run's step count follows the "
                f'data set\'s size, known only once it is loaded; write "auto" for {field} in the file (the job '
                "fills it in), or set MAX_STEPS",
            )
    for field, ours in owned.items():
        theirs = _get(config, field)
        if theirs not in (None, "auto") and not _same(theirs, ours):
            fix = f", or change {OWNED[field]}" if OWNED.get(field) else f" or {json.dumps(ours)}: the job's own value"
            raise BadInput(
                f"{where} pins {field}: {json.dumps(theirs)} but the job's settings resolve it to {json.dumps(ours)}; "
                f'write "auto" for {field} in the file (the job fills it in){fix}',
            )


def _same(theirs: Any, ours: Any) -> bool:
    # Equal as transformers compares them (a rate with fewer digits is another rate); a bool is no number here.
    if isinstance(ours, list):
        return isinstance(theirs, list) and len(theirs) == len(ours) and all(map(_same, theirs, ours))
    return isinstance(theirs, (int, float)) and isinstance(theirs, bool) == isinstance(ours, bool) and theirs == ours


def _auto_paths(config: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in config.items():
        if isinstance(value, Mapping):
            yield from _auto_paths(value, f"{prefix}{key}.")
        elif value == "auto":
            yield f"{prefix}{key}"


def check_zero(config: Mapping[str, Any], where: str) -> None:
    """The ZeRO stage and offload a file sets: ones STRATEGY=deepspeed trains with and ZERO_OFFLOAD can record."""
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise BadInput(
            f"{where} sets zero_optimization.stage: {json.dumps(stage)}; STRATEGY=deepspeed trains with ZeRO stage 1, 2 "
            'or 3: set "zero_optimization": {"stage": 2} (or 1, 3), or use STRATEGY=ddp for plain data parallelism',
        )
    optimizer_offloaded, parameters_offloaded = offloads(config)
    if parameters_offloaded and stage != 3:
        raise BadInput(
            f"{where} offloads the weights (zero_optimization.offload_param.device: "
            f"{_get(config, 'zero_optimization.offload_param.device')}) at stage {stage}, but only ZeRO stage 3 "
            "shards and offloads weights; set zero_optimization.stage to 3, or drop offload_param",
        )
    if parameters_offloaded and not optimizer_offloaded:
        raise BadInput(
            f"{where} offloads the weights (zero_optimization.offload_param) but not the optimizer state; offload "
            "both (add offload_optimizer with the same device: ZERO_OFFLOAD=optimizer+parameters), or drop offload_param",
        )


def check_scheduler(config: Mapping[str, Any], where: str) -> None:
    """A scheduler block DeepSpeed can build with the job's rate and step counts."""
    if "scheduler" not in config:
        return
    kind = _get(config, "scheduler.type")
    if kind not in SCHEDULERS:
        raise BadInput(
            f"{where} sets scheduler.type: {json.dumps(kind)}, which does not warm up to the job's learning rate; drop "
            f"the scheduler block (the job's linear warm-up by WARMUP_RATIO and decay), or use one of {', '.join(SCHEDULERS)}",
        )
    params = _get(config, "scheduler.params") or {}
    if not isinstance(params, Mapping):
        raise BadInput(f"{where} sets scheduler.params to a {type(params).__name__}; write an object")
    taken, _ = SCHEDULERS[kind]
    unknown = sorted(set(params) - taken)
    if unknown:
        raise BadInput(
            f"{where} gives the {kind} scheduler scheduler.params.{unknown[0]}, which it does not take; drop it (it takes "
            f"{', '.join(sorted(taken))})",
        )


def complete_config(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`config` with "auto" for the OWNED fields it leaves out (optimizer and scheduler ones only inside such a
    block), so the Trainer fills them in from the settings."""
    for block in ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16"):
        if block in config and not isinstance(config[block], Mapping):
            raise BadInput(
                f"{where} sets {block} to {json.dumps(config[block])}, where DeepSpeed reads an object; write "
                f'"{block}": {{...}}' + (' ({"enabled": "auto"} for the job\'s PRECISION)' if "16" in block else ""),
            )
    if "bfloat16" in config:  # DeepSpeed's older name, which transformers does not check against PRECISION
        raise BadInput(f'{where} sets "bfloat16"; rename it to "bf16" ({{"enabled": "auto"}} follows PRECISION)')
    completed = copy.deepcopy(dict(config))
    scheduled = SCHEDULERS.get(_get(completed, "scheduler.type"), ((), ()))[1]
    for field in OWNED:
        *parents, leaf = field.split(".")
        block = field.split(".")[0]
        if (block == "optimizer" and block not in completed) or (block == "scheduler" and leaf not in scheduled):
            continue
        holder = completed
        for part in parents:
            holder = holder.setdefault(part, {})
            if not isinstance(holder, dict):
                break
        else:
            holder.setdefault(leaf, "auto")
    return completed


def with_deepspeed(
    plan: Plan, file: Mapping[str, Any] | None, deepspeed_config: str | None, weight_decay: float
) -> Plan:
    """The plan with the DeepSpeed config the run hands the Trainer, for STRATEGY=deepspeed: DEEPSPEED_CONFIG's `file`
    as DeepSpeedChoices read it, completed and checked against the plan."""
    if plan.strategy != "deepspeed":
        return plan
    if importlib.util.find_spec("deepspeed") is None:
        raise BadInput(
            f"STRATEGY=deepspeed needs the deepspeed package, which is not installed; pip install {DEEPSPEED_PIN} "
            "(DS_BUILD_OPS=0: its ops compile on first use), or use STRATEGY=ddp",
        )
    if deepspeed_config is None:
        return replace(plan, deepspeed=build_config(plan.zero_stage, plan.zero_offload))
    config = complete_config(file, f"DEEPSPEED_CONFIG={deepspeed_config}")
    check_config(config, plan, deepspeed_config, weight_decay)
    return replace(plan, deepspeed=config)


def zero_stage(config: Mapping[str, Any]) -> int:
    return int(_get(config, "zero_optimization.stage") or 0)


def offloads(config: Mapping[str, Any]) -> tuple[bool, bool]:
    """(optimizer state on the host, weights on the host) in `config`."""
    return (
        _get(config, "zero_optimization.offload_optimizer.device") not in (None, "none"),
        _get(config, "zero_optimization.offload_param.device") not in (None, "none"),
    )


def describe_strategy(plan: Plan, weight_decay: float) -> dict[str, Any]:
    """--dry-run's view: the strategy, and for deepspeed the config with the plan's values filled in as known."""
    if plan.deepspeed is None:
        return {"strategy": plan.strategy}
    config = copy.deepcopy(plan.deepspeed)
    for field, value in owned_values(plan, weight_decay).items():
        parent, _, leaf = field.rpartition(".")
        holder = _get(config, parent) if parent else config
        if isinstance(holder, dict) and holder.get(leaf) == "auto":
            holder[leaf] = value
    return {"strategy": "deepspeed", "deepspeed": config}


# ------------------------------------------------------------------------------- what the launcher and the file choose
def check_launcher(strategy: str, launcher: Mapping[str, object]) -> None:
    """What makes Accelerate drop or mix a strategy without a word: refused (exit 2) before anything loads."""
    if launcher.get("fsdp"):
        raise BadInput(
            f"the accelerate config asks for FSDP (ACCELERATE_USE_FSDP=true) while STRATEGY={strategy}; one run "
            "shards one way, and the job sets FSDP up itself: launch with a MULTI_GPU config "
            "(launchers/accelerate/multi-gpu.yaml) and set STRATEGY=fsdp",
        )
    if launcher.get("cpu") and strategy == "deepspeed":
        raise BadInput(
            "ACCELERATE_USE_CPU=true (accelerate launch --cpu, use_cpu: true) makes Accelerate drop DeepSpeed without "
            "a warning and train plain DDP; launch without --cpu (use_cpu: false): on a machine without CUDA the job "
            "runs DeepSpeed on the CPU by itself",
        )


def launcher_choices(launcher: Mapping[str, object]) -> dict[str, Any]:
    """The settings an `accelerate launch` DeepSpeed config stands for: STRATEGY=deepspeed, and DEEPSPEED_CONFIG, or
    ZERO_STAGE and ZERO_OFFLOAD (distributed.export_env then drops the launcher's variables)."""
    if not launcher.get("deepspeed"):
        return {}
    if launcher.get("deepspeed_config_file"):
        return {"strategy": "deepspeed", "deepspeed_config": str(launcher["deepspeed_config_file"])}
    devices = (launcher.get("offload_optimizer_device"), launcher.get("offload_param_device"))
    if "nvme" in devices:
        raise BadInput(
            "the accelerate config offloads to NVMe, which ZERO_OFFLOAD does not set up; write the offload into a "
            "ds_config.json and pass it as DEEPSPEED_CONFIG (deepspeed_config_file in the accelerate config)",
        )
    on_cpu = tuple(device == "cpu" for device in devices)
    if on_cpu == (False, True):
        raise BadInput(
            "the accelerate config offloads the weights but not the optimizer state; set "
            "offload_optimizer_device: cpu too (ZERO_OFFLOAD=optimizer+parameters), or offload_param_device: none",
        )
    chosen: dict[str, Any] = {"strategy": "deepspeed"}
    if any(devices):
        chosen["zero_offload"] = OFFLOAD_SETTING[on_cpu]
    if launcher.get("zero_stage") is not None:
        chosen["zero_stage"] = launcher["zero_stage"]
    return chosen


class DeepSpeedChoices:
    """load_settings' `overrides` (deepspeed_overrides), keeping the DEEPSPEED_CONFIG it read in `file` for the
    plan: the file is read and checked once, as the settings are read."""

    def __init__(self, launcher: Mapping[str, object]):
        self.launcher = launcher
        self.file: dict[str, Any] | None = None

    def __call__(self, settings: Settings) -> dict[str, Any]:
        chosen, self.file = deepspeed_overrides(settings, self.launcher)
        return chosen


def deepspeed_overrides(
    settings: Settings, launcher: Mapping[str, object]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What the accelerate config (`launcher_choices`) and then DEEPSPEED_CONFIG's ZeRO stage and offload choose, as
    settings load_settings merges over the user's (one given beside them that differs: exit 2), with the file as
    read (None when there is none)."""
    check_launcher(settings.strategy, launcher)
    chosen = launcher_choices(launcher)
    explicit = settings.given
    for name, value in chosen.items():
        if name in explicit and getattr(settings, name) != value:
            raise BadInput(
                f"the accelerate config asks for DeepSpeed with {name} {value} but {name.upper()}={getattr(settings, name)}; "
                f"the two must agree: set {name.upper()}={value}, unset it, or launch with another accelerate config",
            )
    path = chosen.get("deepspeed_config", settings.deepspeed_config)
    if chosen.get("strategy", settings.strategy) != "deepspeed" or path is None:
        return chosen, None
    where = f"DEEPSPEED_CONFIG={path}"
    config = read_deepspeed_config(path)
    by_file = {"zero_stage": zero_stage(config), "zero_offload": OFFLOAD_SETTING[offloads(config)]}
    what = {
        "zero_stage": "ZeRO stage {} (zero_optimization.stage)",
        "zero_offload": "offload {} (zero_optimization.offload_optimizer and offload_param)",
    }
    for name, value in by_file.items():
        ours = chosen.get(name, getattr(settings, name))
        if (name in explicit or name in chosen) and ours != value:
            who = "the accelerate config asks for " if name in chosen else ""
            raise BadInput(
                f"{who}{name.upper()}={ours} but {where} sets {what[name].format(value)}; the file decides what "
                f"trains: unset {name.upper()} (or set it to {value}), or change the file",
            )
    return {**chosen, **by_file}, config
