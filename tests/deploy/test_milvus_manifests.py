"""Offline checks of deploy/k8s/milvus: msn-serve replicas with no index volume, on a Milvus cluster.

As for the base manifests (test_manifests.py): the kustomization is rendered by the real ``kubectl kustomize`` and
every object validated strictly. Milvus itself comes from its Helm chart or its operator, neither of which runs here:
the chart's values file and the operator's ``Milvus`` object are checked structurally, and both must name the Service
msn-serve is pointed at.
"""
from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest
import yaml
from test_manifests import DEPLOY, K8S_VERSIONS, by_kind, container, kustomize, strict_validate

from msn_serve.config import Settings

MILVUS = DEPLOY / "k8s" / "milvus"
OPERATOR = MILVUS / "milvus-operator.yaml"
VALUES = MILVUS / "milvus-values.yaml"
# Top-level keys of the milvus-helm chart's values.yaml and of the operator's MilvusSpec that these files may use.
CHART_KEYS = {"cluster", "image", "service", "proxy", "queryNode", "dataNode", "indexNode", "mixCoordinator",
              "streaming", "streamingNode", "etcd", "minio", "pulsarv3", "pulsar", "kafka", "woodpecker",
              "extraConfigFiles", "standalone", "metrics", "attu", "nameOverride", "fullnameOverride"}
OPERATOR_SPEC_KEYS = {"mode", "components", "dependencies", "config", "hookConfig"}
OPERATOR_COMPONENTS = {"image", "proxy", "queryNode", "dataNode", "indexNode", "mixCoord", "streamingNode",
                       "standalone", "enableRollingUpdate", "imageUpdateMode"}


@pytest.fixture(scope="module")
def resources() -> list[dict]:
    return kustomize(MILVUS)


def _env(resources: list[dict]) -> dict[str, str]:
    c = container(by_kind(resources, "Deployment")["msn-serve"])
    env = {}
    for source in c["envFrom"]:
        env.update(by_kind(resources, "ConfigMap")[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", [])})
    return env


def _milvus_version(image_or_tag: str) -> tuple[int, int]:
    major, minor = re.search(r"v?(\d+)\.(\d+)\.\d+$", image_or_tag).groups()
    return int(major), int(minor)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_validates_strictly(resources, version):
    assert sorted(r["kind"] for r in resources) == sorted(
        ["ServiceAccount", "ConfigMap", "Secret", "PersistentVolumeClaim", "Deployment", "Service",
         "PodDisruptionBudget"])
    for doc in resources:
        strict_validate(doc, version)


def test_replicas_are_stateless_and_share_milvus(resources):
    (dep,) = by_kind(resources, "Deployment").values()
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert dep["spec"]["replicas"] >= 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert set(mounts) <= set(volumes)
    claims = [v for v in volumes.values() if "persistentVolumeClaim" in v]
    assert [v["name"] for v in claims] == ["models"], "no index or data volume: only the bundle, read-only"
    assert claims[0]["persistentVolumeClaim"]["readOnly"] is True and mounts["models"]["readOnly"] is True
    (pvc,) = by_kind(resources, "PersistentVolumeClaim").values()
    assert pvc["metadata"]["name"] == claims[0]["persistentVolumeClaim"]["claimName"]
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert "emptyDir" in volumes["data"] and "emptyDir" in volumes["tmp"]

    env = _env(resources)
    assert set(env) <= {f"MSN_SERVE_{name.upper()}" for name in Settings.model_fields}, "every variable is a setting"
    assert env["MSN_SERVE_INDEX_BACKEND"] == "milvus" and "MSN_SERVE_ROLE" not in env
    assert env["MSN_SERVE_DATA_DIR"] == mounts["data"]["mountPath"]
    assert env["MSN_SERVE_BUNDLE"].startswith(mounts["models"]["mountPath"] + "/")
    assert env["MSN_SERVE_API_KEY_FILE"].startswith(mounts["api-key"]["mountPath"] + "/")
    assert env["MSN_SERVE_PORT"] == str(c["ports"][0]["containerPort"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    (svc,) = by_kind(resources, "Service").values()
    (pdb,) = by_kind(resources, "PodDisruptionBudget").values()
    labels = dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= labels and pdb["spec"]["selector"]["matchLabels"].items() <= labels
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"], "a drain must be able to evict one replica"
    secret = by_kind(resources, "Secret")[volumes["api-key"]["secret"]["secretName"]]
    assert volumes["api-key"]["secret"]["items"][0]["key"] in secret["stringData"]
    assert pod["serviceAccountName"] in by_kind(resources, "ServiceAccount")


def test_helm_values_and_operator_object_serve_the_uri_msn_serve_uses(resources):
    uri = urlparse(_env(resources)["MSN_SERVE_MILVUS_URI"])
    assert uri.scheme == "http" and uri.port == 19530

    values = yaml.safe_load(VALUES.read_text())
    assert set(values) <= CHART_KEYS, set(values) - CHART_KEYS
    assert values["cluster"]["enabled"] is True and values["service"]["port"] == uri.port
    release = re.search(r"helm install (\S+) \S+/milvus ", VALUES.read_text()).group(1)
    assert f"{release}-milvus" == uri.hostname, "the chart names its Service <release>-milvus"
    assert _milvus_version(values["image"]["all"]["tag"]) >= (2, 5), "nullable fields (msn-serve's metadata)"

    (milvus,) = [d for d in yaml.safe_load_all(OPERATOR.read_text()) if d]
    assert (milvus["apiVersion"], milvus["kind"]) == ("milvus.io/v1beta1", "Milvus")
    spec = milvus["spec"]
    assert set(spec) <= OPERATOR_SPEC_KEYS and set(spec["components"]) <= OPERATOR_COMPONENTS
    assert spec["mode"] == "cluster" and spec["components"]["proxy"]["replicas"] >= 1
    assert f"{milvus['metadata']['name']}-milvus" == uri.hostname, "the operator names its Service <name>-milvus"
    assert _milvus_version(spec["components"]["image"]) >= (2, 5)
    for dependency in ("etcd", "storage"):
        assert spec["dependencies"][dependency]["inCluster"]["deletionPolicy"] == "Retain", "keep the data"
