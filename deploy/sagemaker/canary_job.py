"""The canary job of a SageMaker blue/green deployment: run during the bake, its verdict rolls it back.

During the bake the new fleet's canary instance cannot be addressed on its own (both fleets serve variant
`AllTraffic`), and it carries a different share of production than the old fleet's instances. So the job
judges the two releases side by side under equal load, on their own hardware:
1. reads the deployment in progress: the live EndpointConfig (old) and `PendingDeploymentSummary`'s
   (new), and each config's model artifact;
2. starts two one-instance evaluation endpoints, `<endpoint>-eval-old` and `<endpoint>-eval-new`, from
   copies of the two configs (same instance type, image, artifact and environment), idle but for the
   canary's own requests, and waits for both to be in service;
3. runs `inf2serve canary` with every prompt sent to both at once (paired, equal load), and publishes the
   verdict for the new config (`--publish-cloudwatch <endpoint>/<new config>`): the template's
   CanaryVerdictAlarm, TTFTAlarm and InterTokenAlarm watch those metrics, so a ROLL BACK (or a canary that
   cannot judge) turns them to ALARM during the bake and SageMaker rolls the deployment back;
4. deletes the evaluation endpoints and configs, whatever happened.
The exit code is the canary's (0 promote, 1 roll back, 2 cannot judge). The evaluation endpoints need
quota for two more instances of the type (deploy/README.md, "Quotas").

    python -m deploy.sagemaker.canary_job --endpoint inf2serve [--dry-run] [-- <inf2serve canary flags>]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.errors import ConfigError

EVALUATION_SUFFIXES = ("eval-old", "eval-new")


@dataclass(frozen=True, slots=True)
class Deployment:
    endpoint: str
    old_config: str
    new_config: str

    def evaluation(self, suffix: str) -> str:
        return f"{self.endpoint}-{suffix}"


def deployment_in_progress(sagemaker: Any, endpoint: str) -> Deployment:
    described = sagemaker.describe_endpoint(EndpointName=endpoint)
    pending = described.get("PendingDeploymentSummary", {}).get("EndpointConfigName")
    if not pending:
        raise ConfigError(f"endpoint {endpoint} has no deployment in progress: nothing to judge")
    return Deployment(endpoint, described["EndpointConfigName"], pending)


def first_variant(sagemaker: Any, config: str) -> dict[str, Any]:
    """The config's first production variant (the one the template defines)."""
    (variant, *_) = sagemaker.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"]
    return dict(variant)


def one_instance_copy(variant: dict[str, Any], name: str) -> dict[str, Any]:
    """CreateEndpointConfig arguments: the production variant on one instance."""
    keep = (
        "VariantName",
        "ModelName",
        "InstanceType",
        "ContainerStartupHealthCheckTimeoutInSeconds",
        "ModelDataDownloadTimeoutInSeconds",
        "VolumeSizeInGB",
        "InferenceAmiVersion",
    )
    copied = {key: variant[key] for key in keep if key in variant}
    return {"EndpointConfigName": name, "ProductionVariants": [{**copied, "InitialInstanceCount": 1}]}


def artifact_of(sagemaker: Any, variant: dict[str, Any]) -> str:
    """The S3 prefix the variant's model mounts (its golden record is there)."""
    container = sagemaker.describe_model(ModelName=variant["ModelName"])["PrimaryContainer"]
    return str(container["ModelDataSource"]["S3DataSource"]["S3Uri"])


def canary_argv(
    deployment: Deployment, old_artifact: str, new_artifact: str, extra: Sequence[str]
) -> list[str]:
    old, new = (f"sagemaker:{deployment.evaluation(s)}" for s in EVALUATION_SUFFIXES)
    return [
        "canary",
        "--baseline",
        old,
        "--candidate",
        new,
        "--baseline-artifact",
        old_artifact,
        "--candidate-artifact",
        new_artifact,
        "--publish-cloudwatch",
        f"{deployment.endpoint}/{deployment.new_config}",
        *extra,
    ]


def run(sagemaker: Any, deployment: Deployment, extra: Sequence[str]) -> int:
    from app.cli import main as inf2serve

    names = [deployment.evaluation(s) for s in EVALUATION_SUFFIXES]
    variants = [first_variant(sagemaker, c) for c in (deployment.old_config, deployment.new_config)]
    try:
        for name, variant in zip(names, variants, strict=True):
            sagemaker.create_endpoint_config(**one_instance_copy(variant, name))
            sagemaker.create_endpoint(EndpointName=name, EndpointConfigName=name)
        waiter = sagemaker.get_waiter("endpoint_in_service")
        for name in names:
            waiter.wait(EndpointName=name, WaiterConfig={"Delay": 30, "MaxAttempts": 120})
        artifacts = [artifact_of(sagemaker, variant) for variant in variants]
        return inf2serve(canary_argv(deployment, *artifacts, extra))
    finally:
        for name in names:
            _cleanup(sagemaker.delete_endpoint, EndpointName=name)
            _cleanup(sagemaker.delete_endpoint_config, EndpointConfigName=name)


def _cleanup(delete: Any, **name: str) -> None:
    """Delete one evaluation resource; one that is missing (never created) does not stop the rest."""
    from botocore.exceptions import ClientError

    try:
        delete(**name)
    except ClientError as error:
        print(f"canary job: could not delete {name}: {error}", file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(
        prog="python -m deploy.sagemaker.canary_job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    out.add_argument("--endpoint", required=True, help="the endpoint whose blue/green bake to judge")
    out.add_argument("--region", help="AWS Region (default: the environment's)")
    out.add_argument("--dry-run", action="store_true", help="print what would be done, call nothing")
    out.add_argument("extra", nargs="*", help="after --: more `inf2serve canary` flags")
    return out


def main(argv: Sequence[str] | None = None, sagemaker: Any | None = None) -> int:
    args = parser().parse_args(argv)
    if args.dry_run:
        planned = Deployment(args.endpoint, "<live config>", "<pending config>")
        for suffix, config in zip(EVALUATION_SUFFIXES, ("<live config>", "<pending config>"), strict=True):
            print(f"create endpoint {planned.evaluation(suffix)} from {config} on 1 instance")
        print(
            "inf2serve " + " ".join(canary_argv(planned, "<live artifact>", "<pending artifact>", args.extra))
        )
        print(f"delete {' and '.join(planned.evaluation(s) for s in EVALUATION_SUFFIXES)}")
        return 0
    if sagemaker is None:
        import boto3

        sagemaker = boto3.client("sagemaker", region_name=args.region)
    try:
        deployment = deployment_in_progress(sagemaker, args.endpoint)
    except ConfigError as error:
        print(f"canary job: {error.message}", file=sys.stderr)
        return 2
    return run(sagemaker, deployment, args.extra)


if __name__ == "__main__":
    sys.exit(main())
