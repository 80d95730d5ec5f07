"""Kubernetes manifests: each kustomization renders, validates strictly, and keeps the policy.

Every kustomization under k8s/ (the base and each overlay) is rendered with `kubectl
kustomize` (kustomize is built into kubectl) and checked twice over: against the Kubernetes
OpenAPI schemas with kubernetes-validate in strict mode (unknown fields are errors), and
against the rules the deployment depends on (probes, drain timing, GPU placement, network
isolation, non-root pods, autoscaling, TLS, mutual TLS and bearer tokens). dev-cpu is rendered
from a copy of k8s/ after its make-secrets.sh has written the files its secretGenerator reads,
as a user does. k8s/cert-manager (cert-manager's own resource kinds, which the Kubernetes
schemas do not cover) is checked against what the gpu overlay mounts and dials. No cluster is
needed; the tests skip only when kubectl is not installed.
"""

from __future__ import annotations

import base64
import functools
import ipaddress
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
K8S_DIR = REPO_ROOT / "k8s"
KUSTOMIZATIONS = {
    "base": K8S_DIR / "base",
    "dev-cpu": K8S_DIR / "overlays" / "dev-cpu",
    "gpu": K8S_DIR / "overlays" / "gpu",
}
# Not an overlay: cert-manager Certificates for the Secrets the gpu overlay mounts.
CERT_MANAGER = "cert-manager"
ADD_ONS = {CERT_MANAGER: K8S_DIR / "cert-manager"}
# Kustomizations whose secretGenerator reads files that this script writes first.
DEV_SECRETS_SCRIPT = {"dev-cpu": "make-secrets.sh"}
# The oldest Kubernetes release the manifests promise to run on, and the newest the installed
# kubernetes-validate knows (a field removed upstream would fail there).
KUBERNETES_VERSIONS = ("1.32", kubernetes_validate.utils.latest_version())

NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
COORDINATOR = "coordinator"
WORKERS = ("draft-worker", "target-worker")
COMPONENTS = (COORDINATOR, *WORKERS)
# The gRPC service each component registers with grpc.health.v1.
HEALTH_SERVICES = {
    "coordinator": "specdec.v1.Coordinator",
    "draft-worker": "specdec.v1.DraftWorker",
    "target-worker": "specdec.v1.TargetWorker",
}
GPU_RESOURCE = "nvidia.com/gpu"
INFLIGHT_METRIC = "specdec_worker_inflight_requests"
MONITORING_NAMESPACE = "monitoring"
# Loading (and on first start converting) a model may take this long before the startup
# probe may give up on a pod.
MIN_STARTUP_SECONDS = 600
# `specdec serve --grace-period` when the flag is not given.
DEFAULT_DRAIN_GRACE_SECONDS = 20
# kustomize's configMapGenerator appends "-" and a 10-character content hash.
HASHED_NAME = re.compile(r"^(?P<base>.+)-[a-z0-9]{10}$")
ENV_REFERENCE = re.compile(r"\$\((?P<name>[A-Za-z_][A-Za-z0-9_]*)\)")

Resource = dict[str, Any]
Docs = tuple[Resource, ...]  # the rendered resources of one kustomization


# --- rendering ---------------------------------------------------------------------------


@functools.cache
def _render(name: str) -> Docs:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the kustomizations")
    with tempfile.TemporaryDirectory(prefix="specdec-k8s-") as scratch:
        root = {**KUSTOMIZATIONS, **ADD_ONS}[name]
        if name in DEV_SECRETS_SCRIPT:
            # A copy, so the repository's own secrets/ (a user's) is neither read nor written.
            copy = Path(scratch) / "k8s"
            shutil.copytree(K8S_DIR, copy, ignore=shutil.ignore_patterns("secrets"))
            root = copy / root.relative_to(K8S_DIR)
            script = subprocess.run(
                ["sh", str(root / DEV_SECRETS_SCRIPT[name])],
                env={**os.environ, "SPECDEC": f"{sys.executable} -m specdec"},
                capture_output=True, text=True, timeout=120, check=False,
            )
            if script.returncode != 0:
                raise RuntimeError(f"{DEV_SECRETS_SCRIPT[name]} failed:\n{script.stderr}")
        proc = subprocess.run(
            [kubectl, "kustomize", str(root)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {name} failed:\n{proc.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


@pytest.fixture(params=list(KUSTOMIZATIONS))
def rendered(request: pytest.FixtureRequest) -> Docs:
    """The rendered resources of each kustomization in turn."""
    return _render(request.param)


@pytest.fixture(params=["base", "gpu"])
def autoscaled(request: pytest.FixtureRequest) -> Docs:
    """The kustomizations that autoscale (dev-cpu runs fixed replicas)."""
    return _render(request.param)


# --- helpers over rendered resources ---------------------------------------------------


def of_kind(docs: Docs, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def component_of(doc: dict[str, Any]) -> str:
    return doc["metadata"].get("labels", {}).get(COMPONENT_LABEL, "")


def deployment(docs: Docs, component: str) -> dict[str, Any]:
    matches = [d for d in of_kind(docs, "Deployment") if component_of(d) == component]
    assert len(matches) == 1, f"expected one Deployment for {component}, found {len(matches)}"
    return matches[0]


def containers(docs: Docs) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(deployment name, pod spec, container) for every container, init containers included."""
    for dep in of_kind(docs, "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            yield dep["metadata"]["name"], pod, container


def main_container(dep: dict[str, Any]) -> dict[str, Any]:
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


def container_port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == name]
    return port


def flag(container: dict[str, Any], name: str) -> str | None:
    """The value of a command-line flag in `command` + `args` (`--x v` or `--x=v`)."""
    argv = container.get("command", []) + container.get("args", [])
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def prestop_sleep_seconds(container: dict[str, Any]) -> int:
    """Seconds the preStop hook waits: the native sleep action or an exec of `sleep N`."""
    pre_stop = container.get("lifecycle", {}).get("preStop")
    assert pre_stop, f"{container['name']} has no preStop hook"
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    if len(command) == 3 and command[1] == "-c":  # ["/bin/sh", "-c", "sleep 5"]
        command = shlex.split(command[2])
    assert Path(command[0]).name == "sleep" and len(command) == 2, f"not a sleep: {command}"
    return int(command[1])


def effective_security(pod: dict[str, Any], container: dict[str, Any], field: str) -> Any:
    """A security setting as the kubelet applies it: the container's, else the pod's."""
    return container.get("securityContext", {}).get(
        field, pod.get("securityContext", {}).get(field)
    )


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector selects an object with these labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def pod_labels(docs: Docs, component: str) -> dict[str, str]:
    return deployment(docs, component)["spec"]["template"]["metadata"]["labels"]


def ingress_rules_to(docs: Docs, component: str) -> list[dict[str, Any]] | None:
    """Ingress rules of every policy isolating this component's pods; None if none isolates them."""
    labels = pod_labels(docs, component)
    policies = [
        p
        for p in of_kind(docs, "NetworkPolicy")
        if selector_matches(p["spec"]["podSelector"], labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not policies:
        return None
    return [rule for p in policies for rule in p["spec"].get("ingress", [])]


def rule_covers_port(rule: dict[str, Any], container: dict[str, Any], port_name: str) -> bool:
    """Whether an ingress rule opens the container's named port (no `ports` opens all)."""
    if "ports" not in rule:
        return True
    number = container_port(container, port_name)
    return any(p.get("port") in (number, port_name) for p in rule["ports"])


def is_coordinator_peer(peer: dict[str, Any]) -> bool:
    """A peer that is coordinator pods of the policy's own namespace and nothing else."""
    if "ipBlock" in peer or "namespaceSelector" in peer or "podSelector" not in peer:
        return False
    return peer["podSelector"].get("matchLabels", {}).get(COMPONENT_LABEL) == COORDINATOR


def is_monitoring_peer(peer: dict[str, Any]) -> bool:
    namespaces = peer.get("namespaceSelector", {}).get("matchLabels", {})
    return namespaces.get("kubernetes.io/metadata.name") == MONITORING_NAMESPACE


def resource_list(container: dict[str, Any], bound: str) -> dict[str, Any]:
    return container.get("resources", {}).get(bound, {}) or {}


# --- rendering and schema ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_kustomization_renders_every_component(name: str) -> None:
    docs = _render(name)
    kinds = {component_of(d) for d in of_kind(docs, "Deployment")}
    assert kinds == set(COMPONENTS)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_resources_validate_strictly_against_kubernetes_schema(
    rendered: Docs, version: str
) -> None:
    errors = []
    for doc in rendered:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.utils.SchemaNotFoundError as e:
            errors.append(f"{where}: {e.message}")
    assert not errors, "\n".join(errors)


# --- services ----------------------------------------------------------------------------


def test_each_component_has_a_service_selecting_its_pods(rendered: Docs) -> None:
    for component in COMPONENTS:
        labels = pod_labels(rendered, component)
        services = [
            s
            for s in of_kind(rendered, "Service")
            if selector_matches({"matchLabels": s["spec"]["selector"]}, labels)
        ]
        assert len(services) == 1, f"{component}: {len(services)} Services select its pods"


def test_worker_services_are_headless_with_a_named_grpc_port(rendered: Docs) -> None:
    for service in of_kind(rendered, "Service"):
        if component_of(service) in WORKERS:
            assert service["spec"].get("clusterIP") == "None", service["metadata"]["name"]
            assert "grpc" in [p.get("name") for p in service["spec"]["ports"]], service["metadata"][
                "name"
            ]


def test_service_target_ports_resolve_to_container_ports(rendered: Docs) -> None:
    for service in of_kind(rendered, "Service"):
        container = main_container(deployment(rendered, component_of(service)))
        names = {p.get("name") for p in container["ports"]}
        numbers = {p["containerPort"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in names | numbers, f"{service['metadata']['name']}: targetPort {target}"


def test_coordinator_dials_the_worker_services(rendered: Docs) -> None:
    coordinator = main_container(deployment(rendered, COORDINATOR))
    for worker, option in (("target-worker", "--target-addr"), ("draft-worker", "--draft-addr")):
        address = flag(coordinator, option)
        assert address is not None, f"coordinator has no {option}"
        host, port = address.removeprefix("dns:///").rsplit(":", 1)
        (service,) = [s for s in of_kind(rendered, "Service") if component_of(s) == worker]
        assert host.split(".")[0] == service["metadata"]["name"], f"{option} {address}"
        grpc_ports = [p["port"] for p in service["spec"]["ports"] if p.get("name") == "grpc"]
        assert int(port) in grpc_ports, f"{option} {address}"


# --- command lines -----------------------------------------------------------------------


def test_serve_ports_match_the_named_container_ports(rendered: Docs) -> None:
    for dep_name, _, container in containers(rendered):
        assert int(flag(container, "--port") or -1) == container_port(container, "grpc"), dep_name
        assert int(flag(container, "--metrics-port") or -1) == container_port(
            container, "metrics"
        ), dep_name


def test_coordinator_serves_the_http_api_on_its_named_port(rendered: Docs) -> None:
    container = main_container(deployment(rendered, COORDINATOR))
    assert int(flag(container, "--http-port") or 0) == container_port(container, "http")
    (service,) = [s for s in of_kind(rendered, "Service") if component_of(s) == COORDINATOR]
    assert any(p["targetPort"] == "http" and p.get("appProtocol") == "http" for p in service["spec"]["ports"])


def test_argument_variables_are_defined_in_the_container_env(rendered: Docs) -> None:
    # An undefined $(VAR) is passed to the program literally, e.g. `--model $(MODEL)`.
    for dep_name, _, container in containers(rendered):
        defined = {e["name"] for e in container.get("env", [])}
        for arg in container.get("command", []) + container.get("args", []):
            for ref in ENV_REFERENCE.finditer(arg):
                assert ref["name"] in defined, f"{dep_name}: {arg} is not defined in env"


def test_hub_is_offline_in_every_container(rendered: Docs) -> None:
    for dep_name, _, container in containers(rendered):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("HF_HUB_OFFLINE") == "1", dep_name


# --- probes and shutdown -----------------------------------------------------------------


def test_deployments_have_readiness_liveness_and_startup_probes(rendered: Docs) -> None:
    for dep_name, _, container in containers(rendered):
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert probe in container, f"{dep_name}: no {probe}"


def test_probes_are_grpc_on_a_numeric_container_port(rendered: Docs) -> None:
    for dep_name, _, container in containers(rendered):
        ports = {p["containerPort"] for p in container.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            port = container.get(probe, {}).get("grpc", {}).get("port")
            assert isinstance(port, int) and port in ports, f"{dep_name} {probe}: port {port!r}"


def test_readiness_probe_asks_for_the_component_health_service(rendered: Docs) -> None:
    for component in COMPONENTS:
        probe = main_container(deployment(rendered, component))["readinessProbe"]
        assert probe["grpc"].get("service") == HEALTH_SERVICES[component], component


def test_startup_probe_allows_ten_minutes_for_model_loading(rendered: Docs) -> None:
    for dep_name, _, container in containers(rendered):
        probe = container["startupProbe"]
        budget = probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10)
        assert budget >= MIN_STARTUP_SECONDS, f"{dep_name}: startup probe gives up after {budget} s"


def test_termination_grace_covers_prestop_sleep_and_drain(rendered: Docs) -> None:
    for dep_name, pod, container in containers(rendered):
        drain = int(flag(container, "--grace-period") or DEFAULT_DRAIN_GRACE_SECONDS)
        needed = prestop_sleep_seconds(container) + drain
        grace = pod.get("terminationGracePeriodSeconds", 30)
        assert grace >= needed, f"{dep_name}: {grace} s < preStop + drain = {needed} s"


# --- resources and GPUs ------------------------------------------------------------------


def test_containers_request_and_limit_cpu_and_memory(rendered: Docs) -> None:
    for dep_name, _, container in containers(rendered):
        for bound in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(resource_list(container, bound))
            assert not missing, f"{dep_name}: no {bound} for {sorted(missing)}"


def test_coordinator_never_requests_a_gpu(rendered: Docs) -> None:
    coordinator = main_container(deployment(rendered, COORDINATOR))
    for bound in ("requests", "limits"):
        assert GPU_RESOURCE not in resource_list(coordinator, bound)


@pytest.mark.parametrize("name", ["base", "dev-cpu"])
def test_cpu_kustomizations_request_no_gpu(name: str) -> None:
    for dep_name, _, container in containers(_render(name)):
        for bound in ("requests", "limits"):
            assert GPU_RESOURCE not in resource_list(container, bound), dep_name


def test_gpu_overlay_workers_limit_one_gpu() -> None:
    docs = _render("gpu")
    for worker in WORKERS:
        container = main_container(deployment(docs, worker))
        assert int(resource_list(container, "limits").get(GPU_RESOURCE, 0)) == 1, worker
        # An extended resource's request, when given, must equal its limit.
        assert resource_list(container, "requests").get(GPU_RESOURCE, 1) in (1, "1"), worker


def test_gpu_overlay_workers_schedule_onto_tainted_gpu_nodes() -> None:
    docs = _render("gpu")
    for worker in WORKERS:
        pod = deployment(docs, worker)["spec"]["template"]["spec"]
        assert pod.get("nodeSelector"), f"{worker}: no nodeSelector"
        assert any(t.get("key") == GPU_RESOURCE for t in pod.get("tolerations", [])), worker


def test_gpu_overlay_keeps_the_coordinator_off_gpu_nodes() -> None:
    pod = deployment(_render("gpu"), COORDINATOR)["spec"]["template"]["spec"]
    assert not any(t.get("key") == GPU_RESOURCE for t in pod.get("tolerations", []))


def test_gpu_overlay_workers_run_the_cuda_image() -> None:
    docs = _render("gpu")
    for worker in WORKERS:
        assert main_container(deployment(docs, worker))["image"].endswith("-cuda"), worker


def worker_config_of(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
    """The WorkerConfig `specdec` makes of a worker container: its args parsed by specdec's own
    parser with the container's literal SPECDEC_* variables set (other references: "x")."""
    from specdec.cli import build_parser, flags

    for variable in [v for v in os.environ if v.startswith("SPECDEC_")]:
        monkeypatch.delenv(variable)
    for env in container.get("env", []):
        if env["name"].startswith("SPECDEC_") and "value" in env:
            monkeypatch.setenv(env["name"], env["value"])
    argv = [ENV_REFERENCE.sub("x", arg) for arg in container["args"]]
    return flags.worker_config(build_parser().parse_args(argv), "x")


def test_gpu_overlay_workers_serve_on_cuda_in_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = _render("gpu")
    for worker in WORKERS:
        container = main_container(deployment(docs, worker))
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("SPECDEC_DEVICE") == "cuda", worker
        assert env.get("SPECDEC_DTYPE") == "bfloat16", worker
        config = worker_config_of(container, monkeypatch)  # no flag overrides them
        assert (config.device, config.dtype) == ("cuda", "bfloat16"), worker


@pytest.mark.parametrize("name", ["base", "dev-cpu"])
def test_cpu_kustomizations_serve_on_cpu(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for worker in WORKERS:
        config = worker_config_of(main_container(deployment(_render(name), worker)), monkeypatch)
        assert config.device == "cpu", f"{name}: {worker}"


def test_gpu_overlay_coordinator_runs_the_cpu_image() -> None:
    docs = _render("gpu")
    assert not main_container(deployment(docs, COORDINATOR))["image"].endswith("-cuda")


# --- configuration and volumes -----------------------------------------------------------


def configmap_references(docs: Docs) -> Iterator[tuple[str, str]]:
    """(deployment name, ConfigMap name) for every reference in env, envFrom and volumes."""
    for dep_name, pod, container in containers(docs):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                yield dep_name, ref["name"]
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                yield dep_name, source["configMapRef"]["name"]
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                yield dep_name, volume["configMap"]["name"]
            for projected in volume.get("projected", {}).get("sources", []):
                if "configMap" in projected:
                    yield dep_name, projected["configMap"]["name"]


def test_configmap_references_resolve_to_rendered_configmaps(rendered: Docs) -> None:
    names = {c["metadata"]["name"] for c in of_kind(rendered, "ConfigMap")}
    references = list(configmap_references(rendered))
    assert references, "no Deployment reads the model ConfigMap"
    for dep_name, ref in references:
        assert ref in names, f"{dep_name} references ConfigMap {ref}, not rendered"


def test_configmaps_have_content_hashed_names(rendered: Docs) -> None:
    for configmap in of_kind(rendered, "ConfigMap"):
        assert HASHED_NAME.match(configmap["metadata"]["name"]), configmap["metadata"]["name"]


def test_model_configmap_names_every_model(rendered: Docs) -> None:
    (models,) = [
        c
        for c in of_kind(rendered, "ConfigMap")
        if c["metadata"]["name"].startswith("specdec-models")
    ]
    assert {"target-model", "draft-model", "tokenizer"} <= set(models["data"])


def claimed_volumes(docs: Docs) -> Iterator[tuple[str, dict[str, Any], str, dict[str, Any]]]:
    """(deployment name, container, volume name, its persistentVolumeClaim source) for every
    claim-backed volume of every container's pod."""
    for dep_name, pod, container in containers(docs):
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                yield dep_name, container, volume["name"], volume["persistentVolumeClaim"]


def test_claim_references_resolve_to_rendered_claims(rendered: Docs) -> None:
    claims = {c["metadata"]["name"] for c in of_kind(rendered, "PersistentVolumeClaim")}
    for dep_name, _, _, claim in claimed_volumes(rendered):
        assert claim["claimName"] in claims, (
            f"{dep_name}: claim {claim['claimName']} not rendered"
        )


def test_claimed_volumes_mount_read_only(rendered: Docs) -> None:
    for dep_name, container, volume, _ in claimed_volumes(rendered):
        mounts = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
        assert mounts and all(m.get("readOnly") for m in mounts), (
            f"{dep_name}: {volume} not mounted read-only"
        )


def test_cache_dir_is_a_writable_volume(rendered: Docs) -> None:
    # The root filesystem is read-only, so the converted-weights cache must be a mount.
    for dep_name, _, container in containers(rendered):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        cache = env.get("SPECDEC_CACHE_DIR")
        assert cache, f"{dep_name}: SPECDEC_CACHE_DIR not set"
        writable = [
            m["mountPath"] for m in container.get("volumeMounts", []) if not m.get("readOnly")
        ]
        assert any(cache == p or cache.startswith(p.rstrip("/") + "/") for p in writable), dep_name


# --- pod security ------------------------------------------------------------------------


def test_containers_run_as_a_numeric_non_root_user(rendered: Docs) -> None:
    for dep_name, pod, container in containers(rendered):
        assert effective_security(pod, container, "runAsNonRoot") is True, dep_name
        uid = effective_security(pod, container, "runAsUser")
        assert isinstance(uid, int) and uid > 0, f"{dep_name}: runAsUser {uid!r}"


def test_containers_have_a_read_only_root_filesystem(rendered: Docs) -> None:
    for dep_name, _, container in containers(rendered):
        assert container.get("securityContext", {}).get("readOnlyRootFilesystem") is True, dep_name


def test_containers_drop_privileges(rendered: Docs) -> None:
    for dep_name, _, container in containers(rendered):
        security = container.get("securityContext", {})
        assert security.get("allowPrivilegeEscalation") is False, dep_name
        assert security.get("capabilities", {}).get("drop") == ["ALL"], dep_name
        assert not security.get("privileged"), dep_name


def test_containers_use_the_runtime_default_seccomp_profile(rendered: Docs) -> None:
    for dep_name, pod, container in containers(rendered):
        profile = effective_security(pod, container, "seccompProfile") or {}
        assert profile.get("type") == "RuntimeDefault", dep_name


def test_dockerfile_user_matches_the_pods_run_as_user(rendered: Docs) -> None:
    users = re.findall(r"^USER\s+(\S+)", (REPO_ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert users, "Dockerfile sets no USER"
    image_uid = users[-1].split(":")[0]
    for dep_name, pod, container in containers(rendered):
        assert str(effective_security(pod, container, "runAsUser")) == image_uid, dep_name


# --- network policy ----------------------------------------------------------------------


@pytest.mark.parametrize("worker", WORKERS)
def test_worker_grpc_port_admits_only_the_coordinator(rendered: Docs, worker: str) -> None:
    rules = ingress_rules_to(rendered, worker)
    assert rules is not None, f"no NetworkPolicy isolates {worker} pods"
    container = main_container(deployment(rendered, worker))
    for rule in rules:
        if rule_covers_port(rule, container, "grpc"):
            peers = rule.get("from", [])
            assert peers and all(is_coordinator_peer(p) for p in peers), f"{worker}: {rule}"


@pytest.mark.parametrize("worker", WORKERS)
def test_worker_grpc_port_admits_the_coordinator(rendered: Docs, worker: str) -> None:
    container = main_container(deployment(rendered, worker))
    rules = ingress_rules_to(rendered, worker) or []
    coordinator = pod_labels(rendered, COORDINATOR)

    def admits_coordinator(peer: dict[str, Any]) -> bool:
        return "ipBlock" not in peer and selector_matches(peer.get("podSelector", {}), coordinator)

    assert any(
        rule_covers_port(rule, container, "grpc")
        and (not rule.get("from") or any(admits_coordinator(p) for p in rule["from"]))
        for rule in rules
    ), f"the coordinator cannot reach {worker}'s gRPC port"


@pytest.mark.parametrize("component", COMPONENTS)
def test_metrics_port_admits_the_monitoring_namespace(rendered: Docs, component: str) -> None:
    container = main_container(deployment(rendered, component))
    rules = ingress_rules_to(rendered, component)
    if rules is None:
        return  # not isolated: every source, monitoring included, may connect
    assert any(
        rule_covers_port(rule, container, "metrics")
        and (not rule.get("from") or any(is_monitoring_peer(p) for p in rule["from"]))
        for rule in rules
    ), f"{component}: metrics port closed to the {MONITORING_NAMESPACE} namespace"


# --- labels, replicas, autoscaling, disruption budgets -----------------------------------


def test_resources_carry_the_recommended_labels(rendered: Docs) -> None:
    for doc in rendered:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        labels = doc["metadata"].get("labels", {})
        required = (
            (NAME_LABEL, PART_OF_LABEL)
            if doc["kind"] == "Namespace"
            else (NAME_LABEL, COMPONENT_LABEL, PART_OF_LABEL)
        )
        missing = [label for label in required if label not in labels]
        assert not missing, f"{where}: no {missing}"
        if doc["kind"] == "Deployment":
            template = doc["spec"]["template"]["metadata"]["labels"]
            assert all(label in template for label in required), f"{where}: pod template labels"


def test_dev_cpu_runs_one_worker_of_each_kind_and_two_coordinators_without_autoscalers() -> None:
    docs = _render("dev-cpu")
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    for component in WORKERS:
        assert deployment(docs, component)["spec"].get("replicas") == 1, component
    assert deployment(docs, COORDINATOR)["spec"].get("replicas") == 2


def test_dev_cpu_coordinator_outlasts_a_restart_of_its_one_target() -> None:
    """With one target replica, the coordinator's retries (0.2 s doubling) must cover a
    restart of it: at least 30 s of back-off, where the default 5 retries give ~6 s."""
    coordinator = deployment(_render("dev-cpu"), COORDINATOR)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in coordinator.get("env", [])}
    retries = int(env.get("SPECDEC_WORKER_RETRIES", 5))
    backoff = float(env.get("SPECDEC_WORKER_BACKOFF_S", 0.2))
    assert backoff * (2 ** retries - 1) >= 30


def hpa_for(docs: Docs, component: str) -> dict[str, Any]:
    name = deployment(docs, component)["metadata"]["name"]
    matches = [
        h
        for h in of_kind(docs, "HorizontalPodAutoscaler")
        if h["spec"]["scaleTargetRef"]["name"] == name
    ]
    assert len(matches) == 1, f"{component}: {len(matches)} HPAs"
    return matches[0]


def test_hpas_target_rendered_deployments(autoscaled: Docs) -> None:
    names = {d["metadata"]["name"] for d in of_kind(autoscaled, "Deployment")}
    for hpa in of_kind(autoscaled, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in names, hpa["metadata"]["name"]


@pytest.mark.parametrize("worker", WORKERS)
def test_worker_hpa_scales_on_its_average_inflight_requests(autoscaled: Docs, worker: str) -> None:
    metrics = hpa_for(autoscaled, worker)["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Pods"], worker
    pods = metrics[0]["pods"]
    assert pods["metric"]["name"] == INFLIGHT_METRIC, worker
    assert pods["target"]["type"] == "AverageValue", worker


def test_coordinator_hpa_scales_on_cpu(autoscaled: Docs) -> None:
    metrics = hpa_for(autoscaled, COORDINATOR)["spec"]["metrics"]
    assert [(m["type"], m["resource"]["name"]) for m in metrics] == [("Resource", "cpu")]


def test_autoscaled_deployments_leave_replicas_to_the_hpa(autoscaled: Docs) -> None:
    # A replica count in the manifest would reset the HPA's choice on every apply.
    for component in COMPONENTS:
        hpa_for(autoscaled, component)
        assert "replicas" not in deployment(autoscaled, component)["spec"], component


def test_each_deployment_has_one_disruption_budget(rendered: Docs) -> None:
    for component in COMPONENTS:
        labels = pod_labels(rendered, component)
        budgets = [
            b
            for b in of_kind(rendered, "PodDisruptionBudget")
            if selector_matches(b["spec"]["selector"], labels)
        ]
        assert len(budgets) == 1, f"{component}: {len(budgets)} PodDisruptionBudgets"


def coordinator_min_replicas(docs: Docs) -> int:
    """The fewest coordinator pods that run: its HPA's minimum, else the Deployment's count."""
    dep = deployment(docs, COORDINATOR)
    hpas = [
        h
        for h in of_kind(docs, "HorizontalPodAutoscaler")
        if h["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    ]
    if hpas:
        return hpas[0]["spec"].get("minReplicas", 1)
    return dep["spec"].get("replicas", 1)


def test_coordinator_runs_at_least_two_replicas(rendered: Docs) -> None:
    assert coordinator_min_replicas(rendered) >= 2


def test_coordinator_disruption_budget_keeps_one_serving(rendered: Docs) -> None:
    labels = pod_labels(rendered, COORDINATOR)
    budgets = [
        b
        for b in of_kind(rendered, "PodDisruptionBudget")
        if selector_matches(b["spec"]["selector"], labels)
    ]
    assert len(budgets) == 1, f"{len(budgets)} PodDisruptionBudgets select the coordinator pods"
    spec = budgets[0]["spec"]
    if "minAvailable" in spec:
        assert isinstance(spec["minAvailable"], int) and spec["minAvailable"] >= 1, spec
    else:
        unavailable = spec.get("maxUnavailable")
        assert isinstance(unavailable, int), spec
        assert coordinator_min_replicas(rendered) - unavailable >= 1, spec


# --- transport security and authentication -----------------------------------------------

# The Secrets the manifests mount (k8s/README.md, "Create the Secrets"); dev-cpu generates
# them, with a content hash appended to each name.
COORDINATOR_TLS_SECRET = "specdec-coordinator-tls"
COORDINATOR_CLIENT_SECRET = "specdec-coordinator-client-tls"
AUTH_TOKENS_SECRET = "specdec-auth-tokens"
WORKER_TLS_SECRETS = {
    "draft-worker": "specdec-draft-worker-tls",
    "target-worker": "specdec-target-worker-tls",
}
SECRETS = {
    COORDINATOR_TLS_SECRET,
    COORDINATOR_CLIENT_SECRET,
    AUTH_TOKENS_SECRET,
    *WORKER_TLS_SECRETS.values(),
}
# The coordinator's flag naming what each worker kind's certificates are checked against.
SERVER_NAME_FLAGS = {
    "draft-worker": "--draft-tls-server-name",
    "target-worker": "--target-tls-server-name",
}
# The label that opens the coordinator's client ports to a pod, or to a whole namespace.
CLIENT_LABEL = {"specdec-client": "true"}
CLIENT_PORTS = ("grpc", "http")
DEFAULT_NAMESPACE = "default"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def secret_base_name(name: str) -> str:
    """A Secret's name without the content hash a secretGenerator appends."""
    match = HASHED_NAME.match(name)
    return match["base"] if match and match["base"] in SECRETS else name


def secret_file(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(Secret name, key) of the file at `path` when a Secret volume mounted whole provides
    it; None otherwise (another volume, no such key, or a subPath mount, which never sees the
    Secret change)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(root):
            continue
        secret = volumes[mount["name"]].get("secret")
        if secret is None or "subPath" in mount or "subPathExpr" in mount:
            return None
        relative = path[len(root):]
        items = secret.get("items")
        if items is None:
            return secret_base_name(secret["secretName"]), relative
        keys = [item["key"] for item in items if item["path"] == relative]
        return (secret_base_name(secret["secretName"]), keys[0]) if keys else None
    return None


def flag_file(docs: Docs, component: str, option: str) -> tuple[str, str] | None:
    """(Secret name, key) of the file a flag of the component names."""
    dep = deployment(docs, component)
    container = main_container(dep)
    path = flag(container, option)
    assert path is not None, f"{component} has no {option}"
    return secret_file(dep["spec"]["template"]["spec"], container, path)


def expanded_flag(dep: dict[str, Any], option: str) -> str:
    """A flag's value as the container gets it: each $(VAR) replaced from the container's
    env (a literal value, or the pod's namespace through the downward API)."""
    container = main_container(dep)
    value = flag(container, option)
    assert value is not None, f"{dep['metadata']['name']} has no {option}"
    known = {}
    for var in container.get("env", []):
        if "value" in var:
            known[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            known[var["name"]] = dep["metadata"].get("namespace", DEFAULT_NAMESPACE)

    def substitute(ref: re.Match) -> str:
        assert ref["name"] in known, f"{option} {value}: $({ref['name']}) is not known before the pod runs"
        return known[ref["name"]]

    return ENV_REFERENCE.sub(substitute, value)


def service_of(docs: Docs, component: str) -> dict[str, Any]:
    (service,) = [s for s in of_kind(docs, "Service") if component_of(s) == component]
    return service


def service_dns_names(service: dict[str, Any]) -> set[str]:
    """The names cluster DNS answers for a Service (the short ones through the search path)."""
    name = service["metadata"]["name"]
    namespace = service["metadata"].get("namespace", DEFAULT_NAMESPACE)
    return {
        name,
        f"{name}.{namespace}",
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}.svc.cluster.local",
    }


def test_no_component_serves_plaintext(rendered: Docs) -> None:
    for dep_name, _, container in containers(rendered):
        argv = container.get("command", []) + container.get("args", [])
        assert "--insecure" not in argv, dep_name
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("SPECDEC_INSECURE") != "1", dep_name
        assert flag(container, "--tls-cert") and flag(container, "--tls-key"), f"{dep_name}: no TLS"


def test_coordinator_serves_tls_from_its_secret(rendered: Docs) -> None:
    assert flag_file(rendered, COORDINATOR, "--tls-cert") == (COORDINATOR_TLS_SECRET, "tls.crt")
    assert flag_file(rendered, COORDINATOR, "--tls-key") == (COORDINATOR_TLS_SECRET, "tls.key")


def test_coordinator_requires_bearer_tokens_from_their_secret(rendered: Docs) -> None:
    # Mounted whole: a rotated token reaches the running coordinator, which re-reads the file.
    assert flag_file(rendered, COORDINATOR, "--auth-token-file") == (AUTH_TOKENS_SECRET, "tokens")


@pytest.mark.parametrize("worker", WORKERS)
def test_worker_serves_mutual_tls_from_its_secret(rendered: Docs, worker: str) -> None:
    secret = WORKER_TLS_SECRETS[worker]
    assert flag_file(rendered, worker, "--tls-cert") == (secret, "tls.crt")
    assert flag_file(rendered, worker, "--tls-key") == (secret, "tls.key")
    assert flag_file(rendered, worker, "--tls-client-ca") == (secret, "ca.crt")


def test_coordinator_calls_the_workers_with_its_client_certificate(rendered: Docs) -> None:
    for option, key in (("--worker-ca", "ca.crt"), ("--worker-cert", "tls.crt"), ("--worker-key", "tls.key")):
        assert flag_file(rendered, COORDINATOR, option) == (COORDINATOR_CLIENT_SECRET, key), option


@pytest.mark.parametrize("worker", WORKERS)
def test_coordinator_checks_worker_certificates_against_their_service_name(
    rendered: Docs, worker: str
) -> None:
    # The coordinator dials each pod behind the headless Service by IP: the pod's certificate
    # is issued for the Service's DNS name, and that name is what must be checked.
    name = expanded_flag(deployment(rendered, COORDINATOR), SERVER_NAME_FLAGS[worker])
    assert name in service_dns_names(service_of(rendered, worker)), f"{SERVER_NAME_FLAGS[worker]} {name}"


def test_probes_use_the_plaintext_health_port(rendered: Docs) -> None:
    # The kubelet's gRPC probes cannot speak TLS: they go to --health-port, where the server
    # answers its health service alone in plaintext, never to the TLS port.
    for dep_name, _, container in containers(rendered):
        health = int(flag(container, "--health-port") or -1)
        assert health == container_port(container, "health"), dep_name
        assert health != int(flag(container, "--port") or -1), dep_name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["grpc"]["port"] == health, f"{dep_name} {probe}"


@pytest.mark.parametrize("component", COMPONENTS)
def test_no_pod_may_reach_a_health_port(rendered: Docs, component: str) -> None:
    # The kubelet probes from the node, which NetworkPolicies do not stop on common CNIs.
    rules = ingress_rules_to(rendered, component)
    assert rules is not None, f"no NetworkPolicy isolates {component} pods"
    container = main_container(deployment(rendered, component))
    assert not any(rule_covers_port(rule, container, "health") for rule in rules), component


def selector_is_empty(selector: dict[str, Any]) -> bool:
    return not selector.get("matchLabels") and not selector.get("matchExpressions")


def admits_every_source(peer: dict[str, Any]) -> bool:
    """Whether a NetworkPolicy peer admits everyone in its reach: any address, every pod of
    every namespace, or every pod of the policy's namespace."""
    if "ipBlock" in peer:
        return ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False).prefixlen == 0
    namespaces, pods = peer.get("namespaceSelector"), peer.get("podSelector")
    if namespaces is not None:
        return selector_is_empty(namespaces) and (pods is None or selector_is_empty(pods))
    return pods is not None and selector_is_empty(pods)


def test_coordinator_client_ports_do_not_admit_every_source(rendered: Docs) -> None:
    rules = ingress_rules_to(rendered, COORDINATOR)
    assert rules is not None, "no NetworkPolicy isolates the coordinator pods"
    container = main_container(deployment(rendered, COORDINATOR))
    for port in CLIENT_PORTS:
        for rule in rules:
            if rule_covers_port(rule, container, port):
                peers = rule.get("from", [])
                assert peers and not any(admits_every_source(p) for p in peers), f"{port}: {rule}"


def peer_admits(peer: dict[str, Any], labels: dict[str, str], namespace: dict[str, str] | None) -> bool:
    """Whether a peer admits a pod with these labels, of a namespace with these labels (None:
    the policy's own namespace)."""
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if namespace is None or not selector_matches(peer["namespaceSelector"], namespace):
            return False
    elif namespace is not None:
        return False
    return selector_matches(peer.get("podSelector", {}), labels)


@pytest.mark.parametrize(
    "client, labels, namespace",
    [
        ("a labelled pod of the namespace", {**CLIENT_LABEL, "app": "client"}, None),
        ("a pod of a labelled namespace", {"app": "ingress"}, {**CLIENT_LABEL, NAMESPACE_NAME_LABEL: "ingress"}),
    ],
)
def test_coordinator_client_ports_admit_clients_labelled_specdec_client(
    rendered: Docs, client: str, labels: dict[str, str], namespace: dict[str, str] | None
) -> None:
    container = main_container(deployment(rendered, COORDINATOR))
    rules = ingress_rules_to(rendered, COORDINATOR) or []
    for port in CLIENT_PORTS:
        assert any(
            rule_covers_port(rule, container, port)
            and (not rule.get("from") or any(peer_admits(p, labels, namespace) for p in rule["from"]))
            for rule in rules
        ), f"{client} cannot reach the coordinator's {port} port"


# --- dev-cpu's generated Secrets ----------------------------------------------------------


def rendered_secret(docs: Docs, base_name: str) -> dict[str, Any]:
    matches = [s for s in of_kind(docs, "Secret") if secret_base_name(s["metadata"]["name"]) == base_name]
    assert len(matches) == 1, f"{len(matches)} Secrets {base_name} rendered"
    return matches[0]


def certificate(secret: dict[str, Any], key: str = "tls.crt"):
    from cryptography import x509

    return x509.load_pem_x509_certificate(base64.b64decode(secret["data"][key]))


def certificate_names(cert) -> set[str]:
    from cryptography import x509

    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {*names.get_values_for_type(x509.DNSName), *map(str, names.get_values_for_type(x509.IPAddress))}


def extended_usages(cert) -> set:
    from cryptography import x509

    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_dev_cpu_renders_every_secret_its_pods_mount() -> None:
    docs = _render("dev-cpu")
    rendered_names = {s["metadata"]["name"] for s in of_kind(docs, "Secret")}
    for dep_name, pod, _ in containers(docs):
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                assert name in rendered_names, f"{dep_name}: Secret {name} not rendered"
                secret = rendered_secret(docs, secret_base_name(name))
                for item in volume["secret"].get("items", []):
                    assert item["key"] in secret.get("data", {}), f"{dep_name}: {name} has no {item['key']}"


@pytest.mark.parametrize("worker", WORKERS)
def test_dev_cpu_certificates_make_the_mutual_tls_the_coordinator_checks(worker: str) -> None:
    from cryptography.x509.oid import ExtendedKeyUsageOID

    docs = _render("dev-cpu")
    worker_secret = rendered_secret(docs, WORKER_TLS_SECRETS[worker])
    client_secret = rendered_secret(docs, COORDINATOR_CLIENT_SECRET)
    served, client = certificate(worker_secret), certificate(client_secret)
    name = expanded_flag(deployment(docs, COORDINATOR), SERVER_NAME_FLAGS[worker])
    assert name in certificate_names(served), f"the {worker} certificate does not name {name}"
    assert ExtendedKeyUsageOID.SERVER_AUTH in extended_usages(served)
    assert ExtendedKeyUsageOID.CLIENT_AUTH in extended_usages(client)
    # Each side trusts the CA that issued the other side's certificate (raises otherwise).
    served.verify_directly_issued_by(certificate(client_secret, "ca.crt"))
    client.verify_directly_issued_by(certificate(worker_secret, "ca.crt"))


def test_dev_cpu_coordinator_certificate_names_its_service_and_localhost() -> None:
    docs = _render("dev-cpu")
    names = certificate_names(certificate(rendered_secret(docs, COORDINATOR_TLS_SECRET)))
    assert service_dns_names(service_of(docs, COORDINATOR)) <= names
    assert "localhost" in names  # what a kubectl port-forward dials (k8s/README.md)


# --- k8s/cert-manager: the certificates the gpu overlay mounts ------------------------------


def issued_certificates() -> dict[str, dict[str, Any]]:
    """cert-manager Certificates by the Secret each writes."""
    return {c["spec"]["secretName"]: c for c in of_kind(_render(CERT_MANAGER), "Certificate")}


def mounted_secrets(docs: Docs) -> set[str]:
    return {
        volume["secret"]["secretName"]
        for _, pod, _ in containers(docs)
        for volume in pod.get("volumes", [])
        if "secret" in volume
    }


def test_cert_manager_issues_every_certificate_the_gpu_overlay_mounts() -> None:
    gpu, issued = _render("gpu"), issued_certificates()
    namespaces = {d["metadata"].get("namespace") for d in of_kind(gpu, "Deployment")}
    assert {c["metadata"].get("namespace") for c in issued.values()} == namespaces
    for name in mounted_secrets(gpu) - {AUTH_TOKENS_SECRET}:
        assert name in issued, f"no Certificate writes Secret {name}"


@pytest.mark.parametrize("worker", WORKERS)
def test_cert_manager_worker_certificates_name_what_the_coordinator_checks(worker: str) -> None:
    name = expanded_flag(deployment(_render("gpu"), COORDINATOR), SERVER_NAME_FLAGS[worker])
    certificate_spec = issued_certificates()[WORKER_TLS_SECRETS[worker]]["spec"]
    assert name in certificate_spec.get("dnsNames", []), f"the {worker} certificate does not name {name}"


def test_cert_manager_coordinator_certificate_names_its_service() -> None:
    spec = issued_certificates()[COORDINATOR_TLS_SECRET]["spec"]
    assert service_dns_names(service_of(_render("gpu"), COORDINATOR)) <= set(spec.get("dnsNames", []))


def test_cert_manager_issues_the_mounted_certificates_from_one_ca() -> None:
    # One CA: every Secret's ca.crt is the CA that issued the other side's certificate.
    docs, issued = _render(CERT_MANAGER), issued_certificates()
    leaves = [issued[name] for name in SECRETS - {AUTH_TOKENS_SECRET}]
    issuers = {(c["spec"]["issuerRef"].get("kind"), c["spec"]["issuerRef"]["name"]) for c in leaves}
    assert len(issuers) == 1, issuers
    ((kind, name),) = issuers
    (issuer,) = [i for i in of_kind(docs, kind) if i["metadata"]["name"] == name]
    assert issued[issuer["spec"]["ca"]["secretName"]]["spec"].get("isCA") is True
    assert "client auth" in issued[COORDINATOR_CLIENT_SECRET]["spec"]["usages"]
    for secret in (COORDINATOR_TLS_SECRET, *WORKER_TLS_SECRETS.values()):
        assert "server auth" in issued[secret]["spec"]["usages"], secret
