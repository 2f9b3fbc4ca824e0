"""Move a SageMaker endpoint to a new artifact through the deployment guardrails (the boto3 twin of
`template.yaml` beside this module).

A release is a new Model (the artifact's S3 prefix mounted uncompressed into /opt/ml/model) and a new,
immutable EndpointConfig; an existing endpoint is updated blue/green with a canary step and rolls back on
its own when any of the given CloudWatch alarms fires during the bake. A new endpoint is created directly.
The artifact is deployed pinned (`uri@sha256:<manifest digest>`): the container refuses any other
manifest and verifies every file cryptographically. Timeouts come from `deploy.timeouts.sagemaker()`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError

from app.artifacts.pin import PIN_SEPARATOR, split_pin
from app.errors import ConfigError
from app.settings import SAGEMAKER_MODEL_DIR
from deploy import timeouts

VARIANT = "AllTraffic"
INFERENCE_AMI = "al2-ami-sagemaker-inference-neuron-2"
SIGKILL_AFTER_S = timeouts.SAGEMAKER_SIGKILL_AFTER_S
SERVER_CUT_GRACE_S, MARGIN_S = timeouts.SERVER_CUT_GRACE_S, timeouts.MARGIN_S
SAGEMAKER_BUDGET = timeouts.sagemaker()


@dataclass(frozen=True, slots=True)
class Release:
    endpoint: str
    image: str
    artifact: str
    role_arn: str
    alarms: tuple[str, ...]
    instance_type: str = "ml.inf2.xlarge"
    instance_count: int = 2
    canary_instances: int = 1
    bake_s: int = 3600  # long enough for deploy/sagemaker/canary_job.py to judge the new fleet
    termination_wait_s: int = 300
    max_execution_s: int = 14400
    startup_timeout_s: int = 1800
    download_timeout_s: int = 1800
    volume_size_gb: int = 128
    drain_s: int = SAGEMAKER_BUDGET.drain_s
    shutdown_timeout_s: int = SAGEMAKER_BUDGET.shutdown_timeout_s

    def check(self) -> None:
        if not self.artifact.startswith("s3://"):
            raise ConfigError(f"the artifact must be on S3 for SageMaker to mount it, got {self.artifact}")
        if not self.instance_type.startswith("ml.inf2."):
            raise ConfigError(f"--instance-type must be an ml.inf2 type, got {self.instance_type}")
        if self.canary_instances * 2 > self.instance_count:
            count, canary = self.instance_count, self.canary_instances
            raise ConfigError(f"the canary ({canary} instances) may be at most half of the {count} instances")
        if self.drain_s + self.shutdown_timeout_s + SERVER_CUT_GRACE_S + MARGIN_S > SIGKILL_AFTER_S:
            raise ConfigError(
                f"drain + shutdown timeout + the server's {SERVER_CUT_GRACE_S} s cut + {MARGIN_S} s margin "
                f"must fit SageMaker's {SIGKILL_AFTER_S} s before SIGKILL"
            )
        if (
            not 600 <= self.max_execution_s <= 28800
            or self.max_execution_s <= self.bake_s + self.termination_wait_s
        ):
            raise ConfigError(
                "max execution time must be 600-28800 s and exceed the bake plus termination wait"
            )

    def name(self, now: datetime) -> str:
        """Model and endpoint-config name: endpoint, digest of what is deployed, UTC time (<= 63 chars)."""
        digest = hashlib.sha256(f"{self.image}\n{self.artifact}".encode()).hexdigest()[:8]
        return f"{self.endpoint[:39]}-{digest}-{now:%Y%m%d%H%M%S}"


def _mounted(reference: str) -> str:
    """Where the container finds the artifact: /opt/ml/model, carrying the reference's pin if any."""
    digest = split_pin(reference)[1]
    return f"{SAGEMAKER_MODEL_DIR}{PIN_SEPARATOR}{digest}" if digest else SAGEMAKER_MODEL_DIR


def model_request(release: Release, name: str) -> dict[str, Any]:
    return {
        "ModelName": name,
        "ExecutionRoleArn": release.role_arn,
        "EnableNetworkIsolation": True,  # the container reads /opt/ml/model only (audit H4)
        "PrimaryContainer": {
            "Image": release.image,
            "ModelDataSource": {
                "S3DataSource": {
                    # An S3Prefix URI must end in '/': each key below it becomes a file in /opt/ml/model.
                    "S3Uri": split_pin(release.artifact)[0].rstrip("/") + "/",
                    "S3DataType": "S3Prefix",
                    "CompressionType": "None",
                }
            },
            "Environment": {
                "INF2SERVE_ARTIFACT": _mounted(release.artifact),
                "INF2SERVE_DEVICE": "neuron",
                "INF2SERVE_REPLICAS": "auto",  # 24xl/48xl: one engine per NeuronCore group
                "INF2SERVE_REQUEST_TIMEOUT_S": str(SAGEMAKER_BUDGET.request_timeout_s),
                "INF2SERVE_STREAM_TIMEOUT_S": str(SAGEMAKER_BUDGET.stream_timeout_s),
                "INF2SERVE_KEEP_ALIVE_S": str(SAGEMAKER_BUDGET.keep_alive_s),
                "INF2SERVE_DRAIN_S": str(release.drain_s),
                "INF2SERVE_SHUTDOWN_TIMEOUT_S": str(release.shutdown_timeout_s),
            },
        },
    }


def endpoint_config_request(release: Release, name: str) -> dict[str, Any]:
    variant = {
        "VariantName": VARIANT,
        "ModelName": name,
        "InstanceType": release.instance_type,
        "InitialInstanceCount": release.instance_count,
        "InitialVariantWeight": 1.0,
        "ContainerStartupHealthCheckTimeoutInSeconds": release.startup_timeout_s,
        "ModelDataDownloadTimeoutInSeconds": release.download_timeout_s,
        "VolumeSizeInGB": release.volume_size_gb,
        "InferenceAmiVersion": INFERENCE_AMI,
    }
    return {"EndpointConfigName": name, "ProductionVariants": [variant]}


def deployment_config(release: Release) -> dict[str, Any]:
    return {
        "BlueGreenUpdatePolicy": {
            "TrafficRoutingConfiguration": {
                "Type": "CANARY",
                "CanarySize": {"Type": "INSTANCE_COUNT", "Value": release.canary_instances},
                "WaitIntervalInSeconds": release.bake_s,
            },
            "TerminationWaitInSeconds": release.termination_wait_s,
            "MaximumExecutionTimeoutInSeconds": release.max_execution_s,
        },
        "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": alarm} for alarm in release.alarms]},
    }


def endpoint_status(client: Any, endpoint: str) -> str | None:
    """The endpoint's EndpointStatus, None when there is no such endpoint."""
    try:
        return str(client.describe_endpoint(EndpointName=endpoint)["EndpointStatus"])
    except ClientError as error:
        if error.response["Error"]["Code"] == "ValidationException":
            return None
        raise


def start(client: Any, release: Release, now: datetime | None = None) -> str:
    """Create the model and endpoint config, then create or guarded-update the endpoint; returns the name
    of the new endpoint config (what the endpoint runs once the deployment succeeds). An update that
    would be refused (no alarms; an endpoint not InService: UpdateEndpoint refuses one that is Creating,
    Updating, RollingBack, ...) is refused before anything is created, and a model and config whose
    UpdateEndpoint still fails are deleted again (audit H10), so a release leaves no orphans."""
    release.check()
    name = release.name(now or datetime.now(UTC))
    status = endpoint_status(client, release.endpoint)
    if status is not None and not release.alarms:
        raise ConfigError("updating a live endpoint needs at least one --alarm for auto-rollback")
    if status not in (None, "InService"):
        raise ConfigError(f"endpoint {release.endpoint} is {status}: wait until it is InService, then retry")
    client.create_model(**model_request(release, name))
    client.create_endpoint_config(**endpoint_config_request(release, name))
    try:
        if status is None:
            client.create_endpoint(EndpointName=release.endpoint, EndpointConfigName=name)
        else:
            client.update_endpoint(
                EndpointName=release.endpoint,
                EndpointConfigName=name,
                DeploymentConfig=deployment_config(release),
                RetainDeploymentConfig=False,
            )
    except ClientError:
        client.delete_endpoint_config(EndpointConfigName=name)
        client.delete_model(ModelName=name)
        raise
    return name


def outcome(client: Any, endpoint: str, config_name: str) -> str:
    """After the endpoint settles: 'deployed', 'rolled back' (serving the old config) or its failure."""
    described = client.describe_endpoint(EndpointName=endpoint)
    if described["EndpointStatus"] != "InService":
        return f"failed: {described['EndpointStatus']}: {described.get('FailureReason', 'no reason given')}"
    return "deployed" if described["EndpointConfigName"] == config_name else "rolled back"
