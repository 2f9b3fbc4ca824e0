"""Scale-out files: the SageMaker inference-component template (cfn-lint clean; one copy per replica on
its Neuron devices, copies and instances scaled), and the EKS Gateway API Inference Extension files: the
InferencePool against its vendored CRD schema (strict), the endpoint picker's metric mapping against the
metrics the server exports, and the HPA on the queue metric against the Kubernetes schema."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cfnlint.decode import decode
from prometheus_client.parser import text_string_to_metric_families

from app import metrics
from app.settings import ServerSettings
from tests.deploy.test_kubernetes import KUBERNETES_VERSION, _render, _strict

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPONENTS = DEPLOY / "sagemaker" / "inference-components.yaml"
KUBECTL = Path(sys.executable).parent / "kubectl"
CFN_LINT = Path(sys.executable).parent / "cfn-lint"
# The core-metrics-extractor's engine config fields (engineConfigParams, gateway-api-inference-extension
# 1748e829 pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go).
ENGINE_FIELDS = {
    "name",
    "queuedRequestsSpec",
    "runningRequestsSpec",
    "kvUsageSpec",
    "loraSpec",
    "cacheInfoSpec",
    "cacheBlockSizeLabelName",
    "cacheNumBlocksLabelName",
    "cacheBlockSizeSpec",
    "cacheNumBlocksSpec",
}


def test_inference_component_template_passes_cfn_lint() -> None:
    result = subprocess.run([str(CFN_LINT), str(COMPONENTS)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_inference_components_are_replicas_scaled_by_copies_and_instances(
    server_env_names: frozenset[str],
) -> None:
    template, problems = decode(str(COMPONENTS))
    assert not problems
    resources = template["Resources"]
    component = resources["InferenceComponent"]["Properties"]
    requirements = component["Specification"]["ComputeResourceRequirements"]
    assert requirements["NumberOfAcceleratorDevicesRequired"] == {"Ref": "AcceleratorDevicesPerCopy"}
    environment = resources["Model"]["Properties"]["PrimaryContainer"]["Environment"]
    assert set(environment) <= server_env_names
    assert environment["INF2SERVE_REPLICAS"] == "1"  # SageMaker places and balances the copies
    (variant,) = resources["EndpointConfig"]["Properties"]["ProductionVariants"]
    assert variant["ManagedInstanceScaling"]["Status"] == "ENABLED"
    assert component["VariantName"] == variant["VariantName"]
    target = resources["CopyScalingTarget"]["Properties"]
    assert target["ScalableDimension"] == "sagemaker:inference-component:DesiredCopyCount"
    assert (
        target["ResourceId"]["Fn::Sub"]
        == "inference-component/" + component["InferenceComponentName"]["Fn::Sub"]
    )
    policy = resources["CopyScalingPolicy"]["Properties"]
    assert policy["ScalingTargetId"] == {"Ref": "CopyScalingTarget"}


# Inferentia2 chips and host memory per size (aws-neuron-sdk about-neuron/arch/neuron-hardware/inf2-arch.rst;
# shared/research/deploy.md, section 1.7).
INF2 = {"xlarge": (1, 16), "8xlarge": (1, 128), "24xlarge": (6, 384), "48xlarge": (12, 768)}


def _components() -> dict:
    template, problems = decode(str(COMPONENTS))
    assert not problems
    return template


def _rule_allows(template: dict, size: str, devices: str) -> bool:
    """The template's Rules, evaluated for one choice (they only use Or, Equals and Contains)."""

    def value(node: object) -> object:
        if isinstance(node, dict) and "Ref" in node:
            return {"InstanceSize": size, "AcceleratorDevicesPerCopy": devices}[node["Ref"]]
        if isinstance(node, dict) and "Fn::Equals" in node:
            return value(node["Fn::Equals"][0]) == value(node["Fn::Equals"][1])
        if isinstance(node, dict) and "Fn::Or" in node:
            return any(value(n) for n in node["Fn::Or"])
        if isinstance(node, dict) and "Fn::Contains" in node:
            return value(node["Fn::Contains"][1]) in node["Fn::Contains"][0]
        return node

    return all(
        value(assertion["Assert"])
        for rule in template["Rules"].values()
        if value(rule["RuleCondition"])
        for assertion in rule["Assertions"]
    )


def test_every_allowed_placement_fits_its_instance() -> None:
    # Audit D4: 4 devices and 64 GiB per copy could be chosen with ml.inf2.xlarge (1 chip, 16 GiB). Now a
    # copy's devices are at most the instance's chips (Rules) and its memory comes from a mapping whose
    # whole copies fit the host memory.
    template = _components()
    params = template["Parameters"]
    memory = template["Mappings"]["CopyMemoryMb"]
    assert set(params["InstanceSize"]["AllowedValues"]) == set(INF2)
    for size, (chips, gib) in INF2.items():
        for devices in map(str, params["AcceleratorDevicesPerCopy"]["AllowedValues"]):
            allowed = _rule_allows(template, size, devices)
            assert allowed == (devices in memory[size]), (size, devices)
            if allowed:
                assert int(devices) <= chips and chips % int(devices) == 0
                assert chips // int(devices) * memory[size][devices] <= gib * 1024
    default = (params["InstanceSize"]["Default"], str(params["AcceleratorDevicesPerCopy"]["Default"]))
    assert _rule_allows(template, *default) and default[1] in memory[default[0]]


def test_components_read_a_kms_artifact_on_their_prefix_only() -> None:
    # Audit D4 and H1: template.yaml's statements (prefix-conditioned ListBucket, kms:Decrypt via S3).
    from tests.deploy.test_cloudformation import (
        _actions,
        _assert_kms_when_given,
        _granting,
        _plain,
        _statements,
    )

    statements = _statements(_components()["Resources"]["ExecutionRole"])
    assert _granting(statements, "s3:ListBucket")["Condition"] == {
        "StringLike": {"s3:prefix": {"Fn::Sub": "${ArtifactPrefix}*"}}
    }
    _assert_kms_when_given(statements)
    unscoped = {a for s in _plain(statements) if s["Resource"] == "*" for a in _actions(s)}
    assert unscoped == {"ecr:GetAuthorizationToken"}  # the one action IAM cannot scope


def test_components_carry_the_timeout_budget_a_pin_and_a_rollback() -> None:
    # Audit W9: no deadline (non-streamed requests over 60 s ended as ModelError), no pin, no
    # AutoRollbackConfiguration, and 7200 s for a rolling update that may need 6 x (1800 + 300) s.
    from deploy import timeouts

    resources = _components()["Resources"]
    env = resources["Model"]["Properties"]["PrimaryContainer"]["Environment"]
    budget = timeouts.sagemaker()
    assert float(env["INF2SERVE_REQUEST_TIMEOUT_S"]) == budget.request_timeout_s
    assert float(env["INF2SERVE_STREAM_TIMEOUT_S"]) == budget.stream_timeout_s  # audit W1
    assert float(env["INF2SERVE_DRAIN_S"]) == budget.drain_s
    assert float(env["INF2SERVE_SHUTDOWN_TIMEOUT_S"]) == budget.shutdown_timeout_s
    assert float(env["INF2SERVE_KEEP_ALIVE_S"]) == budget.keep_alive_s
    assert env["INF2SERVE_ARTIFACT"] == {
        "Fn::If": ["Pinned", {"Fn::Sub": "/opt/ml/model@${ArtifactDigest}"}, "/opt/ml/model"]
    }
    deployment = resources["InferenceComponent"]["Properties"]["DeploymentConfig"]
    assert deployment["AutoRollbackConfiguration"]["Alarms"] == [{"AlarmName": {"Ref": "ErrorRateAlarm"}}]
    rolling = deployment["RollingUpdatePolicy"]
    params = _components()["Parameters"]
    worst = params["MaxCopies"]["Default"] * (budget.startup_s + rolling["WaitIntervalInSeconds"])
    assert worst <= rolling["MaximumExecutionTimeoutInSeconds"] <= 28800  # the API's maximum


GATEWAY_OVERLAY = "overlays/production-gateway"


@pytest.fixture(scope="module")
def gateway_docs() -> list[dict]:
    return _render(GATEWAY_OVERLAY)


@pytest.fixture(scope="module")
def inference_docs(gateway_docs: list[dict]) -> dict[str, dict]:
    """The component's kinds, rendered inside the overlay that includes it (one of each)."""
    kinds = ("InferencePool", "ConfigMap", "HorizontalPodAutoscaler", "Gateway", "HTTPRoute")
    return {doc["kind"]: doc for doc in gateway_docs if doc["kind"] in kinds}


def test_the_gateway_overlay_validates(gateway_docs: list[dict]) -> None:
    # Audit D2: core kinds against the Kubernetes schemas, Gateway/HTTPRoute/InferencePool/Rollout/... against
    # their vendored CRDs (deploy/eks/crds/SOURCES.md), strict.
    from tests.deploy.test_kubernetes import _validate

    for doc in gateway_docs:
        _validate(doc)
    assert {d["kind"] for d in gateway_docs} >= {"Gateway", "HTTPRoute", "InferencePool", "Deployment"}


def test_the_gateway_routes_to_the_pool_and_its_picker(gateway_docs: list[dict]) -> None:
    # Audit D2 (a): a Gateway and an HTTPRoute whose backendRef is the InferencePool (GIE guides: the route
    # names group inference.networking.k8s.io, kind InferencePool); (c) the picker is llm-d's, configured
    # with llm-d.ai/v1alpha1 (llm-d-inference-scheduler pkg/epp/config/loader/configloader.go).
    def one(kind: str) -> dict:
        (doc,) = [d for d in gateway_docs if d["kind"] == kind]
        return doc

    gateway, route, pool = one("Gateway"), one("HTTPRoute"), one("InferencePool")
    assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"]}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    from deploy import timeouts

    assert rule["timeouts"]["request"] == f"{timeouts.eks().idle_timeout_s}s"
    picker = pool["spec"]["endpointPickerRef"]
    (service,) = [
        d for d in gateway_docs if d["kind"] == "Service" and d["metadata"]["name"] == picker["name"]
    ]
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    (deployment,) = [d for d in gateway_docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("ghcr.io/llm-d/llm-d-inference-scheduler:")
    assert container["args"][container["args"].index("--pool-name") + 1] == pool["metadata"]["name"]
    config = yaml.safe_load(one("ConfigMap")["data"]["inf2serve-plugins.yaml"])
    assert config["apiVersion"] == "llm-d.ai/v1alpha1"
    # The Gateway implementation is an overlay value with a documented default (Istio passes GIE's
    # conformance suite: conformance/reports/v1.5.0/gateway/istio).
    assert gateway["spec"]["gatewayClassName"] == "istio"
    assert "`gatewayClassName`" in (DEPLOY / "README.md").read_text()


def test_the_pool_is_in_the_overlays_namespace_and_skips_canary_pods(gateway_docs: list[dict]) -> None:
    # Audit D2 (d): the namespace was fixed; W11: the pool selected canary pods too, bypassing the steps,
    # and every apply re-set the replicas the HPA manages.
    namespaces = {d["metadata"].get("namespace") for d in gateway_docs if d["kind"] != "Namespace"}
    (namespace,) = [d["metadata"]["name"] for d in gateway_docs if d["kind"] == "Namespace"]
    assert namespaces == {namespace}
    (rollout,) = [d for d in gateway_docs if d["kind"] == "Rollout"]
    (pool,) = [d for d in gateway_docs if d["kind"] == "InferencePool"]
    stable = rollout["spec"]["strategy"]["canary"]["stableMetadata"]["labels"]
    assert stable.items() <= pool["spec"]["selector"]["matchLabels"].items()
    assert "replicas" not in rollout["spec"]


def pool_validator() -> jsonschema.Validator:
    crd = json.loads((DEPLOY / "eks" / "crds" / "inferencepool.json").read_text())
    schema = _strict(crd["openAPIV3Schema"])
    schema["properties"]["apiVersion"]["enum"] = [f"{crd['group']}/{crd['version']}"]
    schema["properties"]["kind"]["enum"] = [crd["kind"]]
    return jsonschema.Draft7Validator(schema)


def test_inference_pool_validates_and_selects_the_server_pods(
    inference_docs: dict[str, dict], gateway_docs: list[dict]
) -> None:
    pool = inference_docs["InferencePool"]
    pool_validator().validate(pool)
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPort"] = [{"number": 8080}]
    with pytest.raises(jsonschema.ValidationError, match="targetPort"):
        pool_validator().validate(broken)
    (rollout,) = [d for d in gateway_docs if d["kind"] == "Rollout"]
    # A stable pod's labels: its template's and the stableMetadata Argo adds.
    pod_labels = rollout["spec"]["template"]["metadata"]["labels"]
    pod_labels |= rollout["spec"]["strategy"]["canary"]["stableMetadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": ServerSettings.model_fields["port"].default}]


def exported_gauges() -> dict[str, list[dict[str, str]]]:
    """Gauge name -> the label sets of its series, as /metrics renders them."""
    families = text_string_to_metric_families(metrics.render().decode())
    return {f.name: [s.labels for s in f.samples] for f in families if f.type == "gauge"}


def test_endpoint_picker_maps_the_protocol_metrics_to_ones_we_export(inference_docs: dict[str, dict]) -> None:
    config = yaml.safe_load(inference_docs["ConfigMap"]["data"]["inf2serve-plugins.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p for p in config["plugins"]}
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    assert set(engine) <= ENGINE_FIELDS
    gauges = exported_gauges()
    for spec in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        # The picker reads one series per pod: a gauge without labels (all replicas summed).
        assert gauges[engine[spec]] == [{}], engine[spec]
    refs = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    assert refs <= set(plugins)
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"


def test_hpa_scales_the_rollout_on_the_queue_metric(inference_docs: dict[str, dict]) -> None:
    hpa = inference_docs["HorizontalPodAutoscaler"]
    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)
    (rollout,) = [d for d in _render("base") if d["kind"] == "Rollout"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Rollout", rollout["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert exported_gauges()[metric["pods"]["metric"]["name"]] == [{}]
