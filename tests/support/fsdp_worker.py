"""One rank of the CPU FSDP check (tests/test_strategy.py starts two under torchrun, gloo).

Accelerate never applies FSDP on the CPU (the trap STRATEGY=fsdp guards against), so this runs the FSDP2
preparation the Trainer's Accelerator runs on GPUs, `fsdp2_prepare_model`, with the plugin built from the
job's own TrainingArguments (utils/training/strategy.trainer_options), on the job's LoRA model (utils/training/model.build_model).
Then the parts of the job that must work on sharded weights: the wrap check, training steps with the job's
fused AdamW, the gathered checksum, and the gathered save of the adapter.

    torchrun --nproc-per-node 2 tests/support/fsdp_worker.py MODEL_DIR RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils.fsdp_utils import fsdp2_prepare_model  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from utils.common.errors import JobError  # noqa: E402
from utils.config.settings import Settings  # noqa: E402
from utils.training.model import (  # noqa: E402
    ModelChoices,  # noqa: E402
    build_model,
    trainable_checksum,
)
from utils.training.strategy import count_fsdp_units, full_state_dict, trainer_options  # noqa: E402
from utils.training.trainer import StrategyCheck  # noqa: E402


def main(model_dir: str, results: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    settings = Settings(model_name=model_dir, strategy="fsdp", output_dir=str(results))
    torch.manual_seed(0)  # the same LoRA init on both ranks, as set_seed does in the job
    model = build_model(settings.select(ModelChoices), "none", torch.device("cpu"))
    options = trainer_options(settings.strategy, model)
    args = TrainingArguments(output_dir=str(results / "trainer"), use_cpu=True, report_to="none", **options)

    refused = None
    try:  # before sharding: the check must stop a plain model
        StrategyCheck("fsdp").on_train_begin(args, None, None, model=model)
    except JobError as exc:
        refused = (exc.code, exc.message)

    # What Accelerator.prepare does for FSDP2 on GPUs; the stand-in carries only what it reads.
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    state = types.SimpleNamespace(fsdp_plugin=plugin)
    cpu = dict(device=torch.device("cpu"), torch_device_mesh=None, parallelism_config=None, mixed_precision="no")
    accelerator = types.SimpleNamespace(state=state, is_main_process=rank == 0, **cpu)
    model = fsdp2_prepare_model(accelerator, model)
    StrategyCheck("fsdp").on_train_begin(args, None, None, model=model)  # must not raise now

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, fused=True)  # the job's optim="adamw_torch_fused"
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batches, as DDP/FSDP samplers give
    for _ in range(3):
        ids, labels = (
            torch.randint(5, 60, (8, 12), generator=generator),
            torch.randint(0, 2, (8,), generator=generator),
        )
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    checksum = trainable_checksum(model)  # gathers the shards: a collective on every rank
    state = full_state_dict(model, "fsdp")  # whole weights on rank 0, nothing elsewhere
    report = {
        "rank": rank,
        "refused_unsharded": refused,
        "units": count_fsdp_units(model),
        "sharded_trainable": sorted({type(p).__name__ for p in trainable}),
        "local_numel": sum(p.to_local().numel() for p in trainable),
        "full_numel": sum(p.numel() for p in trainable),
        "checksum": checksum,
        "state_keys": len(state),
    }
    if rank == 0:
        model.save_pretrained(results / "adapter", state_dict=state)  # what utils/publishing/hub.save_model does
        lora = {name: tensor for name, tensor in state.items() if "lora_" in name}
        report["lora_b_trained"] = all(float(t.abs().sum()) > 0 for name, t in lora.items() if "lora_B" in name)
        report["gathered_lora"] = {name: tensor.tolist() for name, tensor in lora.items()}
    (results / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
