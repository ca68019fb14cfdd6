"""How the model is spread over the ranks: STRATEGY=ddp (the default: BERT-base LoRA fits one GPU many times
over), fsdp (FSDP2, one unit per transformer block, for a base too big for one GPU) or deepspeed (ZeRO, which
also runs on the CPU; config: utils/config/deepspeed_config.py).

The trap: the Trainer and Accelerate drop FSDP without a word on the CPU and on one process. So `check_strategy`
refuses those before anything loads, and the Trainer's `StrategyCheck` callback stops a run whose model is not
really FSDP-wrapped (`count_fsdp_units`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from utils.common.errors import BadInput
from utils.config.distributed import DistEnv
from utils.config.settings import runs_under


def check_strategy(
    strategy: str,
    quantization: str,
    dist: DistEnv,
    cuda: bool,
    quantize: bool,
    precision: str,
    launcher: Mapping[str, object],
) -> None:
    """Refuse (exit 2, on every rank alike) what would silently train differently from what was asked; an
    accelerate config's precision (`launcher`) waits here for PRECISION to resolve."""
    mixed = launcher.get("mixed_precision")
    if mixed and mixed != "no" and mixed != precision:
        raise BadInput(
            f"the accelerate config sets mixed_precision: {mixed} but PRECISION resolves to {precision}; the job's PRECISION "
            f"decides: set PRECISION={mixed}, or mixed_precision: 'no' in the config",
        )
    if strategy != "fsdp":
        return
    if not cuda:
        raise BadInput(
            "STRATEGY=fsdp needs CUDA GPUs: on the CPU the Trainer and Accelerate drop FSDP without a warning and train "
            "plain DDP instead; use STRATEGY=ddp here",
        )
    if dist.world_size < 2:
        raise BadInput(
            "STRATEGY=fsdp shards the model across processes, but this job is one process (world size 1), where the "
            "Trainer trains without FSDP; use STRATEGY=ddp, or start one process per GPU (torchrun --nproc-per-node N)",
        )
    if quantize and not runs_under(strategy, "quantized weights"):
        raise BadInput(
            f"QUANTIZATION={quantization if quantization != 'auto' else '8bit'} cannot be combined "
            "with STRATEGY=fsdp: FSDP cannot shard "
            "bitsandbytes' quantized weights; use QUANTIZATION=none (or auto) with fsdp",
        )


def wrap_classes(model: torch.nn.Module) -> list[str]:
    """FSDP's units: the repeated blocks (an nn.ModuleList's items) also in `_no_split_modules` (BERT: BertLayer).
    Not all of those: BERT lists BertEmbeddings, and Accelerate shards the input embedding as a unit of its own."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lists = (module for module in base.modules() if isinstance(module, torch.nn.ModuleList))
    repeated = {type(block).__name__ for blocks in lists for block in blocks}
    declared = set(getattr(base, "_no_split_modules", None) or [])
    names = sorted(repeated & declared if declared else repeated)
    if not names:
        raise BadInput(
            f"{type(base).__name__} has no repeated transformer blocks to shard (no nn.ModuleList of {sorted(declared) or 'blocks'}), "
            "so STRATEGY=fsdp cannot choose its units; use STRATEGY=ddp for this model",
        )
    return names


def trainer_options(
    strategy: str, model: torch.nn.Module, deepspeed: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """TrainingArguments for the strategy: nothing extra for DDP; FSDP2 wrapping per transformer block for fsdp;
    for deepspeed the plan's config `deepspeed`, copied: the Trainer fills in its "auto" values in place."""
    if strategy == "deepspeed":
        return {"deepspeed": copy.deepcopy(deepspeed)}
    if strategy != "fsdp":
        return {}
    return {
        "fsdp": True,
        "fsdp_config": {
            "version": 2,  # per-parameter sharding: LoRA's trainable and the frozen weights can share a unit
            "transformer_layer_cls_to_wrap": wrap_classes(model),  # BERT: BertLayer
            "reshard_after_forward": True,  # full sharding (ZeRO-3 like): the point of FSDP is the memory
            "state_dict_type": "FULL_STATE_DICT",  # checkpoints hold whole tensors: resumable on another GPU count
            "cpu_ram_efficient_loading": False,  # every rank loads the (small) base model itself
        },
    }


def count_fsdp_units(model: torch.nn.Module) -> int:
    """How many modules FSDP wraps (FSDP2's fully_shard, or the older wrapper class)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return sum(isinstance(module, (FSDPModule, FullyShardedDataParallel)) for module in model.modules())


def full_state_dict(model: torch.nn.Module, strategy: str) -> dict[str, torch.Tensor] | None:
    """The whole weights for saving; a collective, on every rank. FSDP: held on rank 0 (CPU). DeepSpeed: the
    trainable ones in fp32 from the optimizer's copy (the module's is bf16, and empty under ZeRO-3 outside a
    forward). DDP: None (each rank holds them)."""
    if strategy == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        weights = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                full = safe_get_full_fp32_param(param)
                weights[name] = (param if full is None else full).detach().float().cpu().clone()
        empty = sorted(name for name, tensor in weights.items() if tensor.numel() == 0)
        if empty:
            raise RuntimeError(f"DeepSpeed returned {len(empty)} trainable weight(s) empty, e.g. {empty[0]}")
        return weights
    if strategy != "fsdp":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
