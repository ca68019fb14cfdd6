"""LoRA fine-tuning of BERT on GLUE SST-2: one script for one process, N replicas, or any launcher.

Every replica runs this file: it works out its rank from whatever started it, trains with the HF Trainer, and
rank 0 writes the model to OUTPUT_DIR and pushes it to RESULT_MODEL_ID.

Launch it:
    python main.py                                   # one process (one GPU: 8-bit LoRA)
    python main.py --dry-run                         # resolved settings, ranks and plan as JSON; imports no torch
    python main.py --config recipes/sst2.yaml        # settings from a recipe file (the environment and flags win)
    docker run --gpus 1 ... IMAGE [--flags]          # single-GPU fallback (docs/deploying.md)
    # managed platform, replicas: 4 (config.yaml): the platform sets RANK, WORLD_SIZE, NODE_RANK,
    #   MASTER_ADDR, MASTER_PORT on each replica and runs `python main.py`
    kubectl apply -k k8s/                            # Kubeflow PyTorchJob, Master 1 + Worker 3
    kubectl apply -k k8s/multi-gpu-per-pod/          # PyTorchJob, 2 pods x 4 GPUs: torchrun in each pod
    kubectl apply -k k8s/trainer-v2/                 # Kubeflow Trainer v2 TrainJob (torch-distributed runtime)
    torchrun --nnodes 1 --nproc-per-node 4 main.py   # several GPUs on one machine
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr HOST0 --master-port 29500 main.py
                                                     # ... and --node-rank 1 on the second machine
    accelerate launch --config_file launchers/accelerate/multi-gpu.yaml main.py
    accelerate launch --config_file launchers/accelerate/multi-node.yaml --machine_rank 0 \
        --main_process_ip HOST0 --main_process_port 29500 main.py      # ... --machine_rank 1 on the second
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python main.py   # by hand, as the platform does
    srun python main.py                              # Slurm: one task per GPU (SLURM_* variables)
    python launchers/slurm/render_sbatch.py --nodes 2 --gpus-per-node 4 -o job.sbatch && sbatch job.sbatch
    python launchers/slurm/submit.py --nodes 2 --gpus-per-node 4     # Slurm from Python (submitit)
    STRATEGY=fsdp torchrun --nproc-per-node 4 main.py                 # FSDP instead of DDP (CUDA GPUs only)
    STRATEGY=deepspeed ZERO_STAGE=2 torchrun --nproc-per-node 4 main.py   # DeepSpeed ZeRO (docs/launchers.md)
    STRATEGY=deepspeed ZERO_STAGE=3 deepspeed --num_gpus 4 main.py        # the same under the deepspeed launcher
    accelerate launch --config_file launchers/accelerate/deepspeed-zero3.yaml main.py   # ZeRO-3 from accelerate
    STRATEGY=deepspeed ZERO_OFFLOAD=optimizer python main.py          # one GPU, optimizer state in host memory
    python main.py --push-only                       # upload an existing OUTPUT_DIR/model again

Exit codes: 0 done (or already done), 2 bad input/settings/credentials or an unreachable Hub (do not restart),
3 trained but the push failed (run --push-only), 143 preempted or a peer lost (restart all: it resumes),
130 interrupted with Ctrl-C (checkpointed: run again to resume), 1 unexpected.
"""

import argparse
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict

from utils.cluster.preemption import Preemption
from utils.common.errors import EXIT_UNEXPECTED, JobError, Preempted, stage
from utils.common.hub_token import install_masking
from utils.config.deepspeed_config import DeepSpeedChoices, describe_strategy, with_deepspeed
from utils.config.distributed import DistEnv, detect_env, elastic_range, launcher_argv, launcher_options
from utils.config.local_inputs import LocalData, check_dataset, check_model_folder, test_split_file
from utils.config.plan import Plan, batch_warning, build_plan, check_elastic_range
from utils.config.preflight import check_push_possible, check_trackers
from utils.config.settings import Settings
from utils.config.sources import load_settings
from utils.config.tasks import describe_task
from utils.run_folder.checkpoints import volume_fault
from utils.run_folder.layout import check_output_writable
from utils.run_folder.record import check_run_dir, discard_unused_claim, open_run_dir


def configure(argv: list[str] | None = None) -> tuple[Settings, DistEnv, argparse.Namespace, Plan]:
    """Everything decided before torch is imported, on every rank alike (settings: defaults < recipe < env < flags),
    and every check that needs neither torch nor the network."""
    deepspeed = DeepSpeedChoices(launcher_options())  # reads DEEPSPEED_CONFIG, once, as the settings are read
    settings, args = load_settings(launcher_argv(argv), overrides=deepspeed)  # less `deepspeed`'s --local_rank
    dist = detect_env()
    if elastic := elastic_range():
        check_elastic_range(settings, *elastic)
    plan = with_deepspeed(  # DeepSpeed: checked
        build_plan(settings, dist.world_size, deepspeed.file),
        deepspeed.file,
        settings.deepspeed_config,
        settings.weight_decay,
    )
    check_push_possible(settings, plan.base_model_id)
    check_trackers(settings.report_to)
    return settings, dist, args, plan


def dry_run(settings: Settings, dist: DistEnv, plan: Plan, push_only: bool) -> int:
    """`--dry-run`: the run's first local-disk checks, by the same functions, so the same line comes before pods are
    scheduled; then the resolved view on stdout (no network)."""
    check_run_dir(settings.output_dir, plan, settings.given_label_names, settings.base_model_id, push_only=push_only)
    check_output_writable(settings.output_dir)
    if not push_only:  # a push of the saved model reads neither the base model nor the data
        check_model_folder(settings.model_name)
        check_dataset(settings.select(LocalData))
    if warning := batch_warning(plan.batch, settings.global_batch_size, settings.per_device_batch_size):
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(dry_run_view(settings, dist, plan), indent=2))
    return 0


def dry_run_view(settings: Settings, dist: DistEnv, plan: Plan) -> dict:
    """What --dry-run prints: the settings as given (RUN_NAME as derived), the ranks, and what the run derives."""
    return {
        "config": {**settings.as_dict(), "run_name": plan.run_name},
        "distributed": dist.as_dict(),
        "plan": plan.as_dict(),  # what the run trains with; run.json records it completed
        "identity": plan.identity,  # what makes a restart the same run (utils/config/identity.py)
        "batch": asdict(plan.batch),
        "task": describe_task(settings),  # columns, labels, problem type, metrics
        # The file answered into OUTPUT_DIR/predictions/ once trained (TEST_FILE, or test.* in DATASET_PATH)
        "test_split": str(test) if (test := test_split_file(settings.dataset_path, settings.test_file)) else None,
        **describe_strategy(plan, settings.weight_decay),  # DeepSpeed: the config with the plan's values
    }


def masking(argv: list[str] | None):
    """The token masked on stdout and stderr from here on; a malformed one refused, except for --help (None then)."""
    try:
        return install_masking()
    except JobError:
        if not asks_for_help(argv):
            raise
        return None


def asks_for_help(argv: list[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    args = args[: args.index("--")] if "--" in args else args
    return any(arg in ("-h", "--help") for arg in args)


def main(
    argv: list[str] | None = None,
    *,
    before_training: Callable[[object], None] | None = None,
    refused: Callable[[JobError], None] | None = None,
) -> int:
    """The job: its exit code. `before_training` (given what the start-up built, where training would begin) and
    `refused` (given the JobError reported) let tests/support/harness.py run the start-up in the tests' own process,
    stop it at the first training step and learn which part refused (JobError.stage), without patching the job."""
    run_dir, created = None, False
    try:
        preemption = Preemption()
        preemption.install()  # before the heavy imports: SIGTERM during them must still end in 143
        with stage("settings"):
            masker = masking(argv)
            settings, dist, args, plan = configure(argv)
        if args.dry_run:  # every check above and this one need neither the network nor torch
            return dry_run(settings, dist, plan, push_only=args.push_only)
        # A start refused from here on removes the folder it made, if it left it as made (discard_unused_claim).
        created = not os.path.lexists(settings.output_dir)
        with stage("output"):
            run_dir = open_run_dir(
                settings.output_dir, plan, settings.given_label_names, settings.base_model_id, args.push_only
            )
        from utils.cluster.job import Job, PlanInputs  # torch: a second to import

        with stage("device"):  # the device and numerics
            inputs = settings.select(PlanInputs)
            job = Job.start(settings, inputs, dist, run_dir, plan, preemption=preemption, masker=masker)
        job.leave_unused_libraries_out()  # DeepSpeed and bitsandbytes only for a run that uses them
        from utils.run import publish_only, run  # transformers, peft: seconds to import

        # Frozen, the imports' millions of objects are out of each collection's walk (a fifth of a short run's CPU).
        gc.freeze()
        return publish_only(job) if args.push_only else run(job, before_training)
    except JobError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if refused is not None:
            refused(exc)
        if run_dir is not None and created:
            discard_unused_claim(run_dir)
        return exc.code
    except Preempted as exc:
        print(
            f"preempted: {exc.message}; exit {exc.code} so the orchestrator restarts the job",
            file=sys.stderr,
            flush=True,
        )
        return exc.code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # A full or read-only OUTPUT_DIR outside a checkpoint save (the final model, run.json): one line, exit 2.
        fault = volume_fault(run_dir, exc, "writing to it") if run_dir is not None else None
        if fault is not None:
            print(f"error: {fault.message}", file=sys.stderr)
            return fault.code
        traceback.print_exc()  # an unexpected error is a bug to report
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
