"""What acts on the canary's verdict outside Kubernetes: the SageMaker canary job (evaluation endpoints from
the two configs of a blue/green deployment in progress, the verdict published for the new config, cleanup)
and the ALB release (weight steps that advance only on a pass, the listener cut at once on anything else),
against botocore stubs; both scripts' --help and dry runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber

from app.cli import build_parser
from deploy.alb import release
from deploy.sagemaker import canary_job

REPO = Path(__file__).resolve().parents[2]


def _client(service: str) -> Any:
    return boto3.client(service, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")


@pytest.mark.parametrize("module", ["deploy.sagemaker.canary_job", "deploy.alb.release"])
def test_scripts_explain_themselves(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0 and "--dry-run" in result.stdout


def test_sagemaker_job_judges_the_pending_config_on_evaluation_endpoints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sagemaker = _client("sagemaker")
    variant = {
        "VariantName": "AllTraffic",
        "ModelName": "m-new",
        "InstanceType": "ml.inf2.xlarge",
        "InitialInstanceCount": 4,
        "InferenceAmiVersion": "al2-ami-sagemaker-inference-neuron-2",
    }
    with Stubber(sagemaker) as stub:
        stub.add_response(
            "describe_endpoint",
            {
                "EndpointName": "llm",
                "EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/llm",
                "EndpointConfigName": "cfg-old",
                "EndpointStatus": "Updating",
                "CreationTime": "2026-11-25T00:00:00Z",
                "LastModifiedTime": "2026-11-25T00:00:00Z",
                "PendingDeploymentSummary": {"EndpointConfigName": "cfg-new"},
            },
            {"EndpointName": "llm"},
        )
        stub.add_response(
            "describe_endpoint_config",
            {
                "EndpointConfigName": "cfg-new",
                "EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:endpoint-config/cfg-new",
                "ProductionVariants": [variant],
                "CreationTime": "2026-11-25T00:00:00Z",
            },
            {"EndpointConfigName": "cfg-new"},
        )
        deployment = canary_job.deployment_in_progress(sagemaker, "llm")
        copy = canary_job.one_instance_copy(
            canary_job.first_variant(sagemaker, deployment.new_config), "llm-eval-new"
        )
    assert deployment == canary_job.Deployment("llm", "cfg-old", "cfg-new")
    # Same hardware, image and artifact as the new fleet, on one instance.
    assert copy == {
        "EndpointConfigName": "llm-eval-new",
        "ProductionVariants": [{**variant, "InitialInstanceCount": 1}],
    }
    argv = canary_job.canary_argv(deployment, "s3://b/old/", "s3://b/new/", ["--samples", "64"])
    args = build_parser(argv).parse_args(argv)
    assert (args.baseline, args.candidate) == ("sagemaker:llm-eval-old", "sagemaker:llm-eval-new")
    assert args.publish_cloudwatch == "llm/cfg-new"  # the alarms' EndpointConfigName: the new fleet
    assert args.samples == 64


def test_sagemaker_job_without_a_deployment_cannot_judge(capsys: pytest.CaptureFixture[str]) -> None:
    sagemaker = _client("sagemaker")
    with Stubber(sagemaker) as stub:
        stub.add_response(
            "describe_endpoint",
            {
                "EndpointName": "llm",
                "EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/llm",
                "EndpointConfigName": "cfg-old",
                "EndpointStatus": "InService",
                "CreationTime": "2026-11-25T00:00:00Z",
                "LastModifiedTime": "2026-11-25T00:00:00Z",
            },
        )
        assert canary_job.main(["--endpoint", "llm"], sagemaker=sagemaker) == 2
    assert "no deployment in progress" in capsys.readouterr().err


STACK = {
    "StackName": "inf2serve",
    "CreationTime": "2026-11-25T00:00:00Z",
    "StackStatus": "UPDATE_COMPLETE",
    "Parameters": [
        {"ParameterKey": k, "ParameterValue": v}
        for k, v in {
            "ArtifactBucket": "b",
            "StableArtifactPrefix": "llm/old/",
            "StableArtifactDigest": "",
            "CanaryArtifactPrefix": "llm/new/",
            "CanaryArtifactDigest": "sha256:" + "a" * 64,
            "StableCapacity": "4",
            "CanaryCapacity": "1",
            "StableWeight": "100",
            "CanaryWeight": "0",
        }.items()
    ],
    "Outputs": [
        {"OutputKey": k, "OutputValue": v}
        for k, v in {
            "LoadBalancerDns": "internal-x.elb.amazonaws.com",
            "StableTargetGroupArn": "arn:tg/stable",
            "CanaryTargetGroupArn": "arn:tg/canary",
            "ListenerArn": "arn:listener",
        }.items()
    ],
}


def _expect_weight(stub: Stubber, weight: int) -> None:
    parameters = [
        {"ParameterKey": p["ParameterKey"], "ParameterValue": str(weight)}
        if p["ParameterKey"] == "CanaryWeight"
        else {"ParameterKey": p["ParameterKey"], "UsePreviousValue": True}
        for p in STACK["Parameters"]
    ]
    stub.add_response(
        "update_stack",
        {"StackId": "id"},
        {
            "StackName": "inf2serve",
            "UsePreviousTemplate": True,
            "Parameters": parameters,
            "Capabilities": ANY,
        },
    )
    stub.add_response("describe_stacks", {"Stacks": [STACK]}, {"StackName": "inf2serve"})  # the waiter


def test_alb_release_advances_only_on_a_pass_and_cuts_the_canary_at_once() -> None:
    cloudformation, elbv2 = _client("cloudformation"), _client("elbv2")
    with Stubber(cloudformation) as stub:
        stub.add_response("describe_stacks", {"Stacks": [STACK]}, {"StackName": "inf2serve"})
        stack = release.describe(cloudformation, "inf2serve")
    # Equal load: 4 stable instances at weight 100 and 1 canary instance: 25 each.
    assert release.weights(stack, ["equal", "50"]) == [25, 50]
    argv = release.canary_argv(stack, [])
    args = build_parser(argv).parse_args(argv)
    assert args.baseline == "alb:http://internal-x.elb.amazonaws.com#stable"
    assert args.candidate_artifact == "s3://b/llm/new/@sha256:" + "a" * 64

    verdicts = iter([0, 1])  # the first step passes, the second rolls back
    with Stubber(cloudformation) as cfn, Stubber(elbv2) as lb:
        _expect_weight(cfn, 25)
        _expect_weight(cfn, 50)
        cut = {
            "Type": "forward",
            "ForwardConfig": {
                "TargetGroups": [
                    {"TargetGroupArn": "arn:tg/stable", "Weight": 1},
                    {"TargetGroupArn": "arn:tg/canary", "Weight": 0},
                ]
            },
        }
        lb.add_response("modify_listener", {}, {"ListenerArn": "arn:listener", "DefaultActions": [cut]})
        _expect_weight(cfn, 0)  # then the stack agrees with the listener
        code = release.release(stack, [25, 50], lambda: next(verdicts), cloudformation, elbv2, soak_s=0)
        cfn.assert_no_pending_responses()
        lb.assert_no_pending_responses()
    assert code == 1
