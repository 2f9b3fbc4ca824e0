"""The CloudFormation templates: cfn-lint clean, and wired the way the server needs (uncompressed artifact,
guardrails, weighted tracks, drain and keep-alive timings, env names the server reads)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cfnlint.decode import decode

from app.settings import ServerSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SAGEMAKER = DEPLOY / "sagemaker" / "template.yaml"
ALB = DEPLOY / "alb" / "template.yaml"
CFN_LINT = Path(sys.executable).parent / "cfn-lint"


def _load(path: Path) -> dict:
    template, problems = decode(str(path))
    assert not problems, problems
    return template


def _cfn_lint(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CFN_LINT), *map(str, paths)], capture_output=True, text=True, timeout=120)


def test_templates_pass_cfn_lint() -> None:
    result = _cfn_lint(SAGEMAKER, ALB)
    # rc is a bitmask (2 error, 4 warning, 8 informational): all clear is 0.
    assert result.returncode == 0, result.stdout + result.stderr


def test_cfn_lint_rejects_a_broken_deployment_config(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(SAGEMAKER.read_text().replace("Type: CANARY", "Type: CANARI"))
    result = _cfn_lint(broken)
    assert result.returncode & 2, result.stdout
    assert "CANARI" in result.stdout


@pytest.fixture(scope="module")
def resources() -> dict:
    return _load(SAGEMAKER)["Resources"]


@pytest.fixture(scope="module")
def template() -> dict:
    return _load(ALB)


class TestSageMaker:
    def test_model_data_is_an_uncompressed_prefix(self, resources: dict) -> None:
        source = resources["Model"]["Properties"]["PrimaryContainer"]["ModelDataSource"]["S3DataSource"]
        assert source["S3DataType"] == "S3Prefix"
        assert source["CompressionType"] == "None"
        assert source["S3Uri"] == {"Fn::Sub": "s3://${ArtifactBucket}/${ArtifactPrefix}"}

    def test_container_reads_the_mounted_artifact(
        self, resources: dict, server_env_names: frozenset[str]
    ) -> None:
        env = resources["Model"]["Properties"]["PrimaryContainer"]["Environment"]
        assert set(env) <= server_env_names
        assert env["INF2SERVE_ARTIFACT"] == "/opt/ml/model"
        assert env["INF2SERVE_DEVICE"] == "neuron"

    def test_drain_and_in_flight_fit_before_sigkill(self) -> None:
        template = _load(SAGEMAKER)
        env = template["Resources"]["Model"]["Properties"]["PrimaryContainer"]["Environment"]
        drain_max = template["Parameters"]["DrainSeconds"]["MaxValue"]
        assert (
            drain_max + float(env["INF2SERVE_SHUTDOWN_TIMEOUT_S"]) < 30
        )  # SageMaker: SIGKILL 30 s after SIGTERM

    def test_variant_is_inf2_with_loading_timeouts(self) -> None:
        template = _load(SAGEMAKER)
        params = template["Parameters"]
        (variant,) = template["Resources"]["EndpointConfig"]["Properties"]["ProductionVariants"]
        assert all(t.startswith("ml.inf2.") for t in params["InstanceType"]["AllowedValues"])
        assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == {
            "Ref": "StartupHealthCheckTimeoutSeconds"
        }
        assert variant["ModelDataDownloadTimeoutInSeconds"] == {"Ref": "ModelDataDownloadTimeoutSeconds"}
        # Neuron load + warmup takes minutes: far above the 4-minute historical default.
        assert params["StartupHealthCheckTimeoutSeconds"]["Default"] >= 900

    def test_endpoint_rolls_back_on_both_alarms(self, resources: dict) -> None:
        config = resources["Endpoint"]["Properties"]["DeploymentConfig"]
        routing = config["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"]
        assert routing["Type"] == "CANARY"
        alarms = [a["AlarmName"] for a in config["AutoRollbackConfiguration"]["Alarms"]]
        assert alarms == [{"Ref": "ErrorRateAlarm"}, {"Ref": "LatencyAlarm"}]
        metrics = [
            m["MetricStat"]["Metric"]["MetricName"]
            for m in resources["ErrorRateAlarm"]["Properties"]["Metrics"]
            if "MetricStat" in m
        ]
        assert metrics == ["Invocation5XXErrors", "Invocations"]
        assert resources["LatencyAlarm"]["Properties"]["MetricName"] == "ModelLatency"

    def test_names_are_generated_so_updates_can_replace(self, resources: dict) -> None:
        assert "ModelName" not in resources["Model"]["Properties"]
        assert "EndpointConfigName" not in resources["EndpointConfig"]["Properties"]


class TestAlb:
    def test_listener_forwards_to_both_tracks_by_weight(self, template: dict) -> None:
        (action,) = template["Resources"]["Listener"]["Properties"]["DefaultActions"]
        groups = action["ForwardConfig"]["TargetGroups"]
        assert groups == [
            {"TargetGroupArn": {"Ref": "StableTargetGroup"}, "Weight": {"Ref": "StableWeight"}},
            {"TargetGroupArn": {"Ref": "CanaryTargetGroup"}, "Weight": {"Ref": "CanaryWeight"}},
        ]

    @pytest.mark.parametrize("track", ["Stable", "Canary"])
    def test_track_health_checks_and_drains(self, template: dict, track: str) -> None:
        group = template["Resources"][f"{track}TargetGroup"]["Properties"]
        assert group["HealthCheckPath"] == "/ready"
        attributes = {a["Key"]: a["Value"] for a in group["TargetGroupAttributes"]}
        assert attributes["deregistration_delay.timeout_seconds"] == {"Ref": "DrainSeconds"}
        asg = template["Resources"][f"{track}Group"]["Properties"]
        assert asg["TargetGroupARNs"] == [{"Ref": f"{track}TargetGroup"}]
        assert asg["HealthCheckType"] == "ELB"

    def test_idle_timeout_below_server_keep_alive(self, template: dict) -> None:
        params = template["Parameters"]
        attributes = template["Resources"]["LoadBalancer"]["Properties"]["LoadBalancerAttributes"]
        assert {"Key": "idle_timeout.timeout_seconds", "Value": {"Ref": "IdleTimeoutSeconds"}} in attributes
        assert params["IdleTimeoutSeconds"]["Default"] < params["KeepAliveSeconds"]["Default"]
        assert ServerSettings.model_fields["keep_alive_s"].default > params["IdleTimeoutSeconds"]["Default"]

    def test_user_data_runs_the_container_with_neuron_devices(
        self, template: dict, server_env_names: frozenset[str]
    ) -> None:
        scripts = {}
        for track in ("Stable", "Canary"):
            data = template["Resources"][f"{track}LaunchTemplate"]["Properties"]["LaunchTemplateData"]
            script, variables = data["UserData"]["Fn::Base64"]["Fn::Sub"]
            assert variables == {
                "Image": {"Ref": f"{track}ImageUri"},
                "Artifact": {"Ref": f"{track}ArtifactUri"},
            }
            scripts[track] = script
        assert scripts["Stable"] == scripts["Canary"], "the two tracks must run the same script"
        script = scripts["Stable"]
        assert 'for dev in /dev/neuron*; do devices+=("--device=$dev")' in script
        assert re.search(r'"\$image" serve\s*$', script)
        assert set(re.findall(r"-e (INF2SERVE_\w+)=", script)) <= server_env_names
        assert "INF2SERVE_DRAIN_S='${DrainSeconds}'" in script
        assert "INF2SERVE_KEEP_ALIVE_S='${KeepAliveSeconds}'" in script


def _render_sub(script: str, values: dict[str, str]) -> str:
    """CloudFormation's Fn::Sub: `${Name}` becomes its value, `${!Text}` the literal `${Text}`."""

    def one(match: re.Match[str]) -> str:
        return "${" + match.group(2) + "}" if match.group(1) else values[match.group(2)]

    return re.sub(r"\$\{(!)?([^}]+)\}", one, script)


def test_user_data_renders_to_valid_bash(template: dict, tmp_path: Path) -> None:
    data = template["Resources"]["StableLaunchTemplate"]["Properties"]["LaunchTemplateData"]
    script, _ = data["UserData"]["Fn::Base64"]["Fn::Sub"]
    values = {"Image": "1.dkr.ecr.us-east-1.amazonaws.com/inf2serve:1", "Artifact": "s3://b/llm/3f2a/"}
    values |= {"AWS::Region": "us-east-1", "DrainSeconds": "30", "InFlightSeconds": "60"}
    values |= {"KeepAliveSeconds": "75"}
    path = tmp_path / "user-data.sh"
    path.write_text(_render_sub(script, values))
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=10)
    rendered = path.read_text()
    assert '"${devices[@]}"' in rendered and "--stop-timeout $(( 30 + 60 + 5 ))" in rendered
