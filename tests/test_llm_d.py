"""deploy/llm-d stays true, offline (no cluster runs here): the core objects validate against the
Kubernetes schemas (kubernetes-validate, strict), the InferencePool against GIE's CRD schema
(vendored in tests/schemas), and the pieces agree with each other and with Shardline: the pool
selects the replica pods at the router's --http-port, the EPP is the pool's picker and reads its
config, the config names only plugins llm-d's scheduler registers and only metrics Shardline
exports, and the KV-event socket, topic and block size are what llm-d's precise prefix-cache
scorer expects. Each Shardline container's command parses as `shardline` parses it."""

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml

from shardline.cli import build_parser
from shardline.flags import service_flags
from shardline.router.api.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch, topic_of
from shardline.router.observers.metrics import Metrics
from tests.support import ROOT

MANIFESTS = sorted((ROOT / "deploy" / "llm-d").glob("*.yaml"))
KUBERNETES = "1.30.0"  # as tests/test_kubernetes.py: the oldest release we promise
CRD_GROUPS = ("gateway.networking.k8s.io/", "inference.networking.k8s.io/")  # not Kubernetes' own schemas
POOL_SCHEMA = ROOT / "tests" / "schemas" / "inferencepool-v1.json"
POD_IP = "10.1.2.3"  # what the downward API would give status.podIP

# The plugin types the EPP image can build, from their registrations: llm-d-inference-scheduler
# v0.8.0 (05c91f0d655fbd7ea71fc50949c899c360d06f07) pkg/epp/framework/plugins/register.go, and the
# gateway-api-inference-extension v1.5.0 (df9f8909fe06fe2dfd4a6fc0bd0c01a0acabf849) in-tree
# plugins its runner registers (cmd/epp/runner/runner.go). The constants' values, as read there.
REGISTERED_PLUGINS = {
    # llm-d-inference-scheduler v0.8.0
    "by-label",
    "by-label-selector",
    "decode-filter",
    "prefill-filter",
    "encode-filter",
    "disagg-headers-handler",
    "prefill-header-handler",
    "data-parallel-profile-handler",
    "disagg-profile-handler",
    "pd-profile-handler",
    "precise-prefix-cache-scorer",
    "load-aware-scorer",
    "session-affinity-scorer",
    "active-request-scorer",
    "no-hit-lru-scorer",
    "models-data-source",
    "model-server-protocol-models",
    "prefix-based-pd-decider",
    "always-disagg-pd-decider",
    "tokenizer",
    "always-disagg-multimodal-decider",
    "context-length-aware",
    # gateway-api-inference-extension v1.5.0
    "prefix-cache-scorer",
    "max-score-picker",
    "random-picker",
    "weighted-random-picker",
    "single-profile-handler",
    "kv-cache-utilization-scorer",
    "queue-scorer",
    "running-requests-size-scorer",
    "lora-affinity-scorer",
    "token-load-scorer",
    "approx-prefix-cache-producer",
    "predicted-latency-scorer",
    "predicted-latency-producer",
    "latency-slo-admitter",
    "prefix-cache-affinity-filter",
    "slo-headroom-tier-filter",
    "latency-scorer",
    "inflight-load-producer",
    "metrics-data-source",
    "core-metrics-extractor",
    "k8s-notification-source",
    "endpoint-notification-source",
    "request-attribute-reporter",
    "openai-parser",
    "vllmgrpc-parser",
    "passthrough-parser",
    "concurrency-detector",
    "utilization-detector",
}
# The fields the EPP reads. Its config file is decoded strictly, but each plugin's `parameters`
# go through Go's json.Unmarshal, which drops a misspelt field without a word: so the test knows
# the parameters of the plugins used here, from their structs (llm-d v0.8.0
# preciseprefixcache.PluginConfig; llm-d-kv-cache v0.7.1 kvblock.TokenProcessorConfig,
# kvcache.Config, kvblock.IndexConfig, tokenization.Config (the UDS build), UdsTokenizerConfig,
# kvevents.Config, PodDiscoveryConfig; GIE v1.5.0 apix/config/v1alpha1 EndpointPickerConfig,
# metrics-data-source's and core-metrics-extractor's parameters). None: any value; [tree]: a list
# of such objects.
ANY = None
CONFIG_FIELDS = {
    "apiVersion": ANY,
    "kind": ANY,
    "featureGates": ANY,
    "plugins": [{"name": ANY, "type": ANY, "parameters": ANY}],
    "schedulingProfiles": [{"name": ANY, "plugins": [{"pluginRef": ANY, "weight": ANY}]}],
    "saturationDetector": ANY,
    "dataLayer": {"sources": [{"pluginRef": ANY, "extractors": [{"pluginRef": ANY}]}]},
    "flowControl": ANY,
    "parser": ANY,
}
PARAMETER_FIELDS = {
    "precise-prefix-cache-scorer": {
        "tokenProcessorConfig": {"blockSize": ANY, "hashSeed": ANY},
        "indexerConfig": {
            "kvBlockIndexConfig": {
                "inMemoryConfig": ANY,
                "redisConfig": ANY,
                "valkeyConfig": ANY,
                "costAwareMemoryConfig": ANY,
                "enableMetrics": ANY,
                "metricsLoggingInterval": ANY,
            },
            "tokenizersPoolConfig": {
                "modelName": ANY,
                "workersCount": ANY,
                "uds": {"socketFile": ANY, "useTCP": ANY, "modelTokenizerMap": ANY},
            },
            "kvCacheBackendConfigs": ANY,
        },
        "kvEventsConfig": {
            "zmqEndpoint": ANY,
            "topicFilter": ANY,
            "concurrency": ANY,
            "engineType": ANY,
            "discoverPods": ANY,
            "podDiscoveryConfig": {"podLabelSelector": ANY, "podNamespace": ANY, "socketPort": ANY},
        },
        "speculativeIndexing": ANY,
        "speculativeTTL": ANY,
    },
    "core-metrics-extractor": {
        "engineLabelKey": ANY,
        "defaultEngine": ANY,
        "engineConfigs": [
            {
                "name": ANY,
                "queuedRequestsSpec": ANY,
                "runningRequestsSpec": ANY,
                "kvUsageSpec": ANY,
                "loraSpec": ANY,
                "cacheInfoSpec": ANY,
                "cacheBlockSizeLabelName": ANY,
                "cacheNumBlocksLabelName": ANY,
                "cacheBlockSizeSpec": ANY,
                "cacheNumBlocksSpec": ANY,
            }
        ],
    },
    "metrics-data-source": {"scheme": ANY, "path": ANY, "insecureSkipVerify": ANY},
}

# The engine core-metrics-extractor maps without being told (GIE v1.5.0,
# pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go): pods labelled `vllm`, or
# not labelled, are read by vLLM's names. (It also reads vLLM's LoRA and cache-config info metrics;
# one that is missing fails only its own field, with an error logged at every scrape.)
BUILTIN_ENGINES = {
    "vllm": {
        "queuedRequestsSpec": "vllm:num_requests_waiting",
        "runningRequestsSpec": "vllm:num_requests_running",
        "kvUsageSpec": "vllm:kv_cache_usage_perc",
    },
}


def _documents() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def _one(kind: str) -> dict:
    (doc,) = [d for d in _documents() if d["kind"] == kind]
    return doc


def _named(kind: str, name: str) -> dict:
    (doc,) = [d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _containers(workload: dict) -> dict[str, dict]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _environment(container: dict) -> dict[str, str]:
    """The container's variables as Kubernetes sets them: status.podIP from the downward API, and
    $(NAME) expanded from the variables declared before it."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, e
            env[e["name"]] = POD_IP
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env


def _parsed(container: dict):
    """The container's command line as `shardline` parses it, with its environment."""
    argv = container["command"]
    assert argv[0] == "shardline", container["name"]
    env = {k: v for k, v in _environment(container).items() if k.startswith("SHARDLINE_")}
    flags = {"SHARDLINE_" + f.upper().replace("-", "_") for f in service_flags(argv[1])}
    assert set(env) <= flags, f"{container['name']}: not flags of `shardline {argv[1]}`: {set(env) - flags}"
    with mock.patch.dict(os.environ, env):
        return build_parser().parse_args(argv[1:] + container.get("args", []))


def _replicas() -> tuple[dict, dict[str, dict], dict]:
    """The replica Deployment, its containers, and its router's parsed flags."""
    workload = _named("Deployment", "shardline-replica")
    containers = _containers(workload)
    (router,) = [c for c in containers.values() if c["command"][:2] == ["shardline", "router"]]
    return workload, containers, _parsed(router)


def _epp_config() -> dict:
    epp = _named("Deployment", "shardline-epp")
    args = _args(_containers(epp)["epp"])
    config_map = _named("ConfigMap", "shardline-epp")
    path = Path(args["config-file"])
    mounts = {m["mountPath"]: m["name"] for m in _containers(epp)["epp"]["volumeMounts"]}
    volumes = {v["name"]: v for v in epp["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts[str(path.parent)]]["configMap"]["name"] == config_map["metadata"]["name"]
    return yaml.safe_load(config_map["data"][path.name])


def _args(container: dict) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in container["args"])


def _plugins(config: dict) -> dict[str, dict]:
    """The config's plugins by name (a plugin's name is its type unless it names itself)."""
    return {p.get("name", p["type"]): p for p in config["plugins"]}


def _shardline_metric_names() -> set[str]:
    """The metric families the router's /metrics carries, read from Shardline's own Metrics: the
    request counters and, at scrape time, the gauges of a replica (here one with no load yet)."""
    metrics = Metrics()
    metrics.watch(SimpleNamespace(failures=0, recoveries=0, load=lambda: None, pool=None, window_pool=None))
    return {family.name for family in metrics.registry.collect()}


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_the_kubernetes_objects_validate_against_the_kubernetes_schemas(path: Path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def _strict(schema):
    """The CRD's schema with unknown fields made errors (the API server would drop them quietly)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    return schema


def test_the_inference_pool_validates_against_its_crd_schema():
    pool = _one("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    schema = _strict(json.loads(POOL_SCHEMA.read_text()))
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: kubernetes-validate's part
    jsonschema.Draft7Validator(schema).validate(pool)
    # The CRD's CEL rules, which a JSON schema cannot say.
    ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(ports) == len(set(ports)), "port number must be unique"
    picker = pool["spec"]["endpointPickerRef"]
    assert picker.get("kind", "Service") != "Service" or "port" in picker


def test_the_pool_selects_the_replica_pods_at_the_routers_http_port():
    workload, containers, router = _replicas()
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    pool = _one("InferencePool")["spec"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    assert workload["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # One target port: the OpenAI API, where the Gateway sends requests and the EPP scrapes /metrics.
    assert [p["number"] for p in pool["targetPorts"]] == [router.http_port]
    assert pool.get("appProtocol", "http") == "http"
    (router_container,) = [c for c in containers.values() if c["command"][1] == "router"]
    assert _ports(router_container)["http"] == router.http_port and router.host == "0.0.0.0"
    assert router_container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # Its shard is the pod's own shard container, on the socket the router dials.
    shards = {n: _parsed(c) for n, c in containers.items() if c["command"][1] == "shard"}
    assert sorted(router.shards.split(",")) == sorted(a.listen for a in shards.values())
    assert {a.model for a in shards.values()} == {router.model}
    assert {a.page_size for a in shards.values()} == {router.page_size}


def test_the_gateway_routes_every_request_to_the_pool():
    route = _one("HTTPRoute")["spec"]
    gateway = _one("Gateway")
    assert [(p.get("kind", "Gateway"), p["name"]) for p in route["parentRefs"]] == [
        ("Gateway", gateway["metadata"]["name"])
    ]
    ((backend,),) = [rule["backendRefs"] for rule in route["rules"]]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        _one("InferencePool")["metadata"]["name"],
    )


def test_the_epp_is_the_pools_picker_and_watches_it():
    pool = _one("InferencePool")
    epp = _named("Deployment", "shardline-epp")
    containers = _containers(epp)
    args = _args(containers["epp"])
    assert args["pool-name"] == pool["metadata"]["name"]
    picker = pool["spec"]["endpointPickerRef"]
    service = _named("Service", picker["name"])
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    (ext_proc,) = [p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"]]
    assert _ports(containers["epp"])[ext_proc["targetPort"]] == int(args["grpc-port"])
    assert containers["epp"]["readinessProbe"]["grpc"]["port"] == int(args["grpc-health-port"])
    # It may read what it watches.
    sa = epp["spec"]["template"]["spec"]["serviceAccountName"]
    binding = _named("RoleBinding", sa)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    rules = _named("Role", binding["roleRef"]["name"])["rules"]
    granted = {
        (g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] if "watch" in rule["verbs"]
    }
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= granted


def test_the_epp_config_names_only_registered_plugins():
    config = _epp_config()
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    plugins = _plugins(config)
    assert {p["type"] for p in plugins.values()} <= REGISTERED_PLUGINS
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    for source in config["dataLayer"]["sources"]:
        refs += [source["pluginRef"]] + [e["pluginRef"] for e in source["extractors"]]
    assert set(refs) <= set(plugins)
    (profile,) = config["schedulingProfiles"]
    kinds = {plugins[p["pluginRef"]]["type"] for p in profile["plugins"]}
    assert {"precise-prefix-cache-scorer", "kv-cache-utilization-scorer", "queue-scorer", "max-score-picker"} <= kinds


def _unknown_fields(value, fields, path: str = "") -> list[str]:
    """The keys of `value` that `fields` (a tree as CONFIG_FIELDS) does not know, as paths."""
    if fields is ANY:
        return []
    if isinstance(fields, list):
        return [u for i, item in enumerate(value) for u in _unknown_fields(item, fields[0], f"{path}[{i}]")]
    unknown = [f"{path}.{k}" for k in value if k not in fields]
    return unknown + [u for k, v in value.items() if k in fields for u in _unknown_fields(v, fields[k], f"{path}.{k}")]


def test_the_epp_config_sets_only_fields_the_epp_reads():
    config = _epp_config()
    assert not _unknown_fields(config, CONFIG_FIELDS)
    for name, plugin in _plugins(config).items():
        if plugin["type"] in PARAMETER_FIELDS:
            unknown = _unknown_fields(plugin.get("parameters", {}), PARAMETER_FIELDS[plugin["type"]], name)
            assert not unknown, f"fields the EPP would ignore: {unknown}"
        else:
            assert "parameters" not in plugin, f"{name}: parameters this test does not know the fields of"


def test_the_epp_reads_metrics_shardline_exports():
    workload = _named("Deployment", "shardline-replica")
    plugins = _plugins(_epp_config())
    (extractor,) = [p for p in plugins.values() if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    label = params.get("engineLabelKey", "inference.networking.k8s.io/engine-type")
    engine = workload["spec"]["template"]["metadata"]["labels"].get(label, params.get("defaultEngine", "vllm"))
    specs = {**BUILTIN_ENGINES, **{e["name"]: e for e in params.get("engineConfigs", [])}}
    assert engine in specs, f"the pods' engine {engine!r} has no metric mapping in the EPP"
    spec = specs[engine]
    names = {
        spec[key].partition("{")[0]  # a spec may select labels: name{label=value}
        for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec")
        if spec.get(key)
    }
    assert names >= {spec["queuedRequestsSpec"], spec["runningRequestsSpec"], spec["kvUsageSpec"]}
    missing = names - _shardline_metric_names()
    assert not missing, f"the EPP is told to read metrics Shardline does not export: {missing}"
    (source,) = [p for p in plugins.values() if p["type"] == "metrics-data-source"]
    assert source.get("parameters", {}).get("scheme", "http") == "http"  # the router's HTTP port is plain HTTP
    assert source.get("parameters", {}).get("path", "/metrics") == "/metrics"


def test_the_kv_events_reach_the_precise_scorer_as_it_expects_them():
    workload, containers, router = _replicas()
    pool = _one("InferencePool")["spec"]
    config = _epp_config()
    (scorer,) = [p for p in _plugins(config).values() if p["type"] == "precise-prefix-cache-scorer"]
    params = scorer["parameters"]
    events = params["kvEventsConfig"]
    # llm-d connects to every pool pod's socket (discoverPods): the router binds it, on all addresses.
    assert events["discoverPods"] is True
    assert router.kv_events_endpoint == f"tcp://*:{events['podDiscoveryConfig']['socketPort']}"
    (router_container,) = [c for c in containers.values() if c["command"][1] == "router"]
    assert _ports(router_container)["kv-events"] == events["podDiscoveryConfig"]["socketPort"]
    # llm-d keys the events by the topic's pod, kv@<pod>@<model>, and scores pods as <ip>:<target
    # port>; it hashes blocks under the topic's model and prompts under the request's, the name a
    # client asks for: the router's first --served-model-name.
    model = router.served_model_name[0]
    # The topic as the router fills its fields in ({pod_ip} from $POD_IP, {port}, {model}).
    with mock.patch.dict(os.environ, {"POD_IP": POD_IP}):
        topic = topic_of(router.kv_events_topic, router.host, router.http_port, model)
    assert topic == f"kv@{POD_IP}:{pool['targetPorts'][0]['number']}@{model}"
    assert topic.startswith(events.get("topicFilter", "kv@"))
    assert "@" not in model
    # Blocks: the EPP cuts the events' tokens and the prompts into blocks of the routers' pages.
    assert params["tokenProcessorConfig"]["blockSize"] == router.page_size
    # The prompts' tokens: the tokenizer of the model the replicas serve, from the sidecar's socket.
    tokenizers = params["indexerConfig"]["tokenizersPoolConfig"]
    assert tokenizers["modelName"] == model
    epp = _named("Deployment", "shardline-epp")
    socket_dir = str(Path(tokenizers["uds"]["socketFile"]).parent)
    shared = [{m["name"] for m in c["volumeMounts"] if m["mountPath"] == socket_dir} for c in _containers(epp).values()]
    assert len(shared) == 2 and shared[0] == shared[1] and len(shared[0]) == 1
    # Only the EPP may read the events (every tenant's cached prompts); anyone may reach the API.
    policy = _one("NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    open_ports = {p["port"] for rule in policy["ingress"] if "from" not in rule for p in rule["ports"]}
    assert open_ports == {"http"}
    ((peer,),) = [rule["from"] for rule in policy["ingress"] if "from" in rule]
    assert peer["podSelector"]["matchLabels"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()


def test_the_pinned_epp_decodes_the_kv_events_the_manifests_routers_send():
    """A batch as the manifest's routers encode it (router/api/kv_events.py, with the manifest's
    --kv-events-encoding), read as llm-d-kv-cache v0.7.1's VLLMAdapter reads one
    (pkg/kvevents/engineadapter/vllm_adapter.go): the batch a positional array [ts, events,
    dp_rank]; each event an array, its tag first; BlockStored's block hashes, parent, token ids and
    block size at 1 to 4, BlockRemoved's hashes at 1. A batch with one event it cannot decode is
    dropped whole: the default encoding (vLLM's since #42892, events as maps) is one."""
    containers = _containers(_named("Deployment", "shardline-replica"))
    (router,) = [c for c in containers.values() if c["command"][1] == "router"]
    encoding = _parsed(router).kv_events_encoding
    events = [
        BlockStored([11, 12], None, list(range(32)), 16, None, "GPU", None),
        BlockRemoved([12], "GPU"),
        AllBlocksCleared(),
    ]

    def read_as_llm_d_0_7(payload: bytes) -> None:
        decoded = msgspec.msgpack.decode(payload)
        assert isinstance(decoded, list) and isinstance(decoded[1], list)
        stored, removed, cleared = decoded[1]
        for event, tag in ((stored, "BlockStored"), (removed, "BlockRemoved"), (cleared, "AllBlocksCleared")):
            assert isinstance(event, list) and event[0] == tag, f"{tag} is sent as {event!r}"
        assert stored[1:5] == [[11, 12], None, list(range(32)), 16]
        assert removed[1] == [12]

    read_as_llm_d_0_7(encode_batch(msgspec.msgpack.Encoder(), events, encoding, 1.0))
    with pytest.raises(AssertionError, match="is sent as"):
        read_as_llm_d_0_7(encode_batch(msgspec.msgpack.Encoder(), events, "map", 1.0))
