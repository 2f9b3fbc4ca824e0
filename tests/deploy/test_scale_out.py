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
INFERENCE = DEPLOY / "eks" / "inference"
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


@pytest.fixture(scope="module")
def inference_docs() -> dict[str, dict]:
    out = subprocess.run(
        [str(KUBECTL), "kustomize", str(INFERENCE)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out) if doc}


def pool_validator() -> jsonschema.Validator:
    crd = json.loads((DEPLOY / "eks" / "crds" / "inferencepool.json").read_text())
    schema = _strict(crd["openAPIV3Schema"])
    schema["properties"]["apiVersion"]["enum"] = [f"{crd['group']}/{crd['version']}"]
    schema["properties"]["kind"]["enum"] = [crd["kind"]]
    return jsonschema.Draft7Validator(schema)


def test_inference_pool_validates_and_selects_the_server_pods(inference_docs: dict[str, dict]) -> None:
    pool = inference_docs["InferencePool"]
    pool_validator().validate(pool)
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPort"] = [{"number": 8080}]
    with pytest.raises(jsonschema.ValidationError, match="targetPort"):
        pool_validator().validate(broken)
    (rollout,) = [d for d in _render("base") if d["kind"] == "Rollout"]
    pod_labels = rollout["spec"]["template"]["metadata"]["labels"]
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
