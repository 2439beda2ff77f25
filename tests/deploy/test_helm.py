"""The Helm chart in deploy/helm/pagedserve, rendered by Helm itself (Helm 4's Go SDK through helm-python-sdk) for
the value sets in its ci/ folder, and checked without a cluster: `helm lint --strict`; every built-in object against
the Kubernetes JSON schema in strict mode (kubernetes-validate); the custom resources field by field against what the
KubeRay, Prometheus-operator and KEDA CRDs document; and assertions on the rendered objects in the manner of
helm-unittest.
deploy/helm/install_helm.sh installs both tools."""
from __future__ import annotations

import functools
import json
import re
import tarfile
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (Helm's SDK) is missing: run deploy/helm/install_helm.sh")
kv = pytest.importorskip(
    "kubernetes_validate.utils", reason="kubernetes-validate is missing: run deploy/helm/install_helm.sh")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "pagedserve"
VALUE_SETS = sorted(p.stem.removesuffix("-values") for p in (CHART / "ci").glob("*-values.yaml"))
K8S_VERSION = "1.37.0"  # the newest Kubernetes kubernetes-validate has schemas for
# Not in Kubernetes' schema: checked field by field against their CRDs' documentation below.
CUSTOM_KINDS = {"RayCluster", "ServiceMonitor", "PrometheusRule", "ScaledObject"}
GPU = "nvidia.com/gpu"


def values(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text()) if name else {}


def merged(*names: str, **overrides) -> dict:
    """Value sets layered left to right, then overrides given as dotted paths: merged("cpu", **{"a.b": 1})."""
    out: dict = {}
    for layer in [values(n) for n in names] + [_nest(k, v) for k, v in overrides.items()]:
        _merge(out, layer)
    return out


def _nest(path: str, value) -> dict:
    for key in reversed(path.split(".")):
        value = {key: value}
    return value


def _merge(into: dict, layer: dict) -> None:
    for k, v in layer.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def render(vals: dict) -> dict[str, str]:
    """helm template: template path -> rendered text (NOTES.txt included)."""
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(vals, name="ps", namespace="llm")


def objects_for(vals: dict) -> list[dict]:
    """The rendered Kubernetes objects."""
    return [d for path, text in render(vals).items() if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]


@functools.cache
def objects(*names: str) -> tuple[dict, ...]:
    """The objects for value sets layered left to right (rendered once per test session)."""
    return tuple(objects_for(merged(*names)))


def one(docs, kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def pod_templates(docs) -> list[tuple[str, dict]]:
    """(role, pod template) for every pod the release makes: the server, or the KubeRay head and worker groups."""
    out = []
    for d in docs:
        if d["kind"] == "Deployment":
            out.append(("server", d["spec"]["template"]))
        elif d["kind"] == "RayCluster":
            out.append(("head", d["spec"]["headGroupSpec"]["template"]))
            out += [(f"worker:{g['groupName']}", g["template"]) for g in d["spec"]["workerGroupSpecs"]]
    return out


def gateway(docs) -> tuple[dict, dict]:
    """(pod template, container) of the pod that runs `pagedserve serve`."""
    role, tmpl = pod_templates(docs)[0]
    assert role in ("server", "head")
    return tmpl, tmpl["spec"]["containers"][0]


def flags(container: dict) -> dict[str, str]:
    """--name=value arguments of `pagedserve serve`."""
    return dict(a[2:].split("=", 1) for a in container["args"] if a.startswith("--") and "=" in a)


def all_pods(docs) -> list[tuple[str, dict]]:
    """pod_templates, with the KubeRay gateway Deployment's pods as role "gateway"."""
    gateways = [d["spec"]["template"] for d in docs
                if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway")]
    return [("gateway" if any(t is g for g in gateways) else role, t) for role, t in pod_templates(docs)]


def validate_k8s(obj: dict) -> None:
    try:
        kv.validate(obj, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        path = "/".join(str(p) for p in e.absolute_path)
        raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} at {path}: {e.message}") from None


# ---------------------------------------------------------------- helm lint --strict and the Kubernetes schemas

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(value_set):
    report = helm.lint(str(CHART), merged(value_set), strict=True, kube_version=f"v{K8S_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors fail --strict
    assert not report["errors"] and not problems, report


def test_value_sets_cover_the_issue():
    assert set(VALUE_SETS) == {"cpu", "gpu-tp4", "kuberay-dp2", "secured", "observability", "keda",
                               "kuberay-autoscale"}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_builtin_objects_match_the_kubernetes_schema(value_set):
    docs = objects(value_set)
    assert {d["kind"] for d in docs} >= {"Service", "PodDisruptionBudget"}
    for d in docs:
        if d["kind"] not in CUSTOM_KINDS:
            validate_k8s(d)


@pytest.mark.parametrize("value_set", ["kuberay-dp2", "observability", "secured"])
def test_custom_resources_embed_valid_kubernetes_objects(value_set):
    """A RayCluster's head and worker templates are core/v1 PodTemplateSpecs: validated as such."""
    docs = objects("kuberay-dp2", value_set) if value_set != "kuberay-dp2" else objects(value_set)
    for role, tmpl in pod_templates(docs):
        validate_k8s({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.replace(":", "-")},
                      "template": tmpl})


def test_every_object_has_the_recommended_labels():
    for names in [("cpu",), ("kuberay-dp2", "observability")]:
        for d in objects(*names):
            labels = d["metadata"]["labels"]
            for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                        "app.kubernetes.io/managed-by", "helm.sh/chart"):
                assert labels.get(key), (d["kind"], key)
            assert labels["app.kubernetes.io/managed-by"] == "Helm"


# ---------------------------------------------------------------- custom resources, field by field

def check_fields(obj, documented: dict, where: str) -> None:
    """documented: field -> expected type (a type, a tuple of types, or a nested dict for an object)."""
    assert isinstance(obj, dict), f"{where} is not an object"
    unknown = set(obj) - set(documented)
    assert not unknown, f"{where}: fields the CRD does not document: {sorted(unknown)}"
    for key in obj.keys() & documented.keys():
        kind, value = documented[key], obj[key]
        if isinstance(kind, dict):
            check_fields(value, kind, f"{where}.{key}")
            continue
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(value, bool) if bool in kinds else isinstance(value, kinds) and not isinstance(value, bool)
        assert ok, f"{where}.{key}: {value!r} is not {kind}"


STR_MAP = dict  # map[string]string in the CRDs: checked for string values separately
# ray.io/v1 RayCluster as KubeRay v1.5.1 documents it (ray.io_rayclusters.yaml; authOptions.secretName from v1.6.0).
RAYCLUSTER_SPEC = {
    "headGroupSpec": {"template": dict, "rayStartParams": STR_MAP, "serviceType": str, "enableIngress": bool,
                      "headService": dict, "labels": STR_MAP, "resources": STR_MAP},
    "workerGroupSpecs": list, "rayVersion": str, "authOptions": {"mode": str, "secretName": str},
    "enableInTreeAutoscaling": bool, "autoscalerOptions": dict, "headServiceAnnotations": STR_MAP,
    "suspend": bool, "managedBy": str, "gcsFaultToleranceOptions": dict,
}
WORKER_GROUP = {"groupName": str, "replicas": int, "minReplicas": int, "maxReplicas": int, "rayStartParams": STR_MAP,
                "template": dict, "numOfHosts": int, "idleTimeoutSeconds": int, "scaleStrategy": dict,
                "suspend": bool, "labels": STR_MAP, "resources": STR_MAP}
# monitoring.coreos.com/v1 as the Prometheus operator documents them (the fields this chart may set).
SERVICEMONITOR_SPEC = {"selector": {"matchLabels": STR_MAP, "matchExpressions": list},
                       "namespaceSelector": {"any": bool, "matchNames": list}, "endpoints": list,
                       "jobLabel": str, "targetLabels": list, "podTargetLabels": list, "sampleLimit": int}
SM_ENDPOINT = {"port": str, "targetPort": (int, str), "path": str, "scheme": str, "interval": str,
               "scrapeTimeout": str, "honorLabels": bool, "tlsConfig": dict, "relabelings": list,
               "metricRelabelings": list, "params": dict}
RULE_GROUP = {"name": str, "interval": str, "rules": list, "limit": int, "labels": STR_MAP,
              "partial_response_strategy": str, "query_offset": str}
RULE = {"alert": str, "record": str, "expr": (str, int), "for": str, "keep_firing_for": str, "labels": STR_MAP,
        "annotations": STR_MAP}
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"


def assert_str_map(m: dict, where: str) -> None:
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in m.items()), f"{where}: not map[string]string"


def test_raycluster_fields_are_kuberays():
    rc = one(objects("kuberay-dp2"), "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    check_fields(spec, RAYCLUSTER_SPEC, "spec")
    assert spec["authOptions"] == {"mode": "token"}  # token authentication on; KubeRay generates the token
    assert spec["rayVersion"] == "2.60.0"
    head = spec["headGroupSpec"]
    assert "template" in head and head["serviceType"] in ("ClusterIP", "NodePort", "LoadBalancer")
    assert_str_map(head["rayStartParams"], "headGroupSpec.rayStartParams")
    assert head["rayStartParams"]["num-cpus"] == "0"  # no engine actor lands on the gateway's pod
    groups = spec["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["h100", "a100"]
    for g in groups:
        check_fields(g, WORKER_GROUP, f"workerGroupSpecs[{g['groupName']}]")
        assert {"groupName", "minReplicas", "maxReplicas", "template"} <= set(g)  # the CRD's required fields
        assert_str_map(g["rayStartParams"], "rayStartParams")
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]


def test_raycluster_auth_secret_name():
    rc = one(objects_for(merged("kuberay-dp2", **{"kuberay.auth.secretName": "ray-token"})), "RayCluster")
    assert rc["spec"]["authOptions"] == {"mode": "token", "secretName": "ray-token"}


def test_kuberay_head_runs_ray_and_the_gateway():
    """KubeRay keeps our command (annotation) and hands us its `ray start` in $KUBERAY_GEN_RAY_START_CMD: the head
    starts it in the background, waits for the GCS, then execs the gateway under tini, which alone gets SIGTERM."""
    rc = one(objects("kuberay-dp2"), "RayCluster")
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    _, head = gateway(objects("kuberay-dp2"))
    assert head["command"][:5] == ["tini", "--", "bash", "-c", head["command"][4]]
    script = head["command"][4]
    assert '"$KUBERAY_GEN_RAY_START_CMD" &' in script and 'ray health-check --address "$RAY_ADDRESS"' in script
    assert script.rstrip().endswith('exec pagedserve "$@"')
    assert head["args"][:2] == ["--log-level=INFO", "serve"]
    assert "ray-address" not in flags(head)  # RAY_ADDRESS, set by KubeRay, points at the head's own Ray
    for _, tmpl in pod_templates(objects("kuberay-dp2"))[1:]:
        worker = tmpl["spec"]["containers"][0]
        assert worker["command"][:2] == ["tini", "--"] and "KUBERAY_GEN_RAY_START_CMD" in worker["command"][-1]


def test_servicemonitor_fields_are_the_operators():
    docs = objects("observability")
    sm = one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    check_fields(sm["spec"], SERVICEMONITOR_SPEC, "spec")
    assert {"selector", "endpoints"} <= set(sm["spec"])  # required by the CRD
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for ep in sm["spec"]["endpoints"]:
        check_fields(ep, SM_ENDPOINT, "endpoints[]")
        assert ep["scheme"] in ("http", "https", "HTTP", "HTTPS")
        assert re.match(DURATION, ep["interval"]) and re.match(DURATION, ep["scrapeTimeout"])
    # It selects the Service by its labels, and names a port the Service has.
    svc = one(docs, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}


def test_prometheusrule_fields_are_the_operators_and_equal_alerts_yml():
    rule = one(objects("observability"), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    check_fields(rule["spec"], {"groups": list}, "spec")
    for g in rule["spec"]["groups"]:
        check_fields(g, RULE_GROUP, "groups[]")
        assert g["name"]
        for r in g["rules"]:
            check_fields(r, RULE, f"{g['name']}.rules[]")
            assert "expr" in r and ("alert" in r) != ("record" in r)
            assert "for" not in r or re.match(DURATION, r["for"])
            assert_str_map(r.get("labels", {}), "labels")
            assert_str_map(r.get("annotations", {}), "annotations")
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"] == alerts


def test_alerts_and_dashboard_have_one_source():
    for name, target in [("alerts.yml", "deploy/prometheus/alerts.yml"),
                         ("pagedserve-dashboard.json", "deploy/grafana/pagedserve-dashboard.json")]:
        link = CHART / "files" / name
        assert link.is_symlink(), f"{link} should link to {target}, not copy it"
        assert link.resolve() == (REPO / target).resolve()


def test_packaged_chart_carries_the_linked_files(tmp_path):
    """helm package follows the links: the archive holds the files' contents."""
    with helm.Chart.load(str(CHART)) as chart:
        archive = chart.save(str(tmp_path))
    with tarfile.open(archive) as tar:
        alerts = tar.extractfile("pagedserve/files/alerts.yml").read().decode()
    assert alerts == (REPO / "deploy" / "prometheus" / "alerts.yml").read_text()


def test_grafana_dashboard_configmap_for_the_sidecar():
    cm = one(objects("observability"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    dashboard = json.loads((REPO / "deploy" / "grafana" / "pagedserve-dashboard.json").read_text())
    assert json.loads(cm["data"]["pagedserve-dashboard.json"]) == dashboard


def test_observability_is_off_by_default():
    kinds = {d["kind"] for d in objects("cpu")}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "ConfigMap"}


# ---------------------------------------------------------------- helm-unittest-style assertions

def test_single_node_cpu():
    docs = objects("cpu")
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "PodDisruptionBudget"}
    tmpl, c = gateway(docs)
    assert c["image"] == "localhost/pagedserve:ci"
    assert c["args"][:2] == ["--log-level=INFO", "serve"] and "command" not in c  # the image's tini entrypoint
    f = flags(c)
    assert f["device"] == "cpu" and f["tensor-parallel-size"] == "1" and "model" not in f  # the bundled model
    assert GPU not in c["resources"].get("limits", {}) and "runtimeClassName" not in tmpl["spec"]


def test_gpu_count_equals_tensor_parallel_size():
    tmpl, c = gateway(objects("gpu-tp4"))
    f = flags(c)
    assert f["tensor-parallel-size"] == "4" and f["device"] == "cuda"
    assert c["resources"]["limits"][GPU] == 4
    assert tmpl["spec"]["runtimeClassName"] == "nvidia"
    assert tmpl["spec"]["tolerations"][0]["key"] == GPU
    assert tmpl["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert f["model"] == "/models/Meta-Llama-3-8B-Instruct"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "llama-3-8b", "readOnly": True}} \
        in tmpl["spec"]["volumes"]


def test_single_node_update_strategy():
    dep = one(objects_for(merged("gpu-tp4", **{"singleNode.strategy": {"type": "Recreate"}})), "Deployment")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert "strategy" not in one(objects("cpu"), "Deployment")["spec"]  # Kubernetes' default


def test_single_node_data_parallel_takes_tp_times_dp_gpus():
    docs = objects_for(merged("gpu-tp4", **{"engine.dataParallelSize": 2}))
    _, c = gateway(docs)
    assert c["resources"]["limits"][GPU] == 8


def test_disaggregated_replicas_pass_their_flags_and_take_their_gpus():
    """engine.prefillReplicas / decodeReplicas become serve's --prefill-replicas / --decode-replicas (no
    --data-parallel-size); single-node, the pod takes a TP group's GPUs per replica of both pools; KubeRay gateways
    get the conditional-disaggregation knob; engine.kvLeaseTimeout becomes --kv-lease-timeout."""
    docs = objects_for(merged("gpu-tp4", **{"engine.prefillReplicas": 1, "engine.decodeReplicas": 2,
                                            "engine.maxLocalPrefillLength": 256, "engine.kvLeaseTimeout": 15}))
    _, c = gateway(docs)
    f = flags(c)
    assert (f["prefill-replicas"], f["decode-replicas"], f["max-local-prefill-length"]) == ("1", "2", "256")
    assert f["kv-lease-timeout"] == "15"
    assert "data-parallel-size" not in f
    assert c["resources"]["limits"][GPU] == 4 * 3
    # with the autoscaler, each pool may grow to its max
    docs = objects_for(merged("gpu-tp4", **{"engine.prefillReplicas": 1, "engine.decodeReplicas": 1,
                                            "server.autoscale": "max=3"}))
    assert gateway(docs)[1]["resources"]["limits"][GPU] == 4 * 2 * 3
    docs = objects_for(merged("kuberay-dp2", **{"engine.dataParallelSize": 1, "engine.prefillReplicas": 1,
                                                "engine.decodeReplicas": 1, "engine.maxLocalPrefillLength": 64,
                                                "kuberay.gateways.enabled": True}))
    pods = dict(all_pods(docs))
    assert flags(pods["head"]["spec"]["containers"][0])["prefill-replicas"] == "1"
    assert flags(pods["gateway"]["spec"]["containers"][0])["max-local-prefill-length"] == "64"


def test_kuberay_gpus_per_worker_equal_tp_and_replicas_fit():
    docs = objects("kuberay-dp2")
    _, head = gateway(docs)
    f = flags(head)
    tp, dp = int(f["tensor-parallel-size"]), int(f["data-parallel-size"])
    assert (tp, dp) == (4, 2) and f["device"] == "cuda"  # explicit: the head has no GPU to detect
    assert GPU not in head["resources"].get("limits", {})
    workers = pod_templates(docs)[1:]
    assert len(workers) == 2
    slots = 0
    for role, tmpl in workers:
        gpus = tmpl["spec"]["containers"][0]["resources"]["limits"][GPU]
        assert gpus == tp, role
        group = next(g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"] if role.endswith(g["groupName"]))
        slots += group["replicas"] * (gpus // tp)
        assert tmpl["spec"]["runtimeClassName"] == "nvidia"
    assert slots >= dp


@pytest.mark.parametrize("value_set", ["cpu", "kuberay-dp2"])
def test_probes_point_at_the_grpc_port(value_set):
    _, c = gateway(objects(value_set))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == int(flags(c)["grpc-port"]) == 50051
    assert ports["metrics"] == int(flags(c)["metrics-port"])
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[name]["grpc"] == {"port": ports["grpc"]}, name  # grpc.health.v1, the server's overall health
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # room for loading and warm-up


def test_http_api_port_and_probe():
    _, c = gateway(objects("cpu"))
    assert flags(c)["port"] == "8000" and {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    _, c = gateway(objects_for(merged("cpu", **{"probes.handler": "http"})))
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[name]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    docs = objects_for(merged("cpu", **{"server.httpApi.enabled": False}))
    _, c = gateway(docs)
    assert flags(c)["port"] == "0" and "http" not in {p["name"] for p in c["ports"]}  # --port 0: no HTTP API
    assert "http" not in {p["name"] for p in one(docs, "Service")["spec"]["ports"]}


PORTS = {"server.httpApi.port": 8080, "server.grpcPort": 9000, "server.metricsPort": 9500}


@pytest.mark.parametrize("names", [("cpu",), ("kuberay-dp2",)])
def test_port_flags_follow_vllm_serve(names):
    """`--port` is the HTTP API and `--grpc-port` the gRPC API, as `vllm serve` names them, in `serve` and in
    `gateway` alike; the container ports, the Service and the probes agree with the flags. --http-port is gone."""
    docs = objects_for(merged(*names, **{"kuberay.gateways.enabled": True}, **PORTS))
    svc = {p["name"]: (p["port"], p["targetPort"]) for p in one(docs, "Service")["spec"]["ports"]}
    assert svc == {"grpc": (9000, "grpc"), "http": (8080, "http"), "metrics": (9500, "metrics")}
    gateways = [(role, t["spec"]["containers"][0]) for role, t in all_pods(docs)
                if role in ("server", "head", "gateway")]
    assert len(gateways) == (2 if names == ("kuberay-dp2",) else 1)
    for role, c in gateways:
        f = flags(c)
        assert (f["port"], f["grpc-port"], f["metrics-port"], f["host"]) == ("8080", "9000", "9500", "0.0.0.0"), role
        assert not [a for a in c["args"] if a.startswith("--http-port")], role
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert (ports["http"], ports["grpc"], ports["metrics"]) == (8080, 9000, 9500), role
        assert c["readinessProbe"]["grpc"] == {"port": 9000}, role
    for role, t in all_pods(docs):
        if role.startswith("worker"):
            assert "args" not in t["spec"]["containers"][0], role  # `ray start` alone: no API on the workers


@pytest.mark.parametrize("value_set", ["cpu", "gpu-tp4", "kuberay-dp2"])
def test_grace_period_exceeds_drain_timeout(value_set):
    docs = objects(value_set)
    drain = float(flags(gateway(docs)[1])["drain-timeout"])
    for role, tmpl in pod_templates(docs):
        assert tmpl["spec"]["terminationGracePeriodSeconds"] > drain, role


# Where the processes write with a read-only root: Ray's session dir (/tmp/ray) and compilers' temporary files;
# $HOME (~/.ray/auth_token of the private Ray, ~/.cache, ~/.triton, ~/.nv); the CPU kernel cache.
SCRATCH = {"tmp": "/tmp", "home": "/home/pagedserve", "kernel-cache": "/var/cache/pagedserve/torch_extensions"}
EVERY_POD = [(), ("cpu",), ("gpu-tp4",), ("kuberay-dp2", "secured")]


@pytest.mark.parametrize("names", EVERY_POD)
def test_pods_are_non_root_with_a_read_only_root(names):
    docs = objects_for(merged(*names, **{"kuberay.gateways.enabled": True}))
    pods = all_pods(docs)
    assert len(pods) == (4 if names and names[0] == "kuberay-dp2" else 1)  # head, 2 worker groups, gateways
    for role, tmpl in pods:
        spec = tmpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001, role
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, role
        assert spec["automountServiceAccountToken"] is False, role
        (c,) = spec["containers"]
        assert c["securityContext"] == {"readOnlyRootFilesystem": True, "runAsNonRoot": True,
                                        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}, role


@pytest.mark.parametrize("names", EVERY_POD)
def test_writable_dirs_are_emptydirs(names):
    """A read-only root leaves the container /dev/shm (memory-backed, Ray's object store) and the scratch
    emptyDirs; HOME and TORCH_EXTENSIONS_DIR point into them whatever user the pod runs as."""
    docs = objects_for(merged(*names, **{"kuberay.gateways.enabled": True}))
    for role, tmpl in all_pods(docs):
        volumes = {v["name"]: v for v in tmpl["spec"]["volumes"]}
        c = tmpl["spec"]["containers"][0]
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        shm = "16Gi" if "gpu-tp4" in names else "8Gi"
        assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}, role
        assert mounts["dshm"] == {"name": "dshm", "mountPath": "/dev/shm"}, role
        for name, path in SCRATCH.items():
            assert volumes[name] == {"name": name, "emptyDir": {}}, role
            assert mounts[name] == {"name": name, "mountPath": path}, role
        writable = {m["mountPath"] for m in c["volumeMounts"] if "emptyDir" in volumes[m["name"]]}
        assert writable == {"/dev/shm", *SCRATCH.values()}, role
        assert all(m.get("readOnly") for m in c["volumeMounts"] if "emptyDir" not in volumes[m["name"]]), role
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HOME"] == SCRATCH["home"] and env["TORCH_EXTENSIONS_DIR"] == SCRATCH["kernel-cache"], role


def test_scratch_is_configurable():
    docs = objects_for(merged("kuberay-dp2", **{
        "scratch.tmp.sizeLimit": "20Gi", "scratch.home.mountPath": "/var/lib/pagedserve",
        "scratch.kernelCache.mountPath": "/cache/kernels",
        "scratch.extra": [{"name": "hf", "mountPath": "/hf", "sizeLimit": "1Gi"}],
        "securityContext": {"readOnlyRootFilesystem": False}}))
    for role, tmpl in all_pods(docs):
        volumes = {v["name"]: v for v in tmpl["spec"]["volumes"]}
        c = tmpl["spec"]["containers"][0]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert volumes["tmp"]["emptyDir"] == {"sizeLimit": "20Gi"} and volumes["hf"]["emptyDir"] == {"sizeLimit": "1Gi"}
        assert (mounts["home"], mounts["kernel-cache"], mounts["hf"]) == \
            ("/var/lib/pagedserve", "/cache/kernels", "/hf"), role
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["HOME"] == "/var/lib/pagedserve" and env["TORCH_EXTENSIONS_DIR"] == "/cache/kernels", role
        assert c["securityContext"]["readOnlyRootFilesystem"] is False, role  # Helm merges the rest in
    for d in docs:
        if d["kind"] not in CUSTOM_KINDS:
            validate_k8s(d)


# ---------------------------------------------------------------- NetworkPolicy

API_FROM = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}},
            {"ipBlock": {"cidr": "10.0.0.0/8"}}]
MONITORING = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
               "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
NETPOL = {"networkPolicy.enabled": True, "networkPolicy.api.from": API_FROM,
          "networkPolicy.metrics.from": MONITORING, "kuberay.gateways.enabled": True}
ANY = "any source"


def admitted(policy: dict, container: dict, port: int) -> list:
    """The peers the policy admits to a container's TCP port (ANY for every source), read as a CNI would: a rule
    without ports covers every port; a named port matches the container's port of that name."""
    names = {p["containerPort"]: p["name"] for p in container.get("ports", [])}
    out: list = []
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports is None or any(p.get("protocol", "TCP") == "TCP" and p["port"] in (port, names.get(port))
                                for p in ports):
            out += rule.get("from") or [ANY]
    return out


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}
    return selector["matchLabels"].items() <= labels.items()


def release_peer(peers: list, labels: dict) -> bool:
    """Whether the peers are exactly this release's pods (a podSelector on its labels)."""
    return len(peers) == 1 and set(peers[0]) == {"podSelector"} and selects(peers[0]["podSelector"], labels)


def test_network_policy_is_off_by_default():
    for names in [(), ("kuberay-dp2",)]:
        assert "NetworkPolicy" not in {d["kind"] for d in objects(*names)}


@pytest.mark.parametrize("names", [(), ("cpu",), ("gpu-tp4",), ("kuberay-dp2",), ("kuberay-dp2", "secured")])
def test_network_policy_objects_validate(names):
    docs = objects_for(merged(*names, **NETPOL, **{"networkPolicy.egress.restricted": True}))
    pol = one(docs, "NetworkPolicy")
    for d in docs:
        if d["kind"] not in CUSTOM_KINDS:
            validate_k8s(d)
    # It covers every pod of the release, and nothing selects the pods of another release.
    for role, tmpl in all_pods(docs):
        assert selects(pol["spec"]["podSelector"], tmpl["metadata"]["labels"]), role
    assert pol["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "ps"


def test_network_policy_single_node():
    """The API ports from the configured peers, metrics from the monitoring selector, nothing else: the private Ray
    talks over the pod's loopback."""
    docs = objects_for(merged("cpu", **NETPOL))
    pol = one(docs, "NetworkPolicy")
    assert pol["spec"]["policyTypes"] == ["Ingress"] and "egress" not in pol["spec"]  # egress open by default
    (_, tmpl), = all_pods(docs)
    c = tmpl["spec"]["containers"][0]
    assert admitted(pol, c, 50051) == API_FROM and admitted(pol, c, 8000) == API_FROM
    assert admitted(pol, c, 9400) == MONITORING
    for port in (6379, 8265, 10001, 52365):  # Ray's, had they been reachable
        assert admitted(pol, c, port) == [], port
    # Empty `from` lists admit every source, as in a NetworkPolicy itself; with the HTTP API off its port is gone.
    pol = one(objects_for(merged("cpu", **{"networkPolicy.enabled": True, "server.httpApi.enabled": False})),
              "NetworkPolicy")
    assert admitted(pol, c, 50051) == [ANY] and admitted(pol, c, 9400) == [ANY]
    assert {p["port"] for r in pol["spec"]["ingress"] for p in r["ports"]} == {"grpc", "metrics"}


def test_network_policy_kuberay():
    """The head and the gateways: the API from the configured peers, metrics from monitoring; the Ray ports of every
    Ray pod from this release's pods (plus networkPolicy.ray.from) and nowhere else."""
    docs = objects_for(merged("kuberay-dp2", **NETPOL))
    pol = one(docs, "NetworkPolicy")
    pods = all_pods(docs)
    assert sorted(r for r, _ in pods) == ["gateway", "head", "worker:a100", "worker:h100"]
    for role, tmpl in pods:
        c, labels = tmpl["spec"]["containers"][0], tmpl["metadata"]["labels"]
        if role in ("head", "gateway"):  # the release's own pods reach every port of one another
            for port, peers in [(50051, API_FROM), (8000, API_FROM), (9400, MONITORING)]:
                got = admitted(pol, c, port)
                assert got[:-1] == peers and release_peer(got[-1:], labels), (role, port)
        ray_ports = [6379, 8265, 10001] if role == "head" else [6379, 12345, 52365]
        for port in ray_ports:
            peers = admitted(pol, c, port)
            assert release_peer(peers, labels), (role, port, peers)
        if role.startswith("worker"):  # no API there: 50051 is just another port, open to the release only
            assert release_peer(admitted(pol, c, 50051), labels)
    ray_ns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray"}}}
    pol = one(objects_for(merged("kuberay-dp2", **NETPOL, **{"networkPolicy.ray.from": [ray_ns]})), "NetworkPolicy")
    _, head = gateway(objects("kuberay-dp2"))
    peers = admitted(pol, head, 8265)  # the dashboard: the release's pods, then the extra peers
    assert len(peers) == 2 and peers[1] == ray_ns


def test_network_policy_restricted_egress():
    extra = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    docs = objects_for(merged("kuberay-dp2", **NETPOL, **{"networkPolicy.egress.restricted": True,
                                                           "networkPolicy.egress.to": [extra]}))
    pol = one(docs, "NetworkPolicy")
    assert pol["spec"]["policyTypes"] == ["Ingress", "Egress"]
    dns, release, *rest = pol["spec"]["egress"]
    assert dns == {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}  # to anywhere
    assert set(release) == {"to"}
    for role, tmpl in all_pods(docs):
        assert release_peer(release["to"], tmpl["metadata"]["labels"]), role
    assert rest == [extra]


def test_secured_api_key_and_tls_from_secrets():
    for names in [("secured",), ("kuberay-dp2", "secured")]:
        tmpl, c = gateway(objects(*names))
        assert "PAGEDSERVE_API_KEY" not in {e["name"] for e in c.get("env", [])}  # a file, not the environment
        assert {"name": "api-key", "secret": {"secretName": "pagedserve-api-key", "defaultMode": 0o440}} in \
            tmpl["spec"]["volumes"]
        assert {"name": "api-key", "mountPath": "/etc/pagedserve/api-key", "readOnly": True} in c["volumeMounts"]
        assert {"name": "tenants", "secret": {"secretName": "pagedserve-tenants", "defaultMode": 0o440}} in \
            tmpl["spec"]["volumes"]
        assert {"name": "tenants", "mountPath": "/etc/pagedserve/tenants", "readOnly": True} in c["volumeMounts"]
        assert {"name": "tls", "secret": {"secretName": "pagedserve-tls"}} in tmpl["spec"]["volumes"]
        f = flags(c)
        assert f["ssl-certfile"] == "/etc/pagedserve/tls/tls.crt" and f["ssl-keyfile"] == "/etc/pagedserve/tls/tls.key"
        assert f["api-key-file"] == "/etc/pagedserve/api-key/api-key" and "api-key" not in f  # the key never in argv
        assert f["tenants-file"] == "/etc/pagedserve/tenants/tenants.json"
        # The kubelet's plain gRPC probe cannot speak TLS: the probes run the CLI, verifying against the CA.
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[name]["exec"]["command"] == [
                "env", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH=/etc/pagedserve/tls/ca.crt",
                "pagedserve", "health", "--server=localhost:50051", "--tls"]
    _, c = gateway(objects_for(merged("secured", **{"tls.probeMode": "grpc"})))
    assert c["readinessProbe"]["grpc"] == {"port": 50051, "mode": "TLS"}  # Kubernetes >= 1.37
    validate_k8s(one(objects_for(merged("secured", **{"tls.probeMode": "grpc"})), "Deployment"))


@pytest.mark.parametrize("value_set", ["cpu", "kuberay-dp2"])
def test_service_and_pdb_select_the_right_pods(value_set):
    docs = objects(value_set)
    svc, pdb = one(docs, "Service"), one(docs, "PodDisruptionBudget")
    tmpl, c = gateway(docs)
    labels = tmpl["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    for role, other in pod_templates(docs)[1:]:  # KubeRay workers serve no API
        assert not svc["spec"]["selector"].items() <= other["metadata"]["labels"].items(), role
    container_ports = {p["name"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    for role, t in pod_templates(docs):
        assert pdb["spec"]["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items(), role
    assert pdb["spec"]["maxUnavailable"] == 1


def test_notes_show_port_forward_and_a_client_call():
    notes = render(merged("secured"))["pagedserve/templates/NOTES.txt"]
    assert "kubectl port-forward -n llm svc/ps-pagedserve 50051:50051" in notes
    assert 'pagedserve client --server localhost:50051 --tls --ca-cert ca.crt "def fib(n):"' in notes
    assert "PAGEDSERVE_API_KEY=$(kubectl get secret -n llm pagedserve-api-key" in notes


# ---------------------------------------------------------------- bad values fail `helm template`

BAD_VALUES = {
    "unknown mode": {"mode": "multiNode"},
    "unknown device": {"engine": {"device": "tpu"}},
    "unknown dtype": {"engine": {"dtype": "int3"}},
    "unknown probe handler": {"probes": {"handler": "tcp"}},
    "unknown pull policy": {"image": {"pullPolicy": "Sometimes"}},
    "unknown log level": {"server": {"logLevel": "LOUD"}},
    "unknown model source": {"model": {"source": "s3"}},
    "tp of zero": {"engine": {"tensorParallelSize": 0}},
    "tp as a string": {"engine": {"tensorParallelSize": "4"}},
    "port out of range": {"server": {"grpcPort": 70000}},
    "a misspelt key": {"engine": {"tensorParalelSize": 2}},
    "tls without a secret": {"tls": {"enabled": True}},
    "pvc without a claim": {"model": {"source": "pvc"}},
    "relative image model path": {"model": {"source": "image", "path": "models/x"}},
    "kuberay without worker groups": {"mode": "kuberay", "kuberay": {"workerGroups": []}},
    "bad worker group name": {"mode": "kuberay", "kuberay": {"workerGroups": [{"name": "GPU_A", "replicas": 1}]}},
    "unknown update strategy": {"singleNode": {"strategy": {"type": "BlueGreen"}}},
    "bad scrape interval": {"metrics": {"serviceMonitor": {"enabled": True, "interval": "15 seconds"}}},
    "a misspelt peer": {"networkPolicy": {"enabled": True, "api": {"from": [{"podselector": {}}]}}},
    "an empty peer": {"networkPolicy": {"enabled": True, "metrics": {"from": [{}]}}},
    "egress restricted as a string": {"networkPolicy": {"egress": {"restricted": "yes"}}},
    "a relative scratch path": {"scratch": {"tmp": {"mountPath": "tmp"}}},
    "a scratch size that is no quantity": {"scratch": {"home": {"sizeLimit": "lots"}}},
    "an extra scratch dir named as a built-in one": {"scratch": {"extra": [{"name": "tmp", "mountPath": "/t"}]}},
    "an extra scratch dir without a path": {"scratch": {"extra": [{"name": "x"}]}},
    "a scratch dir named as the tenants secret": {"scratch": {"extra": [{"name": "tenants", "mountPath": "/t"}]}},
    "a tenants secret without a key": {"tenants": {"existingSecret": "t", "secretKey": ""}},
    # Checked by the templates (a schema cannot compare two values):
    "grace period within the drain": {"terminationGracePeriodSeconds": 30, "engine": {"drainTimeout": 30}},
    "http probe without the http api": {"probes": {"handler": "http"}, "server": {"httpApi": {"enabled": False}}},
    "worker pods smaller than tp": {"mode": "kuberay", "gpu": {"enabled": True}, "engine": {"tensorParallelSize": 4},
                                    "kuberay": {"workerGroups": [{"name": "g", "replicas": 2, "gpusPerPod": 2}]}},
    "too few gpus for dp": {"mode": "kuberay", "gpu": {"enabled": True},
                            "engine": {"tensorParallelSize": 2, "dataParallelSize": 3},
                            "kuberay": {"workerGroups": [{"name": "g", "replicas": 1, "gpusPerPod": 4}]}},
    # Elastic replicas (issue 34): server.autoscale as `serve --autoscale` parses it, KubeRay's worker ranges, KEDA.
    "an autoscale key serve does not know": {"server": {"autoscale": "min=1,max=4,queue=3"}},
    # Disaggregated prefill and decode (issue 68), as `serve` refuses it.
    "prefill replicas without decode replicas": {"engine": {"prefillReplicas": 1}},
    "decode replicas without prefill replicas": {"engine": {"decodeReplicas": 2}},
    "prefill replicas beside data parallelism": {"engine": {"prefillReplicas": 1, "decodeReplicas": 1,
                                                            "dataParallelSize": 2}},
    "prefill replicas beyond the worker pods": {"mode": "kuberay", "gpu": {"enabled": True},
                                                "engine": {"prefillReplicas": 1, "decodeReplicas": 2},
                                                "kuberay": {"workerGroups": [{"name": "g", "replicas": 2}]}},
    "an autoscale without KEY=VALUE": {"server": {"autoscale": "max"}},
    "an autoscale min of zero": {"server": {"autoscale": "min=0,max=2"}},
    "an autoscale max that is no integer": {"server": {"autoscale": "max=2.5"}},
    "an autoscale target of zero": {"server": {"autoscale": "waiting=0"}},
    "an autoscale as a number": {"server": {"autoscale": 4}},
    "an autoscale min above max": {"server": {"autoscale": "min=3,max=2"}},
    "an autoscale min above the default max": {"server": {"autoscale": "min=5"}},
    "an unknown upscaling mode": {"mode": "kuberay", "kuberay": {"autoscaling": {"upscalingMode": "Eager"}}},
    "a negative idle timeout": {"mode": "kuberay", "kuberay": {"autoscaling": {"idleTimeoutSeconds": -1}}},
    "a worker group's maxReplicas of zero": {"mode": "kuberay", "kuberay": {"workerGroups": [
        {"name": "g", "replicas": 1, "maxReplicas": 0}]}},
    "worker replicas outside min..max": {"mode": "kuberay", "kuberay": {
        "autoscaling": {"enabled": True}, "workerGroups": [{"name": "g", "replicas": 3, "minReplicas": 0,
                                                            "maxReplicas": 2}]}},
    "autoscale max beyond the worker pods": {"mode": "kuberay", "gpu": {"enabled": True},
                                             "server": {"autoscale": "min=1,max=3"},
                                             "kuberay": {"workerGroups": [{"name": "g", "replicas": 2}]}},
    "autoscale max beyond the worker groups' maxReplicas": {
        "mode": "kuberay", "gpu": {"enabled": True}, "server": {"autoscale": "max=4"},
        "kuberay": {"autoscaling": {"enabled": True},
                    "workerGroups": [{"name": "g", "replicas": 1, "maxReplicas": 3}]}},
    "keda in kuberay mode": {"mode": "kuberay", "keda": {"enabled": True}},
    "keda with the in-server autoscaler": {"keda": {"enabled": True}, "server": {"autoscale": "max=2"}},
    "keda min above max": {"keda": {"enabled": True, "minReplicaCount": 5, "maxReplicaCount": 2}},
    "keda scaling to zero": {"keda": {"enabled": True, "minReplicaCount": 0}},
    "keda without triggers": {"keda": {"enabled": True, "triggers": []}},
    "a keda trigger without a threshold": {"keda": {"enabled": True, "triggers": [{"query": "up"}]}},
    "a keda threshold of zero": {"keda": {"enabled": True, "triggers": [{"query": "up", "threshold": "0.0"}]}},
    "a keda threshold below zero": {"keda": {"enabled": True, "triggers": [{"query": "up", "threshold": -2}]}},
    "a keda metric type HPA has not": {"keda": {"enabled": True, "triggers": [
        {"query": "up", "threshold": "1", "metricType": "Utilization"}]}},
    "keda trigger names used twice": {"keda": {"enabled": True, "triggers": [
        {"name": "a", "query": "up", "threshold": "1"}, {"name": "a", "query": "up", "threshold": "2"}]}},
    "a prometheus address that is no url": {"keda": {"prometheus": {"serverAddress": "prometheus:9090"}}},
    "extra metadata overriding the query": {"keda": {"prometheus": {"extraMetadata": {"query": "up"}}}},
    "a scale-down window beyond the hpa's": {"keda": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 7200}}}},
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_rejected(case):
    with pytest.raises(helm.HelmError):
        render(BAD_VALUES[case])


def test_schema_rejections_name_the_field():
    with pytest.raises(helm.HelmValuesError, match="/engine/device"):
        render({"engine": {"device": "tpu"}})
    with pytest.raises(helm.HelmError, match="must exceed engine.drainTimeout"):
        render({"terminationGracePeriodSeconds": 10})


@pytest.mark.parametrize("overrides", [{}, {"networkPolicy.enabled": True}])
def test_default_values_render(overrides):
    docs = objects_for(merged(**overrides))
    assert one(docs, "Deployment")["spec"]["replicas"] == 1
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "PodDisruptionBudget"} | (
        {"NetworkPolicy"} if overrides else set())
    for d in docs:
        validate_k8s(d)


def test_kuberay_gateway_deployment():
    """Off by default; on, a Deployment of `pagedserve gateway` pods (replicas: 2) attached to the head's Ray and
    selected by the same Service as the head's gateway."""
    assert not [d for d in objects("kuberay-dp2") if d["kind"] == "Deployment"]
    docs = objects_for(merged("kuberay-dp2", **{"kuberay.gateways.enabled": True}))
    dep = one(docs, "Deployment")
    validate_k8s(dep)
    assert dep["spec"]["replicas"] == 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][1] == "gateway" and flags(c)["ray-address"].endswith("-head-svc:6379")
    assert {e["name"] for e in c["env"]} >= {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
    svc = one(docs, "Service")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    secured = one(objects_for(merged("kuberay-dp2", "secured", **{"kuberay.gateways.enabled": True})), "Deployment")
    c = secured["spec"]["template"]["spec"]["containers"][0]  # the same keys and tenants as the head's gateway
    assert flags(c)["api-key-file"] == "/etc/pagedserve/api-key/api-key"
    assert flags(c)["tenants-file"] == "/etc/pagedserve/tenants/tenants.json"
    assert {"name": "tenants", "mountPath": "/etc/pagedserve/tenants", "readOnly": True} in c["volumeMounts"]


# ---------------------------------------------------------------- elastic replicas (issue 34)

AUTOSCALE = "min=1,max=2,waiting=4"


@pytest.mark.parametrize("names", [("cpu",), ("kuberay-dp2",)])
def test_autoscale_flag(names):
    """server.autoscale becomes `serve --autoscale=...` (single node and KubeRay head), whitespace dropped; unset,
    no flag: the server then only exports its decision."""
    assert "autoscale" not in flags(gateway(objects(*names))[1])
    docs = objects_for(merged(*names, **{"server.autoscale": " min=1, max=2,waiting=4 "}))
    _, c = gateway(docs)
    assert flags(c)["autoscale"] == AUTOSCALE
    assert [a for a in c["args"] if a.startswith("--autoscale")] == [f"--autoscale={AUTOSCALE}"]
    for d in docs:
        if d["kind"] not in CUSTOM_KINDS:
            validate_k8s(d)


def test_autoscale_value_follows_serve():
    """What the schema admits, `serve --autoscale` parses the same way (every key, any subset)."""
    from pagedserve.cluster.runtime.autoscaler import AutoscalePolicy
    for spec in ["max=2", "min=2,max=8,waiting=2.5,kv_usage=0.9,ttft_p90=1.5,interval=2,scale_out_cooldown=0,"
                 "scale_in_cooldown=600", "kv_usage=.75", "min=1, max=3"]:
        _, c = gateway(objects_for(merged("cpu", **{"server.autoscale": spec})))
        AutoscalePolicy.parse(flags(c)["autoscale"])


def test_single_node_autoscale_gets_gpus_for_max_replicas():
    """In one pod the replicas share its GPUs: it holds tensorParallelSize x max of them (serve's default max is 4),
    never fewer than the data-parallel replicas it starts with."""
    def gpus(**overrides):
        return gateway(objects_for(merged("gpu-tp4", **overrides)))[1]["resources"]["limits"][GPU]
    assert gpus() == 4
    assert gpus(**{"server.autoscale": "min=1,max=3"}) == 12
    assert gpus(**{"server.autoscale": "min=1"}) == 16  # max defaults to 4
    assert gpus(**{"server.autoscale": "max=2,max=1", "engine.dataParallelSize": 2}) == 8  # the last max counts


# KubeRay v1.5's AutoscalerOptions (ray.io_rayclusters.yaml).
AUTOSCALER_OPTIONS = {"resources": dict, "image": str, "imagePullPolicy": str, "env": list, "envFrom": list,
                      "volumeMounts": list, "securityContext": dict, "idleTimeoutSeconds": int,
                      "upscalingMode": str, "version": str}


def test_kuberay_workers_are_fixed_without_autoscaling():
    rc = one(objects("kuberay-dp2"), "RayCluster")
    assert "enableInTreeAutoscaling" not in rc["spec"] and "autoscalerOptions" not in rc["spec"]
    for g in rc["spec"]["workerGroupSpecs"]:
        assert g["minReplicas"] == g["replicas"] == g["maxReplicas"]


def test_kuberay_in_tree_autoscaling():
    """The Ray autoscaler sidecar: a pending placement group (a replica --autoscale adds) makes KubeRay add a worker
    pod within minReplicas..maxReplicas. The sidecar is hardened as every container, writes only to emptyDirs, and
    alone gets the ServiceAccount token it needs for the Kubernetes API."""
    docs = objects("kuberay-autoscale")
    rc = one(docs, "RayCluster")
    spec = rc["spec"]
    check_fields(spec, RAYCLUSTER_SPEC, "spec")
    assert spec["enableInTreeAutoscaling"] is True
    opts = spec["autoscalerOptions"]
    check_fields(opts, AUTOSCALER_OPTIONS, "autoscalerOptions")
    assert opts["idleTimeoutSeconds"] == 120 and opts["upscalingMode"] in ("Default", "Aggressive", "Conservative")
    values_sc = yaml.safe_load((CHART / "values.yaml").read_text())["securityContext"]
    assert opts["securityContext"] == values_sc
    (g,) = spec["workerGroupSpecs"]
    check_fields(g, WORKER_GROUP, "workerGroupSpecs[gpu]")
    assert (g["minReplicas"], g["replicas"], g["maxReplicas"]) == (0, 1, 4)
    assert g["template"]["spec"]["containers"][0]["resources"]["limits"][GPU] == 2
    _, head = gateway(docs)
    assert flags(head)["autoscale"] == "min=1,max=4,waiting=4,kv_usage=0.8,ttft_p90=2"
    head_spec = spec["headGroupSpec"]["template"]["spec"]
    assert head_spec["automountServiceAccountToken"] is False  # the token goes to the sidecar only
    volumes = {v["name"]: v for v in head_spec["volumes"]}
    for m in opts["volumeMounts"]:
        assert m["name"] in volumes, m  # the sidecar mounts the head pod's volumes
        assert m["name"] == "autoscaler-token" or "emptyDir" in volumes[m["name"]], m
    token = volumes["autoscaler-token"]["projected"]["sources"]
    assert token[0] == {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}
    assert {"name": "autoscaler-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True} in opts["volumeMounts"]
    assert "autoscaler-token" not in {m["name"] for m in head["volumeMounts"]}
    assert {"name": "HOME", "value": "/home/pagedserve"} in opts["env"]
    # The head and worker templates, the token volume included, are valid PodTemplateSpecs; the sidecar's settings
    # are valid container fields.
    for role, tmpl in pod_templates(docs):
        validate_k8s({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.replace(":", "-")},
                      "template": tmpl})
    sidecar = {"name": "autoscaler", "image": "x", **{k: opts[k] for k in ("securityContext", "env", "volumeMounts")}}
    validate_k8s({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "autoscaler"},
                  "template": {"spec": {"containers": [sidecar], "volumes": head_spec["volumes"]}}})
    for d in docs:
        if d["kind"] not in CUSTOM_KINDS:
            validate_k8s(d)
    assert "KubeRay's autoscaler adds and removes worker pods" in render(merged("kuberay-autoscale"))[
        "pagedserve/templates/NOTES.txt"]


def test_kuberay_worker_range_defaults():
    """With autoscaling and no range given, a group goes from 0 pods up to its replicas."""
    rc = one(objects_for(merged("kuberay-dp2", **{"kuberay.autoscaling.enabled": True})), "RayCluster")
    for g in rc["spec"]["workerGroupSpecs"]:
        assert (g["minReplicas"], g["maxReplicas"]) == (0, g["replicas"])
    assert "resources" not in rc["spec"]["autoscalerOptions"]  # KubeRay's default for the sidecar


# keda.sh/v1alpha1 ScaledObject as KEDA 2.x documents it (keda.sh_scaledobjects.yaml), and its Prometheus scaler.
SCALEDOBJECT_SPEC = {
    "scaleTargetRef": {"apiVersion": str, "kind": str, "name": str, "envSourceContainerName": str},
    "pollingInterval": int, "cooldownPeriod": int, "initialCooldownPeriod": int, "idleReplicaCount": int,
    "minReplicaCount": int, "maxReplicaCount": int,
    "fallback": {"failureThreshold": int, "replicas": int, "behavior": str},
    "advanced": {"restoreToOriginalReplicaCount": bool, "scalingModifiers": dict,
                 "horizontalPodAutoscalerConfig": {"name": str, "behavior": dict}},
    "triggers": list,
}
SCALEDOBJECT_TRIGGER = {"type": str, "name": str, "metadata": STR_MAP, "authenticationRef": {"name": str, "kind": str},
                        "metricType": str, "useCachedMetrics": bool}
PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "activationThreshold", "namespace", "customHeaders",
                       "ignoreNullValues", "unsafeSsl", "queryParameters", "authModes"}
SELECTOR = 'namespace="llm",service="ps-pagedserve"'


def test_keda_is_off_by_default():
    for names in [(), ("cpu",), ("observability",), ("kuberay-autoscale",)]:
        docs = objects(*names)
        assert "ScaledObject" not in {d["kind"] for d in docs}, names
    assert one(objects("cpu"), "Deployment")["spec"]["replicas"] == 1


def test_keda_scaledobject():
    """A ScaledObject on the server Deployment with Prometheus triggers on the signals the servers export: the
    in-server policy's targets as Value metrics (per-pod averages), over this release's series as the
    ServiceMonitor's targets are labelled. The Deployment leaves its replica count to KEDA's HPA."""
    docs = objects("keda")
    so, dep, svc = one(docs, "ScaledObject"), one(docs, "Deployment"), one(docs, "Service")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["metadata"]["labels"]["app.kubernetes.io/instance"] == "ps"
    spec = so["spec"]
    check_fields(spec, SCALEDOBJECT_SPEC, "spec")
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}
    assert "replicas" not in dep["spec"]  # helm upgrade must not undo what the HPA set
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"]) == (1, 8, 15)
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"waiting-per-replica", "kv-usage", "ttft-p90"}
    for t in spec["triggers"]:
        check_fields(t, SCALEDOBJECT_TRIGGER, f"triggers[{t['name']}]")
        assert t["type"] == "prometheus" and t["metricType"] in ("AverageValue", "Value")
        assert_str_map(t["metadata"], "metadata")
        assert set(t["metadata"]) <= PROMETHEUS_METADATA and {"serverAddress", "query", "threshold"} <= set(
            t["metadata"])
        assert t["metadata"]["serverAddress"] == "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"
        assert float(t["metadata"]["threshold"]) > 0
        assert "$SELECTOR" not in t["metadata"]["query"] and SELECTOR in t["metadata"]["query"]
    # The in-server autoscaler's signals and targets (serve --autoscale's defaults), per pod.
    from pagedserve.cluster.runtime.autoscaler import AutoscalePolicy
    policy = AutoscalePolicy()
    for name, signal, target in [("waiting-per-replica", "waiting_per_replica", policy.waiting),
                                 ("kv-usage", "kv_usage", policy.kv_usage),
                                 ("ttft-p90", "ttft_p90_seconds", policy.ttft_p90)]:
        t = triggers[name]
        assert t["metricType"] == "Value" and float(t["metadata"]["threshold"]) == target
        assert t["metadata"]["query"] == f'avg(pagedserve_autoscaler_signal{{signal="{signal}",{SELECTOR}}})'
    # The series are the ServiceMonitor's targets: the Service it selects, in this namespace.
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    assert svc["metadata"]["name"] == "ps-pagedserve"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    # The HPA that KEDA makes: its behavior is valid autoscaling/v2 (strict), as is the HPA as a whole.
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
    validate_k8s({
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "keda-hpa-ps"},
        "spec": {"scaleTargetRef": {k: v for k, v in spec["scaleTargetRef"].items() if k != "envSourceContainerName"},
                 "minReplicas": spec["minReplicaCount"], "maxReplicas": spec["maxReplicaCount"],
                 "behavior": behavior,
                 "metrics": [{"type": "External", "external": {
                     "metric": {"name": f"s{i}-prometheus", "selector": {"matchLabels": {"scaledobject.keda.sh/name":
                                                                                         so["metadata"]["name"]}}},
                     "target": {"type": t["metricType"], **({"value": t["metadata"]["threshold"]}
                                if t["metricType"] == "Value" else {"averageValue": t["metadata"]["threshold"]})}}}
                     for i, t in enumerate(spec["triggers"])]}})
    for d in docs:
        if d["kind"] not in CUSTOM_KINDS:
            validate_k8s(d)
    notes = render(merged("keda"))["pagedserve/templates/NOTES.txt"]
    assert "KEDA scales Deployment/ps-pagedserve between 1 and 8 pods" in notes


def test_keda_custom_trigger():
    """A query of one's own: `$SELECTOR` stands for the release's matchers (or prometheus.selector); the
    authentication and extra scaler metadata apply to every trigger."""
    so = one(objects_for(merged("cpu", **{
        "keda.enabled": True, "keda.behavior": None,  # null drops the default behavior
        "keda.prometheus.selector": 'job="pagedserve"', "keda.prometheus.authenticationRef": "prom-auth",
        "keda.prometheus.extraMetadata": {"unsafeSsl": "true"},
        "keda.triggers": [{"query": "sum(pagedserve_num_requests_running{$SELECTOR}) + "
                                    "sum(pagedserve_num_requests_waiting{$SELECTOR})",
                           "threshold": 48, "metricType": "AverageValue", "activationThreshold": 0}]})),
        "ScaledObject")
    (t,) = so["spec"]["triggers"]
    assert "advanced" not in so["spec"]
    assert t["name"] == "trigger-0" and t["metricType"] == "AverageValue"
    assert t["authenticationRef"] == {"name": "prom-auth"}
    assert t["metadata"] == {
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090", "unsafeSsl": "true", "threshold": "48",
        "activationThreshold": "0",  # numbers become the strings KEDA's metadata holds
        "query": 'sum(pagedserve_num_requests_running{job="pagedserve"}) + '
                 'sum(pagedserve_num_requests_waiting{job="pagedserve"})'}
    check_fields(t, SCALEDOBJECT_TRIGGER, "trigger")


def test_keda_refusals_say_why():
    with pytest.raises(helm.HelmError, match="keda.enabled is for mode singleNode"):
        render(merged("kuberay-dp2", **{"keda.enabled": True}))
    with pytest.raises(helm.HelmError, match="two control loops"):
        render(merged("keda", **{"server.autoscale": "max=2"}))
    with pytest.raises(helm.HelmError, match="may run 3 replicas, but the worker groups hold at most 2"):
        render(merged("kuberay-dp2", **{"server.autoscale": "max=3"}))
