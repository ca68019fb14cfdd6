"""The katib backend: a Katib Experiment (kubeflow.org/v1beta1) whose trial is k8s/pytorchjob.yaml as deployed,
each container's `env` holding the trial's settings (the swept ones `${trialParameters.NAME}`). Katib picks the
values (grid or random) and reads the metric from rank 0's last stdout line, the task's headline
(`eval_accuracy=0.9967`); it wraps the container's command to do so, so the template names the image's command.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

from utils.config.settings import env_name
from utils.config.tasks import headline
from utils.sweeps.spec import Range, Spec, Trial, refused, setting_value

REPO = Path(__file__).resolve().parents[2]
PYTORCHJOB = REPO / "k8s" / "pytorchjob.yaml"
# A Kubernetes object name (DNS-1123 label): Katib names the trials' jobs after the Experiment.
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# name=value pairs of the final line; the name group keeps the eval_ prefix the job writes
METRICS_FORMAT = r"(eval_\w+)=([-+]?\d*\.?\d+(?:[eE][-+]?\d+)?)"
# the Dockerfile's ENTRYPOINT, less dumb-init (Katib's wrapper is PID 1's child)
IMAGE_COMMAND = ["python", "/app/main.py"]


def katib_parameter(name: str, space) -> dict:
    if not isinstance(space, Range):
        return {"name": name, "parameterType": "categorical", "feasibleSpace": {"list": [*map(setting_value, space)]}}
    feasible = {"min": str(space.low), "max": str(space.high)} | ({"distribution": "logUniform"} if space.log else {})
    return {"name": name, "parameterType": "int" if space.type == "int" else "double", "feasibleSpace": feasible}


def trial_job(spec: Spec) -> dict:
    job = yaml.safe_load(PYTORCHJOB.read_text())
    job["metadata"] = {"labels": job["metadata"].get("labels", {})}  # Katib names each trial's job after the trial
    # a trial's settings as every backend builds them, Katib filling in the values and the trial's name
    env = spec.trial_env(Trial(0, "${trialSpec.Name}", {name: f"${{trialParameters.{name}}}" for name in spec.swept}))
    env.setdefault("RUN_NAME", "${trialSpec.Name}")
    # Blank (unset to the job) over the ConfigMap's: a trial pushes only where the spec's push: says.
    env.setdefault("RESULT_MODEL_ID", "")
    env["RESULT_MERGED_MODEL_ID"] = ""
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        for container in replica["template"]["spec"]["containers"]:
            container["command"] = IMAGE_COMMAND
            kept = [var for var in container.get("env", []) if var["name"] not in env]
            container["env"] = kept + [{"name": name, "value": value} for name, value in env.items()]
    return job


def render_experiment(spec: Spec, trial_count: int) -> dict:
    if not K8S_NAME.fullmatch(spec.name):
        raise refused(
            f"name={spec.name!r} is not a Kubernetes name (lowercase letters, digits and '-', at most 63, a letter or "
            "digit at each end); Katib names the Experiment and its trials after it: write e.g. name: sst2-sweep"
        )
    printed = [key for key in spec.metric_keys if headline({key: 0.0})]  # as the job's last stdout line names them
    if spec.metric_key not in printed:
        use = " or ".join(f"metric: {key.removeprefix('eval_')}" for key in printed)
        raise refused(
            f"metric={spec.metric}: Katib reads the objective from the job's last stdout line, which reports "
            f"{', '.join(printed)} for this task; use {use} for backend: katib, or the local or slurm backend"
        )
    # the same metric on the task's other validation splits (MNLI's mismatched), recorded beside the objective
    others = [key for key in spec.metric_splits if key != spec.metric_key and key in printed]
    algorithm = {"algorithmName": "grid" if spec.grid else "random"}
    if spec.random:
        algorithm["algorithmSettings"] = [{"name": "random_state", "value": str(spec.seed)}]
    return {
        "apiVersion": "kubeflow.org/v1beta1",
        "kind": "Experiment",
        "metadata": {"name": spec.name, "labels": {"app.kubernetes.io/name": "sst2-lora"}},
        "spec": {
            "objective": {
                "type": spec.direction,
                "objectiveMetricName": spec.metric_key,
                **({"additionalMetricNames": others} if others else {}),
            },
            "algorithm": algorithm,
            "parallelTrialCount": spec.parallel,
            "maxTrialCount": trial_count,
            "maxFailedTrialCount": trial_count,  # a failed trial is recorded and the others go on
            "parameters": [katib_parameter(name, space) for name, space in {**spec.grid, **spec.random}.items()],
            "metricsCollectorSpec": {
                "collector": {"kind": "StdOut"},
                "source": {"filter": {"metricsFormat": [METRICS_FORMAT]}},
            },
            "trialTemplate": {
                "primaryContainerName": "pytorch",
                "primaryPodLabels": {"training.kubeflow.org/job-role": "master"},  # rank 0 prints the metric
                "successCondition": 'status.conditions.#(type=="Succeeded")#|#(status=="True")#',
                "failureCondition": 'status.conditions.#(type=="Failed")#|#(status=="True")#',
                "trialParameters": [
                    {"name": name, "reference": name, "description": f"{env_name(name)} of the job"}
                    for name in spec.swept
                ],
                "trialSpec": trial_job(spec),
            },
        },
    }


class QuotingDumper(yaml.SafeDumper):
    """Quotes every string a YAML 1.2 reader (kubectl's) takes for a number: PyYAML (1.1) leaves `1e-05` bare."""

    def represent_str(self, value: str):
        return self.represent_scalar("tag:yaml.org,2002:str", value, style="'" if NUMBER.match(value) else None)


NUMBER = re.compile(r"^[-+]?(\.\d+|\d+(\.\d*)?)([eE][-+]?\d+)?$")
QuotingDumper.add_representer(str, QuotingDumper.represent_str)


def write_experiment(spec: Spec, trial_count: int, path: Path | None) -> None:
    """The Experiment as YAML to `path`, under a header saying how to create it, or to standard output."""
    text = yaml.dump(render_experiment(spec, trial_count), Dumper=QuotingDumper, sort_keys=False, width=120)
    if path is None:
        sys.stdout.write(text)
        return
    header = (
        f"# Katib Experiment of the sweep {spec.path.name}, rendered by `python sweep.py SPEC -o FILE` (docs/sweeps.md).\n"
        "# Its trials use the job's ConfigMap and PVC (`kubectl apply -k k8s/base`) and the hf-token Secret;\n"
        "# create it with `kubectl apply -f FILE`.\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + text)
    print(f"wrote {path}; create it with: kubectl apply -f {path}", file=sys.stderr)
