"""The deployment readers: the Dockerfile, the k8s manifests and kustomizations, and the vendored Kubeflow CRD
schemas (tests/schemas) the manifests are checked against."""

from __future__ import annotations

import copy
import os
import shlex
from functools import cache
from pathlib import Path
from unittest import mock

import yaml

from tests.support.env import FAKE_TOKEN, REPO

K8S = REPO / "k8s"
DOCKERFILE = REPO / "Dockerfile"
SCHEMAS = REPO / "tests" / "schemas"  # the Kubeflow CRDs, vendored (their source in the README beside them)


@cache
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    lines, parts = [], []
    for stripped in (raw.strip() for raw in DOCKERFILE.read_text().splitlines()):
        if stripped and not stripped.startswith("#"):
            parts.append(stripped.removesuffix("\\").strip())
            if not stripped.endswith("\\"):
                lines.append(" ".join(parts))
                parts = []
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def docker_env() -> dict[str, str]:
    """The image's ENV."""
    env = {}
    for instruction, args in dockerfile():
        if instruction == "ENV":
            env.update(dict(item.split("=", 1) for item in shlex.split(args)))
    return env


def docker_user() -> tuple[int, int]:
    """The image's USER as (uid, gid)."""
    users = [args for instruction, args in dockerfile() if instruction == "USER"]
    assert users, "the Dockerfile sets no USER: the job would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), f"USER {users[-1]}: give a numeric uid:gid, so runAsNonRoot can verify it"
    return int(uid), int(gid)


def shared_output_dir() -> str:
    """OUTPUT_DIR's default where the shared volume is mounted, as the code computes it."""
    from utils.config.settings import SHARED_VOLUME, default_output_dir

    real_isdir = os.path.isdir
    with mock.patch("os.path.isdir", lambda path: path == SHARED_VOLUME or real_isdir(path)):
        return default_output_dir()


def yaml_docs(path: Path) -> list[dict]:
    # libyaml: the vendored CRDs (2 MB) took 10 s in Python.
    return [doc for doc in yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader) if doc]


def load_manifest(path: Path) -> dict:
    """A manifest file holding one document."""
    documents = yaml_docs(path)
    assert len(documents) == 1, path
    return documents[0]


def kustomize(folder: Path) -> list[dict]:
    """What `kubectl apply -k folder` creates: the resources of its kustomization, folders recursively."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    out = []
    for entry in kustomization.get("resources", []):
        target = (folder / entry).resolve()
        out += kustomize(target) if target.is_dir() else yaml_docs(target)
    return out


def config_maps(docs: list[dict]) -> dict[str, dict[str, str]]:
    """The ConfigMaps among `docs`: name -> data."""
    return {doc["metadata"]["name"]: doc.get("data", {}) for doc in docs if doc.get("kind") == "ConfigMap"}


def container_env(container: dict, configmaps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The variables the kubelet gives a container: the image's ENV < envFrom ConfigMaps < `env` (which wins);
    ConfigMap keys resolved from `configmaps` (name -> data), Secret keys to FAKE_TOKEN (it must come back masked)."""
    env = docker_env()
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        value_from = var.get("valueFrom", {})
        ref = value_from.get("configMapKeyRef")
        if "value" in var:
            env[var["name"]] = var["value"]
        elif ref and ref["key"] in configmaps.get(ref["name"], {}):
            env[var["name"]] = configmaps[ref["name"]][ref["key"]]
        elif "secretKeyRef" in value_from:
            env[var["name"]] = FAKE_TOKEN
    return env


def strict(schema):
    """An openAPIV3Schema with unknown fields made errors, as the API server's pruning would drop them silently."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict schema, for every CRD vendored in tests/schemas."""
    found = {}
    for path in sorted(SCHEMAS.glob("*.yaml")):
        for crd in yaml_docs(path):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                found[key] = strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return found


def crd_schema(api_version: str, kind: str) -> dict:
    """The strict schema of one custom resource, from the vendored CRDs."""
    schemas = crd_schemas()
    assert (api_version, kind) in schemas, f"no CRD for {api_version} {kind} in {SCHEMAS}"
    return schemas[(api_version, kind)]


def schema_errors(schema: dict, document: dict) -> list[str]:
    """Every way `document` breaks `schema`, as `path: message` (a message that quotes a whole object, cut short)."""
    import jsonschema

    return [
        f"{'/'.join(map(str, error.absolute_path)) or '/'}: {error.message[:300]}"
        for error in jsonschema.Draft7Validator(schema).iter_errors(document)
    ]
