"""`inf2serve deploy sagemaker`: the SageMaker calls it makes, checked with botocore's Stubber, which
validates every request against the real SageMaker API model (names, types, required keys, minimums).
moto cannot stand in for SageMaker here: its mock rejects ml.inf2 endpoint configs and does not implement
UpdateEndpoint. The artifact side (alias resolution, the published check) runs against the loopback moto
S3 server. Not checked offline: enum and maximum values (Stubber skips them; cfn-lint checks the
template's), and what SageMaker itself does during a bake."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber
from cfnlint.decode import decode

from app.artifacts.storage import open_store
from app.cli import main
from app.errors import ConfigError
from compile.publish import promote
from deploy.sagemaker.cli import settle
from deploy.sagemaker.endpoint import (
    Release,
    deployment_config,
    endpoint_config_request,
    model_request,
    outcome,
    start,
)
from loadtest.harness.s3 import upload_tree

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "sagemaker" / "template.yaml"
NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
RELEASE = Release(
    endpoint="llm",
    image="123456789012.dkr.ecr.us-east-1.amazonaws.com/inf2serve:0.1.0",
    artifact="s3://artifacts/stories260K/3f2a9c1b",
    role_arn="arn:aws:iam::123456789012:role/inf2serve",
    alarms=("llm-5xx", "llm-latency"),
)
NAME = RELEASE.name(NOW)
CLI = ["deploy", "sagemaker", "--endpoint", "llm", "--image", RELEASE.image, "--role", RELEASE.role_arn]


@pytest.fixture
def client():
    client = boto3.client(
        "sagemaker", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def _expect_model_and_config(stubber: Stubber) -> None:
    model = {
        "ModelName": NAME,
        "ExecutionRoleArn": RELEASE.role_arn,
        "EnableNetworkIsolation": True,
        "PrimaryContainer": {
            "Image": RELEASE.image,
            "ModelDataSource": {
                "S3DataSource": {
                    "S3Uri": "s3://artifacts/stories260K/3f2a9c1b/",
                    "S3DataType": "S3Prefix",
                    "CompressionType": "None",
                }
            },
            "Environment": {
                "INF2SERVE_ARTIFACT": "/opt/ml/model",
                "INF2SERVE_DEVICE": "neuron",
                "INF2SERVE_REPLICAS": "auto",
                "INF2SERVE_REQUEST_TIMEOUT_S": "55",
                "INF2SERVE_STREAM_TIMEOUT_S": "300",
                "INF2SERVE_KEEP_ALIVE_S": "65",
                "INF2SERVE_DRAIN_S": "10",
                "INF2SERVE_SHUTDOWN_TIMEOUT_S": "10",
            },
        },
    }
    stubber.add_response("create_model", {"ModelArn": f"arn:aws:sagemaker:us-east-1:1:model/{NAME}"}, model)
    variant = {
        "VariantName": "AllTraffic",
        "ModelName": NAME,
        "InstanceType": "ml.inf2.xlarge",
        "InitialInstanceCount": 2,
        "InitialVariantWeight": 1.0,
        "ContainerStartupHealthCheckTimeoutInSeconds": 1800,
        "ModelDataDownloadTimeoutInSeconds": 1800,
        "VolumeSizeInGB": 128,
        "InferenceAmiVersion": "al2-ami-sagemaker-inference-neuron-2",
    }
    arn = f"arn:aws:sagemaker:us-east-1:1:endpoint-config/{NAME}"
    stubber.add_response(
        "create_endpoint_config",
        {"EndpointConfigArn": arn},
        {"EndpointConfigName": NAME, "ProductionVariants": [variant]},
    )


def _described(config: str, status: str = "InService") -> dict:
    return {
        "EndpointName": "llm",
        "EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/llm",
        "EndpointConfigName": config,
        "EndpointStatus": status,
        "CreationTime": NOW,
        "LastModifiedTime": NOW,
    }


def test_first_release_creates_the_endpoint(client) -> None:
    sagemaker, stubber = client
    stubber.add_client_error("describe_endpoint", "ValidationException", "Could not find endpoint", 400)
    _expect_model_and_config(stubber)
    stubber.add_response(
        "create_endpoint",
        {"EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/llm"},
        {"EndpointName": "llm", "EndpointConfigName": NAME},
    )
    assert start(sagemaker, RELEASE, NOW) == NAME


def test_update_goes_through_the_canary_and_alarms(client) -> None:
    sagemaker, stubber = client
    stubber.add_response("describe_endpoint", _described("llm-old"), {"EndpointName": "llm"})
    _expect_model_and_config(stubber)
    deployment = {
        "BlueGreenUpdatePolicy": {
            "TrafficRoutingConfiguration": {
                "Type": "CANARY",
                "CanarySize": {"Type": "INSTANCE_COUNT", "Value": 1},
                "WaitIntervalInSeconds": 3600,
            },
            "TerminationWaitInSeconds": 300,
            "MaximumExecutionTimeoutInSeconds": 14400,
        },
        "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": "llm-5xx"}, {"AlarmName": "llm-latency"}]},
    }
    stubber.add_response(
        "update_endpoint",
        {"EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/llm"},
        {
            "EndpointName": "llm",
            "EndpointConfigName": NAME,
            "DeploymentConfig": deployment,
            "RetainDeploymentConfig": False,
        },
    )
    assert start(sagemaker, RELEASE, NOW) == NAME


def test_update_without_alarms_is_refused_before_anything_is_created(client) -> None:
    sagemaker, stubber = client
    release = replace(RELEASE, alarms=())
    stubber.add_response("describe_endpoint", _described("llm-old"), {"EndpointName": "llm"})
    with pytest.raises(ConfigError, match="alarm"):
        start(sagemaker, release, NOW)


@pytest.mark.parametrize("status", ["Updating", "Creating", "RollingBack", "SystemUpdating"])
def test_an_endpoint_in_flux_is_refused_before_anything_is_created(client, status: str) -> None:
    # Audit H10: UpdateEndpoint refuses an endpoint that is not InService (API reference UpdateEndpoint,
    # "Cannot update in-progress endpoint"); the Model and EndpointConfig made before it were orphans.
    sagemaker, stubber = client
    stubber.add_response("describe_endpoint", _described("llm-old", status), {"EndpointName": "llm"})
    with pytest.raises(ConfigError, match=f"is {status}"):
        start(sagemaker, RELEASE, NOW)  # the Stubber fails on any create_* call


def test_a_refused_update_deletes_what_it_created(client) -> None:
    # Audit H10: the endpoint changed state between the check and the update (a race the check cannot
    # close): the new model and endpoint config are deleted again and the error is raised.
    sagemaker, stubber = client
    stubber.add_response("describe_endpoint", _described("llm-old"), {"EndpointName": "llm"})
    _expect_model_and_config(stubber)
    stubber.add_client_error(
        "update_endpoint", "ValidationException", "Cannot update in-progress endpoint", 400
    )
    stubber.add_response("delete_endpoint_config", {}, {"EndpointConfigName": NAME})
    stubber.add_response("delete_model", {}, {"ModelName": NAME})
    with pytest.raises(ClientError, match="in-progress"):
        start(sagemaker, RELEASE, NOW)
    stubber.assert_no_pending_responses()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"artifact": "/local/artifact"}, "must be on S3"),
        ({"instance_type": "ml.g5.xlarge"}, "ml.inf2"),
        ({"instance_count": 1}, "at most half"),
        ({"drain_s": 20}, "SIGKILL"),
        ({"bake_s": 14200}, "exceed the bake"),
    ],
)
def test_release_is_checked_before_any_call(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        start(object(), replace(RELEASE, **change), NOW)


def test_name_fits_sagemaker_limits_and_tracks_the_content() -> None:
    assert len(replace(RELEASE, endpoint="e" * 63).name(NOW)) <= 63
    assert RELEASE.name(NOW) != replace(RELEASE, image="other").name(NOW)


@pytest.mark.parametrize(
    ("described", "expected"),
    [
        (_described(NAME), "deployed"),
        (_described("llm-old"), "rolled back"),
        ({**_described(NAME, "Failed"), "FailureReason": "ping timed out"}, "failed: Failed: ping timed out"),
    ],
)
def test_outcome_tells_rollback_from_success(client, described: dict, expected: str) -> None:
    sagemaker, stubber = client
    stubber.add_response("describe_endpoint", described, {"EndpointName": "llm"})
    assert outcome(sagemaker, "llm", NAME) == expected


def test_wait_reports_a_failed_deployment_instead_of_raising(client) -> None:
    sagemaker, stubber = client
    failed = {**_described(NAME, "Failed"), "FailureReason": "ping timed out"}
    stubber.add_response("describe_endpoint", failed, {"EndpointName": "llm"})  # the waiter gives up
    stubber.add_response("describe_endpoint", failed, {"EndpointName": "llm"})  # the outcome
    assert settle(sagemaker, RELEASE, NAME) == "failed: Failed: ping timed out"


def _with_defaults(value: object, parameters: dict) -> object:
    """The template's value with each `Ref` to a parameter that has a default replaced by the default."""
    if isinstance(value, dict):
        if value.keys() == {"Ref"} and "Default" in parameters.get(value["Ref"], {}):
            return parameters[value["Ref"]]["Default"]
        return {key: _with_defaults(item, parameters) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_defaults(item, parameters) for item in value]
    return value


def test_helper_defaults_are_the_template_defaults() -> None:
    """The boto3 helper and the CloudFormation template release the same endpoint when left at defaults."""
    template, problems = decode(str(TEMPLATE))
    assert not problems, problems
    resources = _with_defaults(template["Resources"], template["Parameters"])
    defaults = replace(RELEASE, alarms=())
    environment = resources["Model"]["Properties"]["PrimaryContainer"]["Environment"]
    condition, _, unpinned = environment["INF2SERVE_ARTIFACT"]["Fn::If"]
    assert condition == "Pinned" and template["Parameters"]["ArtifactDigest"]["Default"] == ""
    environment["INF2SERVE_ARTIFACT"] = unpinned
    expected_environment = model_request(defaults, NAME)["PrimaryContainer"]["Environment"]
    assert {name: str(value) for name, value in environment.items()} == expected_environment
    (variant,) = resources["EndpointConfig"]["Properties"]["ProductionVariants"]
    (expected_variant,) = endpoint_config_request(defaults, NAME)["ProductionVariants"]
    assert {**variant, "ModelName": NAME} == expected_variant
    policy = resources["Endpoint"]["Properties"]["DeploymentConfig"]["BlueGreenUpdatePolicy"]
    assert policy == deployment_config(defaults)["BlueGreenUpdatePolicy"]


def test_cli_resolves_an_alias_to_the_published_prefix(
    s3, bucket, stable_artifact, monkeypatch, capsys
) -> None:
    artifact = stable_artifact.manifest.artifact_id  # <model>/<config-hash prefix>
    upload_tree(s3.client(), Path(stable_artifact.uri), bucket, f"llm/{artifact}")
    alias = promote(open_store(f"s3://{bucket}/llm/{artifact}"), stable_artifact.manifest, "prod")
    sagemaker = boto3.client("sagemaker", region_name="us-east-1")
    created = []
    with Stubber(sagemaker) as stubber:
        stubber.add_client_error("describe_endpoint", "ValidationException", "Could not find endpoint", 400)
        stubber.add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"})
        stubber.add_response(
            "create_endpoint_config", {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:x/c"}
        )
        stubber.add_response("create_endpoint", {"EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/llm"})
        sagemaker.meta.events.register(
            "provide-client-params.sagemaker.CreateModel", lambda params, **_: created.append(params)
        )
        monkeypatch.setattr("deploy.sagemaker.cli.boto3.client", lambda *args, **kwargs: sagemaker)
        assert main([*CLI, "--artifact", alias]) == 0
    source = created[0]["PrimaryContainer"]["ModelDataSource"]["S3DataSource"]
    assert source["S3Uri"] == f"s3://{bucket}/llm/{artifact}/"
    # Deployed pinned: the container refuses any manifest but the one the alias named at release time.
    digest = hashlib.sha256((Path(stable_artifact.uri) / "manifest.json").read_bytes()).hexdigest()
    assert (
        created[0]["PrimaryContainer"]["Environment"]["INF2SERVE_ARTIFACT"]
        == f"/opt/ml/model@sha256:{digest}"
    )
    out = capsys.readouterr().out
    assert "llm: deploying endpoint config llm-" in out
    assert f"s3://{bucket}/llm/{artifact}@sha256:{digest}" in out


def test_cli_refuses_a_pin_the_manifest_does_not_match(s3, bucket, stable_artifact, capsys) -> None:
    artifact = stable_artifact.manifest.artifact_id
    upload_tree(s3.client(), Path(stable_artifact.uri), bucket, f"pin/{artifact}")
    assert main([*CLI, "--artifact", f"s3://{bucket}/pin/{artifact}@sha256:{'0' * 64}"]) == 2
    assert f"is pinned to sha256:{'0' * 64}, but its manifest.json hashes to" in capsys.readouterr().err


def test_cli_refuses_an_unpublished_artifact(s3, bucket, capsys) -> None:
    s3.client().put_object(Bucket=bucket, Key="llm/stories260K/3f2a9c1b/golden.json", Body=b"{}")
    assert main([*CLI, "--artifact", f"s3://{bucket}/llm/stories260K/3f2a9c1b"]) == 2
    assert "no published artifact" in capsys.readouterr().err
