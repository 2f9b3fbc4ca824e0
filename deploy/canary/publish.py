"""Where a verdict goes besides the exit code: CloudWatch metrics that a SageMaker deployment guardrail's
rollback alarms watch (deploy/sagemaker/template.yaml).

Namespace `inf2serve/Canary`, dimensions `EndpointName` and `EndpointConfigName` (the new fleet's
config, so an alarm judges that release only), three metrics per verdict:
- `Verdict`: the exit code (0 promote, 1 roll back, 2 cannot judge; the alarms fire at >= 1, so a canary
  that could not judge also stops the rollout);
- `TTFTRegression`: 1 when a time-to-first-token check failed, else 0;
- `InterTokenRegression`: 1 when a time-per-output-token or inter-token gap check failed, else 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deploy.canary.verdict import Check

NAMESPACE = "inf2serve/Canary"
FAMILIES = {"TTFTRegression": {"TTFT"}, "InterTokenRegression": {"TPOT", "inter-token gap"}}


def metric_data(checks: Sequence[Check], exit_code: int, endpoint: str, config: str) -> list[dict[str, Any]]:
    dimensions = [
        {"Name": "EndpointName", "Value": endpoint},
        {"Name": "EndpointConfigName", "Value": config},
    ]
    values = {"Verdict": float(exit_code)}
    for name, metrics in FAMILIES.items():
        values[name] = float(any(c.passed is False and c.metric in metrics for c in checks))
    return [
        {"MetricName": name, "Dimensions": dimensions, "Value": value, "Unit": "None"}
        for name, value in values.items()
    ]


def publish(checks: Sequence[Check], exit_code: int, target: str, client: Any | None = None) -> None:
    """`target` is `<endpoint>/<endpoint config>`; `client` a CloudWatch client (a test passes a stub)."""
    endpoint, _, config = target.partition("/")
    if client is None:
        import boto3

        client = boto3.client("cloudwatch")
    client.put_metric_data(Namespace=NAMESPACE, MetricData=metric_data(checks, exit_code, endpoint, config))
