"""Every PromQL query we ship (Grafana dashboard, Argo Rollouts analysis) parses (promtool) and names only
metrics and labels the server actually exports (from `app.metrics`)."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from app import metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"
ANALYSIS = DEPLOY / "eks" / "base" / "analysistemplate.yaml"
# Labels Prometheus or the scrape config attach, not the server.
TARGET_LABELS = {"le", "instance", "job", "namespace", "pod", "rollouts_pod_template_hash"}
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
    "info": ("_info",),
}
SELECTOR = re.compile(r"\b(" + re.escape(metrics.PREFIX) + r"\w+)\s*(?:\{([^}]*)\})?")


def _exported() -> dict[str, set[str]]:
    """Sample name -> label names, for every metric `app.metrics` registers."""
    out: dict[str, set[str]] = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            for suffix in SUFFIXES[metric._type]:
                out[metric._name + suffix] = set(metric._labelnames)
    registered = {family.name for family in metrics.REGISTRY.collect()}
    assert {name.removesuffix("_info") for name in out if name.endswith("_info")} <= registered
    return out


def _dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    return [
        e.replace("$__rate_interval", "5m").replace("$instance", ".*").replace("$track", ".*") for e in exprs
    ]


def _analysis_queries() -> list[str]:
    queries = []
    for template in yaml.safe_load_all(ANALYSIS.read_text()):
        args = {a["name"]: a.get("value", "0123abcd") for a in template["spec"]["args"]}
        for metric in template["spec"]["metrics"]:
            if "prometheus" in metric["provider"]:
                query = metric["provider"]["prometheus"]["query"]
                queries.append(re.sub(r"\{\{args\.([\w-]+)\}\}", lambda m, a=args: a[m.group(1)], query))
    return queries


QUERIES = {"dashboard": _dashboard_queries(), "analysis": _analysis_queries()}


def test_dashboard_covers_every_concern() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Latency", "Throughput and errors", "Batching and padding", "Device", "Startup"]
    used = {m for q in QUERIES["dashboard"] for m, _ in SELECTOR.findall(q)}
    concerns = ["time_to_first_token", "inter_token_latency", "e2e_request_latency"]
    concerns += ["num_batched_tokens_padding", "neuroncore_utilization", "startup_phase"]
    for concern in concerns:
        assert any(concern in name for name in used), concern
    assert all(p.get("targets") for p in dashboard["panels"] if p["type"] != "row")
    # Template variables (label_values(...), not PromQL) too: every name anywhere in the file is exported.
    assert {name for name, _ in SELECTOR.findall(DASHBOARD.read_text())} <= set(_exported())


def test_dashboard_tells_stable_from_canary_and_each_title_is_what_it_plots() -> None:
    # Audit H3: a "(p99)" panel plotted p50 too, and nothing selected Argo's stable or canary pods
    # (the ServiceMonitor keeps rollouts-pod-template-hash as rollouts_pod_template_hash).
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "rollouts_pod_template_hash" in variables["track"]["definition"]
    assert variables["track"]["allValue"] == ".*"  # EC2 and SageMaker series have no such label
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert 'rollouts_pod_template_hash=~"$track"' in target["expr"], panel["title"]
            if panel["title"].endswith("(p99)"):
                assert target["expr"].startswith("histogram_quantile(0.99,"), panel["title"]
    assert "CloudWatch" in dashboard["description"]  # nothing scrapes EC2 instances or SageMaker


@pytest.mark.parametrize("source", QUERIES)
def test_queries_name_exported_metrics_and_labels(source: str) -> None:
    exported = _exported()
    for query in QUERIES[source]:
        selectors = SELECTOR.findall(query)
        assert selectors, f"no {metrics.PREFIX} metric in {query!r}"
        for name, matchers in selectors:
            assert name in exported, f"{name} is not exported by the server ({query!r})"
            labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
            assert labels <= exported[name] | TARGET_LABELS, f"{name} has no label {labels - exported[name]}"


def test_queries_parse(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus, `make system-deps`) is needed to parse PromQL"
    rules = [
        {"record": f"check:query_{i}", "expr": q} for i, q in enumerate(itertools.chain(*QUERIES.values()))
    ]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "inf2serve", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout
