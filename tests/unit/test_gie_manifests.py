"""deploy/gie/ (loramux behind the Gateway API Inference Extension) stays applicable: every custom resource
validates against the CRD schema vendored from its release (tests/data/gie-crds/), an unknown or misspelled
field included, every other document is a well-formed Kubernetes object, and the resources name each other
consistently (route -> pool -> endpoint picker -> pool, objectives -> pool, pool -> loramux pods)."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "gie"
CRDS = ROOT / "tests" / "data" / "gie-crds"
GIE_RELEASE = "v1.5.0"  # gateway-api-inference-extension: the CRDs, the EPP image and the chart followed
GATEWAY_API_RELEASE = "v1.5.1"  # gateway-api: the HTTPRoute CRD (what GIE v1.5.0's conformance module uses)
NAMESPACE = "loramux"
TIERS = ("free", "standard", "premium")  # loramux's default tenant tiers, least important first
POOL_GROUP = "inference.networking.k8s.io"
EPP_PORTS = {"grpc": 9002, "grpc-health": 9003, "metrics": 9090}
SCORERS = {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "lora-affinity-scorer"}
# apiVersion of each kind that no vendored CRD defines; only these, and the CRDs' kinds, may appear.
CORE_KINDS = {
    "Namespace": "v1", "Service": "v1", "ServiceAccount": "v1", "ConfigMap": "v1", "Deployment": "apps/v1",
    "Role": "rbac.authorization.k8s.io/v1", "RoleBinding": "rbac.authorization.k8s.io/v1",
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
}
UNNAMESPACED = {"Namespace", "Kustomization"}
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")


# --- the vendored CRDs as JSON schemas ---

@functools.cache
def crds() -> dict[str, dict]:
    """Vendored CRD file name -> the CRD."""
    return {path.name: yaml.safe_load(path.read_text()) for path in sorted(CRDS.glob("*.yaml"))}


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the openAPIV3Schema of each served version of each vendored CRD."""
    schemas = {}
    for crd in crds().values():
        spec = crd["spec"]
        for version in spec["versions"]:
            if version["served"]:
                schemas[f"{spec['group']}/{version['name']}", spec["names"]["kind"]] = \
                    version["schema"]["openAPIV3Schema"]
    return schemas


def json_schema(openapi: dict) -> dict:
    """A CRD's OpenAPI v3 schema as a JSON schema: the same keywords less the `x-kubernetes-*` extensions (CEL
    rules, list and map types, int-or-string, preserve-unknown-fields), which JSON Schema does not know; the
    walk follows the schema keywords, so a property that happened to start with `x-kubernetes-` would stay."""
    out = {key: value for key, value in openapi.items() if not key.startswith("x-kubernetes-")}
    if "properties" in out:
        out["properties"] = {name: json_schema(sub) for name, sub in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = json_schema(out[key])
    for key in SCHEMA_LISTS:
        if key in out:
            out[key] = [json_schema(sub) for sub in out[key]]
    return out


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Paths of the keys in `value` that `schema` does not declare: what the API server prunes (or, with
    kubectl's strict field validation, refuses) from a custom resource. An object whose schema lists
    `properties` admits only those keys unless it also has `additionalProperties` (then the others are
    checked against that schema, or admitted when it is `true`) or `x-kubernetes-preserve-unknown-fields`;
    an object without `properties` (such as `metadata`, which the API server checks itself) is not walked."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [p for i, item in enumerate(value) for p in unknown_fields(item, schema["items"], f"{path}[{i}]")]
    if not isinstance(value, dict):
        return []
    properties, extra = schema.get("properties"), schema.get("additionalProperties")
    found = []
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if properties is not None and key in properties:
            found += unknown_fields(item, properties[key], where)
        elif isinstance(extra, dict):
            found += unknown_fields(item, extra, where)
        elif properties is not None and extra is not True:
            found.append(where)
    return found


def schema_errors(doc: dict) -> list[str]:
    """What the CRD of `doc`'s apiVersion and kind finds wrong with it: JSON Schema errors (types, required
    fields, enums, patterns, bounds) and unknown fields, each as 'path: message'."""
    openapi = crd_schemas()[doc["apiVersion"], doc["kind"]]
    validator = Draft202012Validator(json_schema(openapi))
    errors = [f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
              for error in validator.iter_errors(doc)]
    return errors + [f"{path}: unknown field" for path in unknown_fields(doc, openapi)]


# --- the manifests ---

@functools.cache
def documents() -> list[tuple[str, dict]]:
    """(file name, document) for every YAML document in deploy/gie/, in file order."""
    return [(path.name, doc) for path in sorted(DEPLOY.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def docs_of(kind: str) -> list[dict]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def one(kind: str, name: str | None = None) -> dict:
    (doc,) = [d for d in docs_of(kind) if name is None or d["metadata"]["name"] == name]
    return doc


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def pool() -> dict:
    return one("InferencePool")


def epp() -> dict:
    """The endpoint picker's Deployment: the one whose container runs GIE's epp image."""
    (doc,) = [d for d in docs_of("Deployment") if "gateway-api-inference-extension/epp:" in container(d)["image"]]
    return doc


def loramux() -> dict:
    (doc,) = [d for d in docs_of("Deployment") if d is not epp()]
    return doc


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


CUSTOM = [(name, doc) for name, doc in documents() if doc["kind"] not in CORE_KINDS]


# --- schemas ---

def test_the_vendored_crds_are_those_of_the_named_releases():
    bundle = {name: crd["metadata"]["annotations"] for name, crd in crds().items()}
    assert {name: a.get("inference.networking.k8s.io/bundle-version") or a["gateway.networking.k8s.io/bundle-version"]
            for name, a in bundle.items()} == {
        "inference.networking.k8s.io_inferencepools.yaml": GIE_RELEASE,
        "inference.networking.x-k8s.io_inferenceobjectives.yaml": GIE_RELEASE,
        "gateway.networking.k8s.io_httproutes.yaml": GATEWAY_API_RELEASE,
    }
    readme = (CRDS / "README.md").read_text()
    assert GIE_RELEASE in readme and GATEWAY_API_RELEASE in readme and "Apache" in readme
    assert set(crd_schemas()) == {(f"{POOL_GROUP}/v1", "InferencePool"),
                                  ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"),
                                  ("gateway.networking.k8s.io/v1", "HTTPRoute")}
    for schema in crd_schemas().values():
        Draft202012Validator.check_schema(json_schema(schema))


def test_deploy_holds_each_kind_the_setup_needs():
    kinds = [doc["kind"] for _, doc in documents()]
    assert {kind: kinds.count(kind) for kind in ("InferencePool", "HTTPRoute", "InferenceObjective", "Deployment",
                                                 "Service", "ServiceAccount", "ConfigMap", "Role", "RoleBinding")} \
        == {"InferencePool": 1, "HTTPRoute": 1, "InferenceObjective": len(TIERS), "Deployment": 2, "Service": 2,
            "ServiceAccount": 1, "ConfigMap": 1, "Role": 2, "RoleBinding": 2}


@pytest.mark.parametrize("name,doc", CUSTOM, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in CUSTOM])
def test_custom_resource_matches_its_crd(name, doc):
    assert schema_errors(doc) == []


@pytest.mark.parametrize("name,doc", documents(), ids=[f"{n}:{d.get('kind')}" for n, d in documents()])
def test_every_document_is_a_known_kind_with_a_name_in_the_namespace(name, doc):
    kind = doc.get("kind")
    assert (doc.get("apiVersion"), kind) in crd_schemas() or CORE_KINDS.get(kind) == doc.get("apiVersion"), name
    if kind == "Kustomization":
        return
    metadata = doc["metadata"]
    assert isinstance(metadata["name"], str) and metadata["name"]
    assert metadata.get("namespace") == (None if kind in UNNAMESPACED else NAMESPACE)
    if kind == "Namespace":
        assert metadata["name"] == NAMESPACE


def test_kustomization_lists_every_file_once():
    (kustomization,) = docs_of("Kustomization")
    files = {path.name for path in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


# --- the validator itself ---

def with_change(doc: dict, path: list, value=None, rename: str | None = None) -> dict:
    """A deep copy of `doc` with the field at `path` set to `value`, or renamed to `rename`."""
    copy = yaml.safe_load(yaml.safe_dump(doc))
    parent = copy
    for step in path[:-1]:
        parent = parent[step]
    if rename is None:
        parent[path[-1]] = value
    else:
        parent[rename] = parent.pop(path[-1])
    return copy


def test_a_misspelled_optional_field_fails_though_json_schema_alone_admits_it():
    bad = with_change(pool(), ["spec", "endpointPickerRef", "failureMode"], rename="failureMod")
    schema = crd_schemas()[bad["apiVersion"], bad["kind"]]
    assert list(Draft202012Validator(json_schema(schema)).iter_errors(bad)) == []
    assert schema_errors(bad) == ["spec.endpointPickerRef.failureMod: unknown field"]
    objective = with_change(one("InferenceObjective", "premium"), ["spec", "priority"], rename="priorty")
    assert schema_errors(objective) == ["spec.priorty: unknown field"]


def test_a_misspelled_field_inside_a_list_fails():
    route = one("HTTPRoute")
    bad = with_change(route, ["spec", "rules", 0, "backendRefs", 0, "kind"], rename="knid")
    assert schema_errors(bad) == ["spec.rules[0].backendRefs[0].knid: unknown field"]


def test_a_wrong_type_fails():
    bad = with_change(pool(), ["spec", "targetPorts", 0, "number"], "8000")
    assert schema_errors(bad) == ["spec.targetPorts.0.number: '8000' is not of type 'integer'"]
    objective = with_change(one("InferenceObjective", "free"), ["spec", "priority"], "low")
    assert schema_errors(objective) == ["spec.priority: 'low' is not of type 'integer'"]


def test_a_missing_required_field_and_a_value_outside_an_enum_fail():
    bad = with_change(pool(), ["spec", "appProtocol"], "grpc")
    del bad["spec"]["selector"]
    errors = schema_errors(bad)
    assert len(errors) == 2 and any("'selector' is a required property" in e for e in errors)
    assert any(e.startswith("spec.appProtocol: 'grpc' is not one of") for e in errors)


def test_unknown_fields_follows_additional_properties_and_preserve_unknown_fields():
    schema = {"type": "object", "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
        "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        "opaque": {"type": "object"},
        "typed": {"type": "object", "additionalProperties": {"type": "object", "properties": {"b": {}}}},
    }}
    good = {"labels": {"any": "x"}, "free": {"z": 1}, "open": {"z": 1}, "opaque": {"z": 1}, "typed": {"k": {"b": 1}}}
    assert unknown_fields(good, schema) == []
    assert unknown_fields({"typed": {"k": {"c": 1}}, "nope": 1}, schema) == ["typed.k.c", "nope"]


# --- cross-references ---

def test_the_route_sends_the_tenant_api_from_the_named_gateway_to_the_pool():
    """Exactly the app's tenant routes under /v1: a new one must be routed, and vLLM's adapter endpoints (admin
    keys) must not be reachable through the public gateway."""
    from loramux.server.app import create_app
    from loramux.server.http.ingress import ADMIN_PATHS_OUTSIDE_ADMIN

    route = one("HTTPRoute")
    (parent,) = route["spec"]["parentRefs"]
    assert parent["kind"] == "Gateway" and parent["name"]
    (rule,) = route["spec"]["rules"]
    routed = {m["path"]["value"] for m in rule["matches"]}
    assert {m["path"]["type"] for m in rule["matches"]} == {"Exact"}
    app_paths = {path for path in create_app(lambda: None).openapi()["paths"] if path.startswith("/v1/")}
    assert routed == app_paths - ADMIN_PATHS_OUTSIDE_ADMIN
    assert not routed & ADMIN_PATHS_OUTSIDE_ADMIN
    assert rule["backendRefs"] == [{"group": POOL_GROUP, "kind": "InferencePool", "name": pool()["metadata"]["name"]}]


def test_one_objective_per_tier_on_the_pool_ordered_by_tier_and_never_sheddable():
    objectives = {doc["metadata"]["name"]: doc["spec"] for doc in docs_of("InferenceObjective")}
    assert sorted(objectives) == sorted(TIERS)
    for spec in objectives.values():
        assert spec["poolRef"] == {"group": POOL_GROUP, "name": pool()["metadata"]["name"]}
    priorities = [objectives[tier]["priority"] for tier in TIERS]
    assert priorities == sorted(set(priorities)) and priorities[0] >= 0, priorities  # negative: shed when saturated


def test_the_pool_selects_the_loramux_pods_on_their_port_and_not_the_picker():
    selector = pool()["spec"]["selector"]["matchLabels"]
    assert selects(selector, loramux()["spec"]["template"]["metadata"]["labels"])
    assert not selects(selector, epp()["spec"]["template"]["metadata"]["labels"])
    ports = [p["containerPort"] for p in container(loramux())["ports"]]
    assert [p["number"] for p in pool()["spec"]["targetPorts"]] == ports == [8000]


def test_the_pool_names_the_picker_service_and_its_grpc_port():
    ref = pool()["spec"]["endpointPickerRef"]
    service = one("Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port.get("targetPort", port["port"]) == EPP_PORTS["grpc"]
    assert selects(service["spec"]["selector"], epp()["spec"]["template"]["metadata"]["labels"])


def test_the_picker_runs_the_release_image_for_the_pool():
    epp_container = container(epp())
    assert epp_container["image"] == f"registry.k8s.io/gateway-api-inference-extension/epp:{GIE_RELEASE}"
    args = epp_container["args"]
    assert arg(args, "--pool-name") == pool()["metadata"]["name"]
    assert arg(args, "--pool-namespace") == pool()["metadata"]["namespace"]
    assert arg(args, "--pool-group") == POOL_GROUP
    assert {p["name"]: p["containerPort"] for p in epp_container["ports"]} == EPP_PORTS
    for probe in ("livenessProbe", "readinessProbe"):
        assert epp_container[probe]["grpc"]["port"] == EPP_PORTS["grpc-health"]


def test_the_picker_config_file_is_the_mounted_config_map_and_scores_lora_queue_and_kv_cache():
    pod = epp()["spec"]["template"]["spec"]
    config_file = Path(arg(container(epp())["args"], "--config-file"))
    (mount,) = [m for m in container(epp())["volumeMounts"] if Path(m["mountPath"]) == config_file.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config = yaml.safe_load(one("ConfigMap", volume["configMap"]["name"])["data"][config_file.name])
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {plugin.get("name", plugin["type"]): plugin["type"] for plugin in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    refs = [ref["pluginRef"] for ref in profile["plugins"]]
    assert set(refs) <= set(plugins) and {plugins[ref] for ref in refs} == SCORERS


def test_the_picker_may_read_its_pool_objectives_and_pods():
    account = epp()["spec"]["template"]["spec"]["serviceAccountName"]
    assert one("ServiceAccount", account)
    granted = set()
    for binding in docs_of("RoleBinding"):
        if {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in binding["subjects"]:
            role = one("Role", binding["roleRef"]["name"])
            granted |= {(group, resource) for rule in role["rules"] if {"get", "list", "watch"} <= set(rule["verbs"])
                        for group in rule["apiGroups"] for resource in rule["resources"]}
    assert {(POOL_GROUP, "inferencepools"), ("inference.networking.x-k8s.io", "inferenceobjectives"),
            ("", "pods")} <= granted


def test_every_deployment_and_service_selects_its_own_pods():
    for deployment in docs_of("Deployment"):
        assert selects(deployment["spec"]["selector"]["matchLabels"],
                       deployment["spec"]["template"]["metadata"]["labels"])
    assert selects(one("Service", "loramux")["spec"]["selector"], loramux()["spec"]["template"]["metadata"]["labels"])


def test_loramux_serves_on_8000_with_probes_scrape_annotations_and_secrets():
    pod = loramux()["spec"]["template"]
    main = container(loramux())
    assert main["command"][:2] == ["loramux", "serve"] and arg(main["command"], "--port") == "8000"
    assert main["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert main["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                                              "prometheus.io/path": "/metrics"}
    env = {e["name"]: e for e in main["env"]}
    for secret in ("LORAMUX_ADMIN_KEY", "LORAMUX_DATABASE_URL"):
        assert env[secret]["valueFrom"]["secretKeyRef"]["name"] == "loramux-secrets"
    assert env["LORAMUX_STORE_URL"]["value"].startswith("s3://")
    # The GIE v1.5.0 picker scrapes /metrics without credentials: a metrics key would lock it out.
    assert "LORAMUX_METRICS_KEY" not in env
