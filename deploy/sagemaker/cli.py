"""`inf2serve deploy sagemaker`: release an artifact to a SageMaker endpoint through the guardrails.
Exit 0 when started (or, with --wait, deployed), 1 when rolled back or failed, 2 on bad arguments."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import boto3
from botocore.exceptions import WaiterError

from app.artifacts.loader import pinned_reference, resolve
from app.errors import Inf2ServeError
from deploy.sagemaker.endpoint import Release, outcome, start

# The boto3 waiter's own pace would give up after 60 minutes; a blue/green bake can take longer.
WAIT_DELAY_S = 30


def register(subparsers: argparse._SubParsersAction) -> None:
    deploy = subparsers.add_parser("deploy", help="release an artifact to a deployment target")
    targets = deploy.add_subparsers(dest="target", required=True, metavar="TARGET")
    parser = targets.add_parser("sagemaker", help="blue/green canary update of a SageMaker endpoint")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--image", required=True, help="the inf2serve image URI in ECR")
    parser.add_argument(
        "--artifact",
        required=True,
        help="s3://bucket/prefix/ of the compiled artifact, or an alias; optionally pinned "
        "(...@sha256:<hex>). It is deployed pinned to the manifest it resolves to.",
    )
    parser.add_argument("--role", required=True, help="SageMaker execution role ARN")
    parser.add_argument(
        "--alarm", action="append", default=[], help="CloudWatch alarm that rolls back (repeat)"
    )
    defaults = Release("", "", "", "", ())
    for flag, field in (
        ("--instance-type", "instance_type"),
        ("--instance-count", "instance_count"),
        ("--canary-instances", "canary_instances"),
        ("--bake-seconds", "bake_s"),
        ("--max-execution-seconds", "max_execution_s"),
        ("--startup-timeout", "startup_timeout_s"),
        ("--download-timeout", "download_timeout_s"),
        ("--drain-seconds", "drain_s"),
    ):
        default = getattr(defaults, field)
        parser.add_argument(flag, dest=field, type=type(default), default=default, help=f"default: {default}")
    parser.add_argument("--region", help="AWS Region (default: the boto3 default)")
    parser.add_argument("--wait", action="store_true", help="wait until the endpoint settles, report outcome")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        config_name, release, client = _start(args)
    except Inf2ServeError as error:
        print(f"inf2serve deploy sagemaker: {error.message}", file=sys.stderr)
        return 2
    print(f"{release.endpoint}: deploying endpoint config {config_name} with {release.artifact}")
    if not args.wait:
        return 0
    result = settle(client, release, config_name)
    print(f"{release.endpoint}: {result}")
    return 0 if result == "deployed" else 1


def settle(client: Any, release: Release, config_name: str) -> str:
    """Wait until the endpoint is in service or gives up, then report the outcome."""
    attempts = release.max_execution_s // WAIT_DELAY_S + 1
    waiter = client.get_waiter("endpoint_in_service")
    # The waiter raises on Failed and when it gives up: either way the endpoint's status says what happened.
    with contextlib.suppress(WaiterError):
        waiter.wait(
            EndpointName=release.endpoint, WaiterConfig={"Delay": WAIT_DELAY_S, "MaxAttempts": attempts}
        )
    return outcome(client, release.endpoint, config_name)


def _start(args: argparse.Namespace) -> tuple[str, Release, Any]:
    """Resolve an alias to its artifact (SageMaker mounts a plain prefix), check it is published (and is
    the pinned one, if pinned), pin it, start."""
    store = resolve(args.artifact)  # refuses an alias or prefix that holds no published artifact
    release = Release(
        endpoint=args.endpoint,
        image=args.image,
        artifact=pinned_reference(store),
        role_arn=args.role,
        alarms=tuple(args.alarm),
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        canary_instances=args.canary_instances,
        bake_s=args.bake_s,
        max_execution_s=args.max_execution_s,
        startup_timeout_s=args.startup_timeout_s,
        download_timeout_s=args.download_timeout_s,
        drain_s=args.drain_s,
    )
    client = boto3.client("sagemaker", region_name=args.region)
    return start(client, release), release, client
