"""The CloudFormation templates: cfn-lint clean, and wired the way the server needs (uncompressed artifact,
guardrails, weighted tracks, drain and keep-alive timings, env names the server reads)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cfnlint.decode import decode

from deploy import timeouts
from deploy.canary.publish import FAMILIES, NAMESPACE
from deploy.canary.targets import TRACK_HEADER

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SAGEMAKER = DEPLOY / "sagemaker" / "template.yaml"
ALB = DEPLOY / "alb" / "template.yaml"
IRSA = DEPLOY / "eks" / "irsa.yaml"
CFN_LINT = Path(sys.executable).parent / "cfn-lint"


def _load(path: Path) -> dict:
    template, problems = decode(str(path))
    assert not problems, problems
    return template


def _cfn_lint(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CFN_LINT), *map(str, paths)], capture_output=True, text=True, timeout=120)


def test_templates_pass_cfn_lint() -> None:
    result = _cfn_lint(SAGEMAKER, ALB, IRSA)
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
    def test_the_model_has_no_network(self, resources: dict) -> None:
        # Audit H4: the container needs no egress, it reads /opt/ml/model (SageMaker API CreateModel,
        # EnableNetworkIsolation: "no inbound or outbound network calls can be made to or from the model
        # container"; SageMaker still downloads ModelDataSource for it).
        assert resources["Model"]["Properties"]["EnableNetworkIsolation"] is True
        components = _load(DEPLOY / "sagemaker" / "inference-components.yaml")
        assert components["Resources"]["Model"]["Properties"]["EnableNetworkIsolation"] is True

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
        assert env["INF2SERVE_DEVICE"] == "neuron"

    def test_timeouts_are_the_budgets(self, resources: dict) -> None:
        env = resources["Model"]["Properties"]["PrimaryContainer"]["Environment"]
        budget = timeouts.sagemaker()
        assert float(env["INF2SERVE_REQUEST_TIMEOUT_S"]) == budget.request_timeout_s < 60
        # Streams are not under InvokeEndpoint's 60 s (audit W1): the API reference gives
        # InvokeEndpointWithResponseStream no figure, so they get G like every other platform.
        assert float(env["INF2SERVE_STREAM_TIMEOUT_S"]) == budget.stream_timeout_s
        assert budget.stream_timeout_s == timeouts.DEFAULT_MAX_GENERATION_S > budget.request_timeout_s
        assert float(env["INF2SERVE_DRAIN_S"]) == budget.drain_s
        assert float(env["INF2SERVE_SHUTDOWN_TIMEOUT_S"]) == budget.shutdown_timeout_s
        assert float(env["INF2SERVE_KEEP_ALIVE_S"]) == budget.keep_alive_s
        # SageMaker: SIGKILL 30 s after SIGTERM
        assert budget.drain_s + budget.shutdown_timeout_s < timeouts.SAGEMAKER_SIGKILL_AFTER_S

    def test_a_pinned_digest_reaches_the_container(self, resources: dict) -> None:
        env = resources["Model"]["Properties"]["PrimaryContainer"]["Environment"]
        assert env["INF2SERVE_ARTIFACT"] == {
            "Fn::If": ["Pinned", {"Fn::Sub": "/opt/ml/model@${ArtifactDigest}"}, "/opt/ml/model"]
        }

    def test_role_is_scoped_to_the_artifact(self, resources: dict) -> None:
        statements = _statements(resources["ExecutionRole"])
        listing = _granting(statements, "s3:ListBucket")
        assert listing["Condition"] == {"StringLike": {"s3:prefix": {"Fn::Sub": "${ArtifactPrefix}*"}}}
        assert _granting(statements, "s3:GetObject")["Resource"] == {
            "Fn::Sub": "arn:${AWS::Partition}:s3:::${ArtifactBucket}/${ArtifactPrefix}*"
        }
        _assert_kms_when_given(statements)
        alarms = _granting(statements, "cloudwatch:DescribeAlarms")["Resource"]
        assert alarms["Fn::Sub"].endswith(":alarm:${AWS::StackName}-*")  # this stack's alarms only
        granted = {a for s in _plain(statements) for a in _actions(s)}
        assert "cloudwatch:PutMetricData" not in granted
        unscoped = {a for s in _plain(statements) if s["Resource"] == "*" for a in _actions(s)}
        assert unscoped == {"ecr:GetAuthorizationToken"}  # the one action IAM cannot scope

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

    def test_rollback_alarms_judge_the_new_fleet_on_ttft_and_inter_token_time(self, resources: dict) -> None:
        # Audit W2: deployment-guardrails-configuration, "Monitor model latency on the new fleet": a
        # new-fleet alarm adds the EndpointConfigName dimension; an alarm the old fleet trips ends the
        # deployment. Latency is judged per token by the canary job (TTFT, inter-token), not by
        # ModelLatency, which is the whole generation and grows with max_tokens.
        config = resources["Endpoint"]["Properties"]["DeploymentConfig"]
        routing = config["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"]
        assert routing["Type"] == "CANARY"
        alarms = [a["AlarmName"]["Ref"] for a in config["AutoRollbackConfiguration"]["Alarms"]]
        assert alarms == ["ErrorRateAlarm", "CanaryVerdictAlarm", "TTFTAlarm", "InterTokenAlarm"]
        new_fleet = {
            "Name": "EndpointConfigName",
            "Value": {"Fn::GetAtt": ["EndpointConfig", "EndpointConfigName"]},
        }
        for metric in resources["ErrorRateAlarm"]["Properties"]["Metrics"]:
            if "MetricStat" in metric:
                assert new_fleet in metric["MetricStat"]["Metric"]["Dimensions"]
        published = {m: f for f, ms in FAMILIES.items() for m in ms}
        for name, metric in (
            ("CanaryVerdictAlarm", "Verdict"),
            ("TTFTAlarm", "TTFTRegression"),
            ("InterTokenAlarm", "InterTokenRegression"),
        ):
            alarm = resources[name]["Properties"]
            assert alarm["Namespace"] == NAMESPACE and alarm["MetricName"] == metric
            assert new_fleet in alarm["Dimensions"]
            assert alarm["Threshold"] == 1 and alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
        assert (
            set(FAMILIES) == {"TTFTRegression", "InterTokenRegression"}
            and published["TTFT"] == "TTFTRegression"
        )
        assert not any(r["Properties"].get("MetricName") == "ModelLatency" for r in resources.values())

    def test_large_instances_run_a_replica_per_core_group(self, resources: dict) -> None:
        # Audit W10: INF2SERVE_REPLICAS defaults to 1 (app/settings.py).
        assert (
            resources["Model"]["Properties"]["PrimaryContainer"]["Environment"]["INF2SERVE_REPLICAS"]
            == "auto"
        )

    def test_exit_code_3_is_counted_from_the_endpoint_log(self, resources: dict) -> None:
        metric_filter = resources["ResponsesCutFilter"]
        assert metric_filter["Properties"]["LogGroupName"] == {
            "Fn::Sub": "/aws/sagemaker/Endpoints/${EndpointName}"
        }
        assert (
            metric_filter["Properties"]["FilterPattern"] == '{ $.msg = "stopped with responses cut short" }'
        )
        assert metric_filter["DependsOn"] == "Endpoint"

    def test_the_stack_tells_what_it_deployed(self) -> None:
        # Audit W6: one owner per endpoint; after a stack update DescribeEndpoint must name this config.
        outputs = _load(SAGEMAKER)["Outputs"]
        assert outputs["EndpointConfigName"]["Value"] == {
            "Fn::GetAtt": ["EndpointConfig", "EndpointConfigName"]
        }
        assert outputs["ExecutionRoleArn"]["Value"] == {"Fn::GetAtt": ["ExecutionRole", "Arn"]}

    def test_names_are_generated_so_updates_can_replace(self, resources: dict) -> None:
        assert "ModelName" not in resources["Model"]["Properties"]
        assert "EndpointConfigName" not in resources["EndpointConfig"]["Properties"]


class TestAlb:
    def test_listener_forwards_to_both_tracks_by_weight(self, template: dict) -> None:
        listener = template["Resources"]["Listener"]
        (action,) = listener["Properties"]["DefaultActions"]
        groups = action["ForwardConfig"]["TargetGroups"]
        assert groups == [
            {"TargetGroupArn": {"Ref": "StableTargetGroup"}, "Weight": {"Ref": "StableWeight"}},
            {
                "TargetGroupArn": {"Ref": "CanaryTargetGroup"},
                "Weight": {"Fn::If": ["CanaryHasCapacity", {"Ref": "CanaryWeight"}, 0]},
            },
        ]
        # Audit W4: a DependsOn on the groups made a weight change wait for both rolling updates.
        assert "DependsOn" not in listener

    def test_a_certificate_makes_the_listener_https(self, template: dict) -> None:
        # Audit H4. AWS::ElasticLoadBalancingV2::Listener: HTTPS needs Certificates and takes an
        # SslPolicy; ELBSecurityPolicy-TLS13-1-2-2021-06 is the policy the ALB docs recommend.
        listener = template["Resources"]["Listener"]["Properties"]
        assert template["Parameters"]["CertificateArn"]["Default"] == ""
        assert listener["Protocol"] == {"Fn::If": ["HasCertificate", "HTTPS", "HTTP"]}
        assert listener["Port"] == {"Fn::If": ["HasCertificate", 443, 80]}
        assert listener["SslPolicy"]["Fn::If"][1] == "ELBSecurityPolicy-TLS13-1-2-2021-06"
        (ingress,) = template["Resources"]["LoadBalancerSecurityGroup"]["Properties"]["SecurityGroupIngress"]
        assert ingress["FromPort"] == ingress["ToPort"] == listener["Port"]

    def test_the_balancer_alarms_on_its_5xx_and_unhealthy_targets(self, template: dict) -> None:
        # Audit H4. CloudWatch metrics for Application Load Balancers: HTTPCode_ELB_5XX_Count per
        # LoadBalancer, UnHealthyHostCount per TargetGroup and LoadBalancer.
        resources = template["Resources"]
        elb = resources["LoadBalancer5xxAlarm"]["Properties"]
        assert (elb["Namespace"], elb["MetricName"]) == ("AWS/ApplicationELB", "HTTPCode_ELB_5XX_Count")
        for track in ("Stable", "Canary"):
            alarm = resources[f"{track}UnhealthyAlarm"]["Properties"]
            assert alarm["MetricName"] == "UnHealthyHostCount"
            dimensions = {d["Name"]: d["Value"] for d in alarm["Dimensions"]}
            assert dimensions["TargetGroup"] == {"Fn::GetAtt": [f"{track}TargetGroup", "TargetGroupFullName"]}
        for alarm in ("LoadBalancer5xxAlarm", "StableUnhealthyAlarm", "CanaryUnhealthyAlarm"):
            actions = resources[alarm]["Properties"]["AlarmActions"]
            assert actions == {
                "Fn::If": ["HasAlarmTopic", [{"Ref": "AlarmTopicArn"}], {"Ref": "AWS::NoValue"}]
            }

    def test_the_ami_is_pinned_not_reread_on_every_update(self, template: dict) -> None:
        # Audit W4. CloudFormation user guide, "Parameters", SSM parameter types: CloudFormation always
        # fetches the latest value of an SSM parameter on every update, so an emergency weight change could
        # replace every instance with a new DLAMI. An explicit AMI id changes only when the operator does.
        image = template["Parameters"]["ImageId"]
        assert image["Type"] == "AWS::EC2::Image::Id" and "Default" not in image

    def test_large_instances_run_a_replica_per_core_group(self, template: dict) -> None:
        # Audit W10: INF2SERVE_REPLICAS defaults to 1 (app/settings.py), so a TP2 artifact on an
        # inf2.48xlarge used 2 of its 24 NeuronCores; `auto` fills the instance.
        assert "-e INF2SERVE_REPLICAS=auto" in _user_data(template, "Stable")

    def test_container_logs_go_to_cloudwatch(self, template: dict) -> None:
        # Audit W12: with the json-file driver the logs died with the instance a failed update terminated.
        # Docker's awslogs driver needs logs:CreateLogStream and logs:PutLogEvents (Docker docs, awslogs).
        script = _user_data(template, "Stable")
        assert "--log-driver awslogs" in script and "awslogs-group='${LogGroup}'" in script
        logs = _granting(_statements(template["Resources"]["InstanceRole"]), "logs:PutLogEvents")
        assert set(logs["Action"]) == {"logs:CreateLogStream", "logs:PutLogEvents"}
        assert logs["Resource"] == {"Fn::GetAtt": ["LogGroup", "Arn"]}

    def test_exit_code_3_is_counted_and_alarmed(self, template: dict) -> None:
        # Issue 26, exit code 3: app/api/server.py logs "stopped with responses cut short" with the count
        # in `cut` before it exits 3; the metric filter turns the line into a ResponsesCut count.
        from app.api import server

        assert "stopped with responses cut short" in Path(server.__file__).read_text()
        resources = template["Resources"]
        metric_filter = resources["ResponsesCutFilter"]["Properties"]
        assert metric_filter["FilterPattern"] == '{ $.msg = "stopped with responses cut short" }'
        (transformation,) = metric_filter["MetricTransformations"]
        assert transformation["MetricValue"] == "$.cut"
        alarm = resources["ResponsesCutAlarm"]["Properties"]
        assert alarm["MetricName"] == transformation["MetricName"]
        assert alarm["Namespace"] == transformation["MetricNamespace"]
        assert alarm["Threshold"] == 0 and alarm["ComparisonOperator"] == "GreaterThanThreshold"

    @pytest.mark.parametrize("track", ["Stable", "Canary"])
    def test_rolling_updates_suspend_what_would_fail_them(self, template: dict, track: str) -> None:
        # Audit H5; CFN UpdatePolicy doc: HealthCheck, ReplaceUnhealthy, AZRebalance, AlarmNotification
        # and ScheduledActions "might cause the rolling update to fail".
        rolling = template["Resources"][f"{track}Group"]["UpdatePolicy"]["AutoScalingRollingUpdate"]
        assert set(rolling["SuspendProcesses"]) == {
            "HealthCheck",
            "ReplaceUnhealthy",
            "AZRebalance",
            "AlarmNotification",
            "ScheduledActions",
        }

    def test_a_header_reaches_one_track_through_the_balancer(self, template: dict) -> None:
        for priority, track in enumerate(("Stable", "Canary"), start=1):
            rule = template["Resources"][f"{track}TrackRule"]["Properties"]
            (condition,) = rule["Conditions"]
            assert condition["HttpHeaderConfig"] == {
                "HttpHeaderName": TRACK_HEADER,
                "Values": [track.lower()],
            }
            assert rule["Actions"] == [{"Type": "forward", "TargetGroupArn": {"Ref": f"{track}TargetGroup"}}]
            assert rule["Priority"] == priority and rule["ListenerArn"] == {"Ref": "Listener"}

    def test_canary_weight_is_zero_by_default_and_while_it_has_no_capacity(self, template: dict) -> None:
        params = template["Parameters"]
        assert params["CanaryWeight"]["Default"] == 0
        assert params["CanaryCapacity"]["Default"] == 0
        assert template["Conditions"]["CanaryHasCapacity"] == {
            "Fn::Not": [{"Fn::Equals": [{"Ref": "CanaryCapacity"}, 0]}]
        }

    @pytest.mark.parametrize("track", ["Stable", "Canary"])
    def test_track_health_checks_and_drains(self, template: dict, track: str) -> None:
        group = template["Resources"][f"{track}TargetGroup"]["Properties"]
        assert group["HealthCheckPath"] == "/ready"
        attributes = {a["Key"]: a["Value"] for a in group["TargetGroupAttributes"]}
        assert attributes["deregistration_delay.timeout_seconds"] == _budget("DeregistrationDelay")
        asg = template["Resources"][f"{track}Group"]["Properties"]
        assert asg["TargetGroupARNs"] == [{"Ref": f"{track}TargetGroup"}]
        assert asg["HealthCheckType"] == "ELB"
        assert asg["HealthCheckGracePeriod"] == timeouts.DEFAULT_STARTUP_S

    @pytest.mark.parametrize("track", ["Stable", "Canary"])
    def test_containers_on_the_bridge_network_reach_imdsv2(self, template: dict, track: str) -> None:
        data = template["Resources"][f"{track}LaunchTemplate"]["Properties"]["LaunchTemplateData"]
        assert data["MetadataOptions"]["HttpTokens"] == "required"
        assert data["MetadataOptions"]["HttpPutResponseHopLimit"] == 2  # host + the docker bridge
        assert "--network" not in data["UserData"]["Fn::Base64"]["Fn::Sub"][0]  # bridge: docker's default

    @pytest.mark.parametrize("track", ["Stable", "Canary"])
    def test_updates_roll_through_gated_on_ready(self, template: dict, track: str) -> None:
        group = template["Resources"][f"{track}Group"]
        rolling = group["UpdatePolicy"]["AutoScalingRollingUpdate"]
        assert rolling["WaitOnResourceSignals"] is True
        assert rolling["MaxBatchSize"] == 1
        assert rolling["MinInstancesInService"] == {"Ref": f"{track}Capacity"}
        assert group["CreationPolicy"]["ResourceSignal"]["Count"] == {"Ref": f"{track}Capacity"}
        for policy_time in (rolling["PauseTime"], group["CreationPolicy"]["ResourceSignal"]["Timeout"]):
            minutes = int(re.fullmatch(r"PT(\d+)M", policy_time)[1])
            assert timeouts.DEFAULT_STARTUP_S <= minutes * 60 <= 3600  # covers startup; CFN's cap 1 h
        # MaxSize is capacity + 1 (room for the new instance), looked up since CFN has no arithmetic.
        select = group["Properties"]["MaxSize"]["Fn::Select"]
        assert select[0] == {"Ref": f"{track}Capacity"}
        by_capacity = template["Mappings"]["Surge"]["MaxSize"]["ByCapacity"].split(",")
        top = template["Parameters"][f"{track}Capacity"]["MaxValue"]
        assert [int(v) for v in by_capacity[: top + 1]] == [c + 1 for c in range(top + 1)]

    def test_user_data_signals_only_once_ready(self, template: dict) -> None:
        script = _user_data(template, "Stable")
        ready = script.index("until curl -sf -o /dev/null http://127.0.0.1:8080/ready")
        assert script.index("signal SUCCESS") > ready > script.index('"$image" serve')
        assert "trap 'signal FAILURE' ERR" in script

    def test_timeout_budget_mapping_is_derived(self, template: dict) -> None:
        param = template["Parameters"]["MaxGenerationSeconds"]
        assert [int(v) for v in param["AllowedValues"]] == list(timeouts.GENERATION_CHOICES)
        assert int(param["Default"]) == timeouts.DEFAULT_MAX_GENERATION_S
        mapping = template["Mappings"]["TimeoutBudget"]
        for generation in timeouts.GENERATION_CHOICES:
            budget = timeouts.alb(generation)
            assert mapping[str(generation)] == {
                "RequestTimeout": budget.request_timeout_s,
                "Drain": budget.drain_s,
                "ShutdownTimeout": budget.shutdown_timeout_s,
                "KeepAlive": budget.keep_alive_s,
                "IdleTimeout": budget.idle_timeout_s,
                "DeregistrationDelay": budget.deregistration_delay_s,
                "StopTimeout": budget.stop_timeout_s,
            }
        attributes = template["Resources"]["LoadBalancer"]["Properties"]["LoadBalancerAttributes"]
        assert {"Key": "idle_timeout.timeout_seconds", "Value": _budget("IdleTimeout")} in attributes

    def test_role_is_scoped_to_the_two_artifacts(self, template: dict) -> None:
        statements = _statements(template["Resources"]["InstanceRole"])
        listing = _granting(statements, "s3:ListBucket")
        assert listing["Condition"]["StringLike"]["s3:prefix"] == [
            {"Fn::Sub": "${StableArtifactPrefix}*"},
            {"Fn::Sub": "${CanaryArtifactPrefix}*"},
        ]
        assert all(
            "ArtifactPrefix}*" in r["Fn::Sub"] for r in _granting(statements, "s3:GetObject")["Resource"]
        )
        _assert_kms_when_given(statements)
        assert _granting(statements, "cloudformation:SignalResource")["Resource"] == {"Ref": "AWS::StackId"}

    def test_user_data_runs_the_container_with_neuron_devices(
        self, template: dict, server_env_names: frozenset[str]
    ) -> None:
        scripts = {}
        for track in ("Stable", "Canary"):
            data = template["Resources"][f"{track}LaunchTemplate"]["Properties"]["LaunchTemplateData"]
            script, variables = data["UserData"]["Fn::Base64"]["Fn::Sub"]
            assert variables["Image"] == {"Ref": f"{track}ImageUri"}
            assert variables["Group"] == f"{track}Group"
            pinned, unpinned = variables["Artifact"]["Fn::If"][1:]
            assert pinned == {
                "Fn::Sub": f"s3://${{ArtifactBucket}}/${{{track}ArtifactPrefix}}@${{{track}ArtifactDigest}}"
            }
            assert unpinned == {"Fn::Sub": f"s3://${{ArtifactBucket}}/${{{track}ArtifactPrefix}}"}
            scripts[track] = script
        assert scripts["Stable"] == scripts["Canary"], "the two tracks must run the same script"
        script = scripts["Stable"]
        assert 'for dev in /dev/neuron*; do devices+=("--device=$dev")' in script
        assert re.search(r'"\$image" serve\n', script)
        assert set(re.findall(r"-e (INF2SERVE_\w+)=", script)) <= server_env_names
        for name in ("REQUEST_TIMEOUT_S", "DRAIN_S", "SHUTDOWN_TIMEOUT_S", "KEEP_ALIVE_S"):
            assert f"INF2SERVE_{name}=" in script


def _budget(key: str) -> dict:
    return {"Fn::FindInMap": ["TimeoutBudget", {"Ref": "MaxGenerationSeconds"}, key]}


def _user_data(template: dict, track: str) -> str:
    data = template["Resources"][f"{track}LaunchTemplate"]["Properties"]["LaunchTemplateData"]
    return data["UserData"]["Fn::Base64"]["Fn::Sub"][0]


def _statements(role: dict) -> list:
    """The role's statements; a conditional one (Fn::If) stays as it is, for _assert_kms_when_given."""
    (policy,) = role["Properties"]["Policies"]
    return policy["PolicyDocument"]["Statement"]


def _plain(statements: list) -> list[dict]:
    return [s for s in statements if "Fn::If" not in s]


def _actions(statement: dict) -> list[str]:
    action = statement["Action"]
    return action if isinstance(action, list) else [action]


def _granting(statements: list, action: str) -> dict:
    (statement,) = [s for s in _plain(statements) if action in _actions(s)]
    return statement


def _assert_kms_when_given(statements: list) -> None:
    (kms,) = [s for s in statements if "Fn::If" in s]
    condition, grant, otherwise = kms["Fn::If"]
    assert condition == "ArtifactsUseKms" and otherwise == {"Ref": "AWS::NoValue"}
    assert grant["Action"] == "kms:Decrypt" and grant["Resource"] == {"Ref": "ArtifactKmsKeyArn"}
    assert grant["Condition"] == {
        "StringEquals": {"kms:ViaService": {"Fn::Sub": "s3.${AWS::Region}.amazonaws.com"}}
    }


def _render_sub(script: str, values: dict[str, str]) -> str:
    """CloudFormation's Fn::Sub: `${Name}` becomes its value, `${!Text}` the literal `${Text}`."""

    def one(match: re.Match[str]) -> str:
        return "${" + match.group(2) + "}" if match.group(1) else values[match.group(2)]

    return re.sub(r"\$\{(!)?([^}]+)\}", one, script)


def test_user_data_renders_to_valid_bash(template: dict, tmp_path: Path) -> None:
    values = {"Image": "1.dkr.ecr.us-east-1.amazonaws.com/inf2serve:1", "Artifact": "s3://b/llm/3f2a/"}
    values |= {"AWS::Region": "us-east-1", "AWS::StackName": "inf2serve", "Group": "StableGroup"}
    values |= {"LogGroup": "/inf2serve/inf2serve"}
    budget = template["Mappings"]["TimeoutBudget"]["300"]
    values |= {key: str(value) for key, value in budget.items()}
    path = tmp_path / "user-data.sh"
    path.write_text(_render_sub(_user_data(template, "Stable"), values))
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=10)
    rendered = path.read_text()
    assert '"${devices[@]}"' in rendered and "--stop-timeout '335'" in rendered


def test_irsa_role_trusts_one_service_account_and_reads_one_prefix() -> None:
    # Audit D3: no IRSA policy was shipped. IRSA trust: sts:AssumeRoleWithWebIdentity from the cluster's
    # OIDC provider, conditioned on `<issuer>:sub` = system:serviceaccount:<namespace>:<name> and
    # `<issuer>:aud` = sts.amazonaws.com (EKS user guide, "Assign IAM roles to Kubernetes service accounts").
    role = _load(IRSA)["Resources"]["Role"]
    trust = json.loads(
        _render_sub(
            role["Properties"]["AssumeRolePolicyDocument"]["Fn::Sub"],
            {
                "AWS::Partition": "aws",
                "AWS::AccountId": "1",
                "ClusterOidcIssuer": "oidc.x/id/A",
                "Namespace": "n",
            },
        )
    )
    (statement,) = trust["Statement"]
    assert statement["Action"] == "sts:AssumeRoleWithWebIdentity"
    assert statement["Principal"] == {"Federated": "arn:aws:iam::1:oidc-provider/oidc.x/id/A"}
    assert statement["Condition"] == {
        "StringEquals": {
            "oidc.x/id/A:sub": "system:serviceaccount:n:inf2serve",
            "oidc.x/id/A:aud": "sts.amazonaws.com",
        }
    }
    statements = _statements(role)
    assert _granting(statements, "s3:ListBucket")["Condition"] == {
        "StringLike": {"s3:prefix": {"Fn::Sub": "${ArtifactPrefix}*"}}
    }
    _assert_kms_when_given(statements)
