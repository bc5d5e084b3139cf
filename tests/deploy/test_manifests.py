"""Offline checks of deploy/: Kubernetes manifests, the PyTorchJob, compose.yaml, prometheus.yml and the SLURM job.

No cluster or Docker engine runs here, so:
- the kustomizations are rendered by the real kustomize built into `kubectl kustomize` (Debian's `kubernetes-client`,
  which `make setup` installs; it needs no cluster);
- every rendered object is validated with `kubernetes_validate.validate(..., strict=True)` (schemas bundled with the
  package, offline) against the oldest and newest Kubernetes versions named below; an unknown kind fails the test
  (the CLI would only warn);
- the PyTorchJob is a CRD with no bundled schema: its fields are checked structurally and its pod template is
  validated strictly as a core/v1 PodTemplate.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "k8s" / "base"
GPU = DEPLOY / "k8s" / "overlays" / "gpu"
PYTORCHJOB = DEPLOY / "k8s" / "training" / "pytorchjob.yaml"
COMPOSE = DEPLOY / "compose.yaml"
SBATCH = DEPLOY / "slurm" / "pretrain.sbatch"
DOCKERFILE = ROOT / "Dockerfile"

# Oldest Kubernetes minor we claim (autoscaling/v2, policy/v1, fsGroupChangePolicy are all GA there) and the
# newest whose schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
RENDERED = {"base": BASE, "gpu": GPU}


@functools.cache
def _render(directory: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl not found: `make setup` installs Debian's kubernetes-client")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {directory.relative_to(ROOT)}: {result.stderr}"
    return result.stdout


def kustomize(directory: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(_render(directory)) if doc]


@pytest.fixture(scope="module", params=sorted(RENDERED))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, kustomize(RENDERED[request.param])


def by_kind(resources: list[dict], kind: str) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def strict_validate(doc: dict, version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        pytest.fail(
            f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version} at {where}: {e.message}"
        )


def test_strict_validation_has_teeth():
    """The validator must reject an unknown field and a wrong type, or every other test here proves nothing."""
    deployment = by_kind(kustomize(BASE), "Deployment")["msn-serve"]
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        kubernetes_validate.validate(
            {"apiVersion": "example.com/v1", "kind": "Nope", "metadata": {"name": "n"}},
            K8S_VERSIONS[0],
            strict=True,
        )


# ---------------------------------------------------------------------------------------------------------------
# Rendered base and gpu overlay
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_validates_strictly(rendered, version):
    _, resources = rendered
    kinds = sorted(r["kind"] for r in resources)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ConfigMap",
            "Secret",
            "PersistentVolumeClaim",
            "Deployment",
            "Deployment",
            "Service",
            "Service",
            "HorizontalPodAutoscaler",
            "PodDisruptionBudget",
        ]
    )
    for doc in resources:
        strict_validate(doc, version)


def test_deployments_probes_resources_security(rendered):
    _, resources = rendered
    deployments = by_kind(resources, "Deployment")
    assert set(deployments) == {"msn-serve", "msn-serve-writer"}
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]["spec"]
        c = container(dep)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": 8000}
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz", name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert c[probe]["httpGet"]["port"] in ports, (name, probe)
        # startup budget covers model load and warm-up before liveness can kill the pod
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, kind)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001  # the image's USER
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert "/tmp" in mounts, "read-only root filesystem needs a writable /tmp"
        assert pod["automountServiceAccountToken"] is False


def test_references_resolve(rendered):
    _, resources = rendered
    configmaps, secrets = by_kind(resources, "ConfigMap"), by_kind(resources, "Secret")
    pvcs, accounts = by_kind(resources, "PersistentVolumeClaim"), by_kind(resources, "ServiceAccount")
    deployments = by_kind(resources, "Deployment")
    for dep in deployments.values():
        pod = dep["spec"]["template"]["spec"]
        c = container(dep)
        assert pod["serviceAccountName"] in accounts
        assert (
            dep["spec"]["selector"]["matchLabels"].items()
            <= dep["spec"]["template"]["metadata"]["labels"].items()
        )
        env = {}
        for source in c["envFrom"]:
            env.update(configmaps[source["configMapRef"]["name"]]["data"])
        env.update({e["name"]: e["value"] for e in c.get("env", [])})
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert set(mounts) <= set(volumes)
        for vol in volumes.values():
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in pvcs
            if "secret" in vol:
                assert vol["secret"]["secretName"] in secrets
        # The API key is a file from the Secret, at the path the ConfigMap tells msn-serve.
        key_volume = volumes["api-key"]["secret"]
        (item,) = key_volume["items"]
        assert item["key"] in secrets[key_volume["secretName"]]["stringData"]
        assert env["MSN_SERVE_API_KEY_FILE"] == f"{mounts['api-key']['mountPath']}/{item['path']}"
        assert env["MSN_SERVE_DATA_DIR"] == mounts["data"]["mountPath"]
        assert env["MSN_SERVE_BUNDLE"].startswith(mounts["data"]["mountPath"] + "/")
        assert env["MSN_SERVE_PORT"] == str(c["ports"][0]["containerPort"])
        assert all(k.startswith("MSN_SERVE_") for k in env)

    for svc in by_kind(resources, "Service").values():
        selected = [
            d
            for d in deployments.values()
            if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, svc["metadata"]["name"]
        port_names = {p["name"] for p in container(selected[0])["ports"]}
        assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"])
    for pdb in by_kind(resources, "PodDisruptionBudget").values():
        labels = pdb["spec"]["selector"]["matchLabels"].items()
        assert any(
            labels <= d["spec"]["template"]["metadata"]["labels"].items() for d in deployments.values()
        )


def test_consistency_model_one_writer_many_readonly_readers(rendered):
    _, resources = rendered
    deployments = by_kind(resources, "Deployment")
    writer, reader = deployments["msn-serve-writer"], deployments["msn-serve"]
    assert writer["spec"]["replicas"] == 1
    assert writer["spec"]["strategy"]["type"] == "Recreate", "a rollout must never run two writers"
    assert "replicas" not in reader["spec"], "the HPA owns the reader count"
    (hpa,) = by_kind(resources, "HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "msn-serve",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]

    def data_mount(dep):
        pod = dep["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "data"]
        (mount,) = [m for m in container(dep)["volumeMounts"] if m["name"] == "data"]
        return vol["persistentVolumeClaim"], mount

    claim, mount = data_mount(writer)
    assert not claim.get("readOnly") and not mount.get("readOnly")
    claim, mount = data_mount(reader)
    assert claim["readOnly"] is True and mount["readOnly"] is True
    assert data_mount(writer)[0]["claimName"] == claim["claimName"]
    (pvc,) = by_kind(resources, "PersistentVolumeClaim").values()
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "writer and readers on different nodes share it"
    roles = {
        name: {e["name"]: e["value"] for e in container(d)["env"]}["MSN_SERVE_ROLE"]
        for name, d in deployments.items()
    }
    assert roles == {"msn-serve-writer": "writer", "msn-serve": "reader"}


def test_gpu_overlay_changes_only_what_it_should():
    base = kustomize(BASE)
    gpu = kustomize(GPU)
    base_deps, gpu_deps = by_kind(base, "Deployment"), by_kind(gpu, "Deployment")
    for name in base_deps:
        b, g = container(base_deps[name]), container(gpu_deps[name])
        assert b["image"] == "msn:0.1.0-serve" and g["image"] == "msn:0.1.0-serve-gpu"
        assert "nvidia.com/gpu" not in b["resources"]["limits"]
        assert g["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert g["args"] == ["--device", "cuda"]
        pod = gpu_deps[name]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        # everything else of the base survives the strategic merge
        for field in (
            "readinessProbe",
            "livenessProbe",
            "startupProbe",
            "securityContext",
            "volumeMounts",
            "envFrom",
            "env",
            "ports",
        ):
            assert g[field] == b[field], (name, field)
        for field in ("volumes", "securityContext", "serviceAccountName"):
            assert pod[field] == base_deps[name]["spec"]["template"]["spec"][field], (name, field)
    assert by_kind(gpu, "ConfigMap")["msn-serve-config"]["data"]["MSN_SERVE_DEVICE"] == "cuda"
    assert by_kind(base, "ConfigMap")["msn-serve-config"]["data"]["MSN_SERVE_DEVICE"] == "cpu"
    assert by_kind(gpu, "HorizontalPodAutoscaler")["msn-serve"]["spec"]["maxReplicas"] == 4
    assert all(r["metadata"]["labels"]["app.kubernetes.io/part-of"] == "msn" for r in gpu)


def test_images_are_dockerfile_targets():
    targets = set(re.findall(r"(?im)^FROM\s+\S+\s+AS\s+(\S+)\s*$", DOCKERFILE.read_text()))
    for directory in RENDERED.values():
        for dep in by_kind(kustomize(directory), "Deployment").values():
            tag = container(dep)["image"].rsplit(":", 1)[1]
            assert tag.split("-", 1)[1] in targets  # 0.1.0-serve -> serve


# ---------------------------------------------------------------------------------------------------------------
# PyTorchJob (CRD: structural checks) and its PVC
# ---------------------------------------------------------------------------------------------------------------

PYTORCHJOB_SPEC_KEYS = {"elasticPolicy", "runPolicy", "pytorchReplicaSpecs", "nprocPerNode"}
ELASTIC_KEYS = {
    "minReplicas",
    "maxReplicas",
    "rdzvBackend",
    "rdzvPort",
    "rdzvHost",
    "rdzvId",
    "rdzvConf",
    "standalone",
    "nProcPerNode",
    "maxRestarts",
    "metrics",
}
RUN_POLICY_KEYS = {
    "cleanPodPolicy",
    "ttlSecondsAfterFinished",
    "activeDeadlineSeconds",
    "backoffLimit",
    "schedulingPolicy",
    "suspend",
    "managedBy",
}


def _pytorchjob_docs() -> tuple[dict, list[dict]]:
    docs = [d for d in yaml.safe_load_all(PYTORCHJOB.read_text()) if d]
    jobs = [d for d in docs if d["kind"] == "PyTorchJob"]
    assert len(jobs) == 1
    return jobs[0], [d for d in docs if d["kind"] != "PyTorchJob"]


def test_pytorchjob_structure():
    job, _ = _pytorchjob_docs()
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    spec = job["spec"]
    assert set(spec) <= PYTORCHJOB_SPEC_KEYS
    assert set(spec["runPolicy"]) <= RUN_POLICY_KEYS
    assert spec["runPolicy"]["cleanPodPolicy"] in {"None", "Running", "All"}
    replica_specs = spec["pytorchReplicaSpecs"]
    assert set(replica_specs) == {"Worker"}, "elastic jobs use Worker replicas only"
    worker = replica_specs["Worker"]
    assert set(worker) <= {"replicas", "restartPolicy", "template"}
    assert worker["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
    elastic = spec["elasticPolicy"]
    assert set(elastic) <= ELASTIC_KEYS
    assert elastic["rdzvBackend"] == "c10d"
    assert elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    assert worker["replicas"] >= 2, "the example is multi-node"
    assert elastic["maxRestarts"] >= 1
    (c,) = worker["template"]["spec"]["containers"]
    assert c["name"] == "pytorch", "the training operator looks for the container named pytorch"
    assert c["image"].endswith("-train")
    assert c["command"] == ["torchrun"]
    args = c["args"]
    assert args[0] == "training/pretrain.py" and "--resume" in args
    assert "--config" in args and "--output-dir" in args
    assert args[args.index("--output-dir") + 1].startswith("/mnt/shared/"), (
        "runs must live on the shared volume"
    )
    assert c["resources"]["limits"]["nvidia.com/gpu"] == elastic["nProcPerNode"]
    assert any(p["containerPort"] == elastic["rdzvPort"] for p in c["ports"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_pytorchjob_pod_template_and_pvc_validate_strictly(version):
    job, others = _pytorchjob_docs()
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    strict_validate(
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "pytorchjob-worker"},
            "template": template,
        },
        version,
    )
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in template["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    pvcs = {d["metadata"]["name"]: d for d in others if d["kind"] == "PersistentVolumeClaim"}
    assert claims <= set(pvcs)
    for doc in others:
        strict_validate(doc, version)
    assert all("ReadWriteMany" in pvc["spec"]["accessModes"] for pvc in pvcs.values())
    shm = [v for v in template["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    mounts = {m["name"]: m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"]}
    assert shm and mounts[shm[0]["name"]] == "/dev/shm"


# ---------------------------------------------------------------------------------------------------------------
# compose.yaml and prometheus.yml
# ---------------------------------------------------------------------------------------------------------------


def test_compose_services_ports_healthchecks():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"msn-serve", "visualizer", "prometheus"}
    targets = set(re.findall(r"(?im)^FROM\s+\S+\s+AS\s+(\S+)\s*$", DOCKERFILE.read_text()))
    expected_ports = {"msn-serve": "8000:8000", "visualizer": "7860:7860", "prometheus": "9090:9090"}
    for name, svc in services.items():
        assert expected_ports[name] in svc["ports"], name
        check = svc["healthcheck"]
        assert check["test"][0] == "CMD" and check["interval"] and check["retries"] >= 1, name
        if "build" in svc:
            assert (
                COMPOSE.parent / svc["build"]["context"] / svc["build"]["dockerfile"]
            ).resolve() == DOCKERFILE
            assert svc["build"]["target"] in targets
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag"
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).resolve().is_relative_to(ROOT)
            else:
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"
    serve = services["msn-serve"]
    assert "/readyz" in " ".join(serve["healthcheck"]["test"])
    assert serve["build"]["target"] == "serve"
    assert serve["read_only"] is True
    env = serve["environment"]
    assert (
        env["MSN_SERVE_DATA_DIR"] == "/data" and env["MSN_SERVE_API_KEY_FILE"] == "/run/secrets/msn_api_key"
    )
    assert any(v.endswith(":/data") for v in serve["volumes"])
    assert any(v.endswith(":/models:ro") for v in serve["volumes"])
    assert "msn_api_key" in serve["secrets"] and "msn_api_key" in compose["secrets"]
    viz = services["visualizer"]
    assert viz["build"]["target"] == "train" and viz["command"][:2] == ["msn-visualize", "app"]
    assert "7860" in viz["command"]
    prom = services["prometheus"]
    (config_mount,) = [v for v in prom["volumes"] if v.startswith("./prometheus.yml:")]
    assert (COMPOSE.parent / "prometheus.yml").is_file() and config_mount.endswith(":ro")


def test_compose_visualizer_works_from_the_host():
    """The app listens on all interfaces of its container (its own default, 127.0.0.1, is unreachable through the
    published port), loads the bundle and decoder `make demo` writes, logs in with the service's key, and points
    its labelling tab at the service's compose name and port. Parsed by the app's real parser."""
    import ipaddress
    from urllib.parse import urlparse

    from visualizer.cli import _parser

    compose = yaml.safe_load(COMPOSE.read_text())
    viz, serve = compose["services"]["visualizer"], compose["services"]["msn-serve"]
    argv = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", word) for word in viz["command"]]  # compose's defaults
    assert argv[0] == "msn-visualize"
    args = _parser().parse_args(argv[1:])
    assert args.command == "app"
    assert ipaddress.ip_address(args.host).is_unspecified
    assert f"{args.port}:{args.port}" in viz["ports"]

    url = urlparse(args.serve_url)
    assert url.hostname == "msn-serve" and url.port == int(serve["environment"]["MSN_SERVE_PORT"])
    assert "msn-serve" in viz.get("depends_on", {})
    assert str(args.api_key_file) == serve["environment"]["MSN_SERVE_API_KEY_FILE"]
    assert "msn_api_key" in viz["secrets"]

    def on_host(container_path: Path) -> str:
        """The repository path a container path is mounted from (the bind mounts under ``..``)."""
        for volume in viz["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith(".") and container_path.is_relative_to(target):
                host = (COMPOSE.parent / source / container_path.relative_to(target)).resolve()
                return str(host.relative_to(ROOT))
        raise AssertionError(f"{container_path} is not mounted from the repository")

    make = dict(re.findall(r"(?m)^(DEMO_\w+) \?= (\S+)$", (ROOT / "Makefile").read_text()))
    assert on_host(args.bundle) == make["DEMO_BUNDLE"]
    assert on_host(args.decoder) == make["DEMO_DECODER"]


def test_prometheus_scrapes_msn_serve_metrics():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    job = jobs["msn-serve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["msn-serve:8000"]
    assert job["authorization"]["credentials_file"] == "/run/secrets/msn_api_key"


# ---------------------------------------------------------------------------------------------------------------
# SLURM
# ---------------------------------------------------------------------------------------------------------------


def test_sbatch_script():
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash")
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = {m.group(1): m.group(2) for m in re.finditer(r"(?m)^#SBATCH\s+--([\w-]+)(?:=(\S+))?", text)}
    assert int(directives["nodes"]) >= 2 and directives["ntasks-per-node"] == "1"
    assert (
        "gpus-per-node" in directives
        and "requeue" in directives
        and directives["signal"].startswith("B:USR1@")
    )
    command = re.search(r"(?ms)^srun .*?training/pretrain\.py[^\n]*", text).group(0)
    for flag in (
        '--nnodes="${SLURM_NNODES}"',
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="${head}:29500"',
        "--resume",
        "--nproc_per_node=",
    ):
        assert flag in command, flag
    assert "SLURM_GPUS_ON_NODE" in text and "scontrol requeue" in text and "trap requeue USR1" in text
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(SBATCH)], check=True)


def test_deploy_doc_links_resolve():
    doc = ROOT / "docs" / "deploy.md"
    text = doc.read_text()
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in link:
            continue
        assert (doc.parent / link).exists(), f"docs/deploy.md links to missing {link}"
    for path in (
        "deploy/compose.yaml",
        "deploy/k8s/base",
        "deploy/k8s/overlays/gpu",
        "deploy/k8s/training/pytorchjob.yaml",
        "deploy/slurm/pretrain.sbatch",
    ):
        assert path in text, path
