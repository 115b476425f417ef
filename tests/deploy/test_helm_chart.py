"""deploy/helm/strata renders manifests a cluster accepts and commands Strata's entry points parse.

No cluster and no helm binary: Helm's own Go library (helm-python-sdk) lints and renders the chart, with the values
schema checked as `helm install` checks it; kubernetes-validate checks every manifest against the newest Kubernetes
schemas it bundles; and every router and worker container command is parsed by the real parsers
(`router.__main__.parse_args`, `worker_common.cli.parse_config`) after the kubelet's `$(VAR)` expansion, so the
chart can never pass a flag the entry points do not have.

    values             default: values.yaml | multinode: values-multinode-gpu.yaml | everything: every option on
      └─ render ──> manifests ──> kubernetes-validate (ServiceMonitor: servicemonitor.schema.json, a CRD)
                        └─ containers ──> env ($(VAR) from ConfigMap, Secrets, downward API) ──> argv ──> parsers
"""
from __future__ import annotations

import base64
import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any, Iterator

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from engine.config import (_DTYPES, KV_CACHE_DTYPES, MAX_SPECULATIVE_TOKENS, QUANT_GROUP_SIZES,
                           QUANTIZATION_SCHEMES, SPECULATIVE_METHODS)
from strata.moe_options import MAX_EXPERT_PARALLEL
from strata.paths import bundled_model
from strata.v1 import common_pb2
from worker_common.config import TRANSFER_BACKENDS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "strata"
MULTINODE = ROOT / "deploy" / "helm" / "values-multinode-gpu.yaml"
SERVICEMONITOR_SCHEMA = json.loads((Path(__file__).parent / "servicemonitor.schema.json").read_text())
K8S_VERSION = kubernetes_validate.utils.latest_version()     # the newest schemas the package bundles
RELEASE, NAMESPACE = "strata", "inference"
POD_IP = "10.1.2.3"
ENTRY_POINTS = {"router": "router", "prefill_worker": "prefill", "decode_worker": "decode"}

# Every optional branch of the templates on at once (the chart's own Secrets, external Redis, all flags).
EVERYTHING: dict[str, Any] = {
    "model": {"id": "tiny", "quantization": "int8", "quantizeVocab": True, "kvCacheDtype": "int8", "dtype": "bfloat16"},
    "clusterSecret": {"value": "not-a-real-secret"},
    "router": {"policy": "least_loaded", "allowAdmin": False, "apiKeys": {"keys": ["team-a:key-a", "team-b:key-b"]},
               "tls": {"existingSecret": "strata-tls"}, "extraArgs": ["--max-inflight=64"],
               "podDisruptionBudget": {"enabled": True}, "service": {"type": "LoadBalancer"}},
    "workers": {"listenOnPodIP": False, "transfer": "nixl", "enforceEager": True, "tierQuotaBytes": 10 << 30,
                "disk": {"persistence": {"enabled": True, "storageClass": "local-nvme"}},
                "extraArgs": ["--max-num-seqs=32"], "env": [{"name": "STRATA_COMPILE_CACHE", "value": "/tmp/c"}]},
    "prefill": {"expertParallel": 2, "gpu": 2, "antiAffinity": "soft", "autoscaling": {"enabled": True}},
    "decode": {"speculative": {"method": "draft", "numTokens": 3}, "antiAffinity": "hard",
               "autoscaling": {"enabled": True, "behavior": {"scaleDown": {"stabilizationWindowSeconds": 60}}}},
    "redis": {"url": "redis://cache.example:6379/1"},
    "s3": {"url": "http://minio.example:9000/strata-kv", "accessKeyId": "id", "secretAccessKey": "key",
           "region": "eu-west-1"},
    "kvEncryption": {"existingSecret": "strata-kv-key"},
    "metrics": {"serviceMonitor": {"enabled": True, "tlsConfig": {"insecureSkipVerify": True}}},
}


def multinode_values() -> dict[str, Any]:
    return helm.values_from_yaml(MULTINODE.read_text())  # Helm's YAML reading, not PyYAML's


VARIANTS = {"default": dict, "multinode": multinode_values, "everything": lambda: EVERYTHING}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the chart renders with `values` (NOTES.txt left out)."""
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


# ------------------------------------------------------------------------------------------------ chart and lint

def test_chart_metadata_names_strata_0_1_0(chart: helm.Chart) -> None:
    meta = chart.metadata
    assert (meta["apiVersion"], meta["name"], meta["version"], meta["appVersion"]) == ("v2", "strata", "0.1.0",
                                                                                         "0.1.0")
    assert chart.schema is not None and chart.schema["$schema"].startswith("http://json-schema.org/draft-07/")


@pytest.mark.parametrize("variant", VARIANTS)
def test_chart_lints_without_warnings(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant](), strict=True, namespace=NAMESPACE, kube_version=f"v{K8S_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error (1 = info)
    assert not problems and not report["errors"], problems or report["errors"]


# ------------------------------------------------------------------------------------------------ manifests

def validate(doc: dict[str, Any]) -> None:
    """Kubernetes' own schemas, strict (no unknown field); the ServiceMonitor CRD against our checked-in schema."""
    if doc["kind"] == "ServiceMonitor":
        jsonschema.validate(doc, SERVICEMONITOR_SCHEMA)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_is_valid_kubernetes(chart: helm.Chart, variant: str) -> None:
    docs = render(chart, VARIANTS[variant]())
    for doc in docs:
        try:
            validate(doc)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.absolute_path)}")
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "Secret", "Deployment", "StatefulSet", "Service", "PodDisruptionBudget"} <= kinds


def test_defaults_render_a_cpu_fleet_with_bundled_redis(chart: helm.Chart) -> None:
    docs = render(chart, {})
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "strata-router"), ("Service", "strata-router"), ("Service", "strata-registry"),
            ("StatefulSet", "strata-prefill"), ("StatefulSet", "strata-decode"),
            ("Deployment", "strata-redis"), ("Service", "strata-redis")} <= names
    assert not find(docs, "ServiceMonitor") and not find(docs, "HorizontalPodAutoscaler")
    for sts in find(docs, "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        assert "nvidia.com/gpu" not in str(pod["containers"][0]["resources"])
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"


def test_multinode_values_spread_gpu_workers_and_scale_decode(chart: helm.Chart) -> None:
    docs = render(chart, multinode_values())
    assert not find(docs, "Deployment", "strata-redis")            # external Redis
    prefill, decode = find(docs, "StatefulSet", "strata-prefill")[0], find(docs, "StatefulSet", "strata-decode")[0]
    assert prefill["spec"]["replicas"] == 2 and "replicas" not in decode["spec"]   # the HPA owns decode's count
    for sts in (prefill, decode):
        pod = sts["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    anti = decode["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["labelSelector"]["matchLabels"] == decode["spec"]["selector"]["matchLabels"]
    [hpa] = find(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "strata-decode"}


def test_hpa_metric_is_a_gauge_the_workers_export(chart: helm.Chart) -> None:
    """The workers' /metrics export each WorkerLoad field as `strata_worker_<field>` (strata.cache_metrics)."""
    exported = {f"strata_worker_{f.name}" for f in common_pb2.WorkerLoad.DESCRIPTOR.fields}
    hpas = find(render(chart, EVERYTHING), "HorizontalPodAutoscaler")
    assert len(hpas) == 2
    for hpa in hpas:
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in exported


def test_servicemonitor_endpoints_name_ports_of_the_selected_services(chart: helm.Chart) -> None:
    docs = render(chart, multinode_values())
    [monitor] = find(docs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]
    components = selector["matchExpressions"][0]["values"]
    services = [s for s in find(docs, "Service")
                if selector["matchLabels"].items() <= s["metadata"]["labels"].items()
                and s["metadata"]["labels"]["app.kubernetes.io/component"] in components]
    service_ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"http", "metrics"} <= service_ports
    assert {s["metadata"]["name"] for s in services} == {"strata-router", "strata-prefill", "strata-decode"}


# ------------------------------------------------------------------------------------------------ values schema

@pytest.mark.parametrize("values, names", [
    ({"decode": {"replicas": -1}}, "/decode/replicas"),
    ({"router": {"policy": "bogus"}}, "/router/policy"),
    ({"bogus": 1}, "'bogus'"),
    ({"workers": {"tranfser": "tcp"}}, "'tranfser'"),
    ({"workers": {"transfer": "shm"}}, "/workers/transfer"),
    ({"workers": {"port": 70000}}, "/workers/port"),
    ({"model": {"quantization": "int3"}}, "/model/quantization"),
    ({"model": {"kvCacheDtype": "fp4"}}, "/model/kvCacheDtype"),
    ({"router": {"replicas": 2}}, "/router/replicas"),
    ({"router": {"extraArgs": ["--max-inflight", "64"]}}, "/router/extraArgs/1"),
    ({"router": {"apiKeys": {"keys": ["no-colon"]}}}, "/router/apiKeys/keys/0"),
    ({"decode": {"speculative": {"numTokens": 99}}}, "/decode/speculative/numTokens"),
    ({"s3": {"url": "ftp://bucket"}}, "/s3/url"),
])
def test_schema_rejects_a_bad_value_naming_the_field(chart: helm.Chart, values: dict, names: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert names in str(caught.value)


@pytest.mark.parametrize("values, names", [
    ({"router": {"registryPort": 50051}}, "router.registryPort"),
    ({"workers": {"metricsPort": 5557}}, "workers.kvEventsPort"),
    ({"decode": {"autoscaling": {"enabled": True, "minReplicas": 9, "maxReplicas": 2}}}, "decode.autoscaling"),
    ({"s3": {"accessKeyId": "id", "secretAccessKey": "key"}}, "s3.url"),
])
def test_templates_reject_conflicting_values_naming_the_fields(chart: helm.Chart, values: dict, names: str) -> None:
    """What one field's schema cannot say: checked by `strata.validate` in _helpers.tpl."""
    with pytest.raises(helm.HelmRenderError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert names in str(caught.value)


def test_schema_enums_match_the_code(chart: helm.Chart) -> None:
    from router.policy import POLICIES

    props = chart.schema["properties"]
    model, decode = props["model"]["properties"], props["decode"]["properties"]
    assert props["router"]["properties"]["policy"]["enum"] == sorted(POLICIES)
    assert model["quantization"]["enum"] == [*QUANTIZATION_SCHEMES, None]
    assert model["quantGroupSize"]["enum"] == list(QUANT_GROUP_SIZES)
    assert model["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)
    assert model["dtype"]["enum"] == list(_DTYPES)
    # shm is left out on purpose: prefill and decode never share a pod, so never a /dev/shm
    assert set(props["workers"]["properties"]["transfer"]["enum"]) == set(TRANSFER_BACKENDS) - {"shm"}
    assert decode["speculative"]["properties"]["method"]["enum"] == [*SPECULATIVE_METHODS, None]
    assert decode["speculative"]["properties"]["numTokens"]["maximum"] == MAX_SPECULATIVE_TOKENS
    assert decode["expertParallel"]["maximum"] == MAX_EXPERT_PARALLEL


# ------------------------------------------------------------------------------------------------ commands

def container_env(container: dict, pod_name: str, docs: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env (which wins). Secrets the chart
    renders give their real values; others (existingSecret) a sample."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])[0]["data"])
    fields = {"status.podIP": POD_IP, "metadata.name": pod_name}
    for var in container.get("env", []):
        ref = var.get("valueFrom", {})
        if "fieldRef" in ref:
            env[var["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in ref:
            env[var["name"]] = secret_value(docs, ref["secretKeyRef"], var["name"])
        else:
            env[var["name"]] = var["value"]
    return env


SAMPLE_SECRETS = {"STRATA_REDIS_URL": "rediss://:password@redis.example:6380/0"}


def secret_value(docs: list[dict], ref: dict[str, str], var: str) -> str:
    rendered = find(docs, "Secret", ref["name"])
    if rendered:
        return base64.b64decode(rendered[0]["data"][ref["key"]]).decode()
    return SAMPLE_SECRETS.get(var, f"sample-{ref['key']}")


def expand(word: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion of command and args: a defined VAR is replaced, `$$` is a literal `$`."""
    def one(m: re.Match) -> str:
        return "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0))
    expanded = re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, word)
    assert "$(" not in expanded, f"{word!r}: a variable the container does not define stays unexpanded"
    return expanded


def mounted_files(container: dict, pod: dict, docs: list[dict], tmp: Path) -> dict[str, Path]:
    """Each mount path -> a folder under `tmp` holding what the volume would: a rendered Secret's files."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    where = {}
    for mount in container.get("volumeMounts", []):
        folder = tmp / mount["name"]
        folder.mkdir(parents=True, exist_ok=True)
        secret = volumes.get(mount["name"], {}).get("secret")
        for doc in find(docs, "Secret", secret["secretName"]) if secret else []:
            for key, data in doc["data"].items():
                (folder / key).write_bytes(base64.b64decode(data))
        where[mount["mountPath"]] = folder
    return where


# What a flag's file holds when the test cannot see the volume (an existingSecret, a PVC of checkpoints).
def fill_sample(flag: str, path: Path) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if flag in ("--model", "--speculative-model"):
        path.symlink_to(bundled_model(), target_is_directory=True)
    elif flag == "--api-keys-file":
        path.write_text("tenant-a:key-a\n")
    elif flag == "--kv-encryption-key-file":
        path.write_text("ab" * 32)


def relocate(argv: list[str], mounts: dict[str, Path]) -> list[str]:
    """Paths on mounted volumes moved into the test's folders (longest mount first), sample files filled in."""
    out = []
    for word in argv:
        flag, eq, value = word.partition("=")
        for mount in sorted(mounts, key=len, reverse=True):
            if eq and (value == mount or value.startswith(mount + "/")):
                path = mounts[mount] / value[len(mount):].lstrip("/")
                fill_sample(flag, path)
                word = f"{flag}={path}"
                break
        out.append(word)
    return out


def parse(entry: str, argv: list[str]) -> Any:
    """The entry point's own parser; its exit-2 message becomes the test failure."""
    from router.__main__ import parse_args
    from worker_common.cli import parse_config

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse_args(argv) if entry == "router" else parse_config(ENTRY_POINTS[entry], argv)
    except SystemExit:
        pytest.fail(f"python -m {entry} {' '.join(argv)}\n{stderr.getvalue()}")


def strata_containers(docs: list[dict]) -> Iterator[tuple[dict, dict, dict]]:
    """(workload, pod spec, container) of every `python -m <entry point>` container."""
    for workload in find(docs, "Deployment") + find(docs, "StatefulSet"):
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            if container.get("command", [])[:2] == ["python", "-m"]:
                yield workload, pod, container


@pytest.mark.parametrize("variant", VARIANTS)
def test_container_commands_parse_with_the_real_entry_points(chart: helm.Chart, variant: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(chart, VARIANTS[variant]())
    seen, namespaces = set(), set()
    for workload, pod, container in strata_containers(docs):
        entry = container["command"][2]
        pod_name = f"{workload['metadata']['name']}-0"
        env = container_env(container, pod_name, docs)
        for name, value in env.items():
            monkeypatch.setenv(name, value)  # what the process reads itself (STRATA_CLUSTER_SECRET)
        mounts = mounted_files(container, pod, docs, tmp_path / entry)
        argv = relocate([expand(a, env) for a in container.get("args", [])], mounts)
        parsed = parse(entry, argv)
        check_wiring(entry, parsed, container, env, docs, pod_name)
        seen.add(entry)
        namespaces.add((parsed.quantization, parsed.quant_group_size, parsed.quantize_vocab, parsed.kv_cache_dtype))
    assert seen == set(ENTRY_POINTS)
    assert len(namespaces) == 1, namespaces       # the router and every worker name the same block namespace


def named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def check_wiring(entry: str, parsed: Any, container: dict, env: dict[str, str], docs: list[dict],
                 pod_name: str) -> None:
    """The parsed command agrees with the ports, probes and Services around it."""
    ports = named_ports(container)
    if entry == "router":
        assert (parsed.grpc_port, parsed.http_port, parsed.registry_port) == (ports["grpc"], ports["http"],
                                                                              ports["registry"])
        assert container["livenessProbe"]["grpc"]["port"] == parsed.registry_port
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert parsed.policy == env["STRATA_CFG_POLICY"] and parsed.host == "0.0.0.0"
        return
    from worker_common.registration import advertised

    assert parsed.role == ENTRY_POINTS[entry] and parsed.worker_id == pod_name
    assert (parsed.port, parsed.metrics_port) == (ports["grpc"], ports["metrics"])
    assert container["readinessProbe"]["grpc"]["port"] == parsed.port
    assert advertised(parsed.kv_events_endpoint, parsed.advertise_host) == f"tcp://{POD_IP}:{ports['kv-events']}"
    assert advertised(parsed.kv_replay_endpoint, parsed.advertise_host) == f"tcp://{POD_IP}:{ports['kv-replay']}"
    registry_host, _, registry_port = parsed.router_address.partition(":")
    [registry] = find(docs, "Service", registry_host)
    assert int(registry_port) in [p["port"] for p in registry["spec"]["ports"]]
    assert registry["spec"].get("publishNotReadyAddresses") is True
    assert parsed.cluster_secret  # from STRATA_CLUSTER_SECRET
