"""Every command of deploy/WALKTHROUGH.md (the operator's path from an empty account), checked offline as
far as each tool allows: `aws` commands name an operation botocore's service model has (or a documented
CLI customization), `aws cloudformation deploy` names a template that exists and only its parameters
(the templates themselves pass cfn-lint in test_cloudformation.py), `inf2serve` and our `python -m`
scripts parse with their own parsers, kustomize trees render, Helm charts and remote manifests are pinned
to a version, Dockerfiles exist, and the release check accepts the release named. A command no rule
covers fails the test, so a new command cannot slip in unchecked."""

from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import botocore.session
import pytest
from cfnlint.decode import decode

from app.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
WALKTHROUGH = REPO / "deploy" / "WALKTHROUGH.md"
KUBECTL = Path(sys.executable).parent / "kubectl"
# The AWS CLI's own commands, not API operations (AWS CLI v2 customizations).
CLI_CUSTOMIZATIONS = {("cloudformation", "deploy"), ("ecr", "get-login-password")}
CLI_SERVICES = {"s3api": "s3"}
# Commands of tools this repository cannot run offline, accepted as they are (with why).
ACCEPTED = {
    ("kubectl", "argo"): "the Argo Rollouts kubectl plugin (Rollout behaviour: test_kubernetes.py)",
    ("kubectl", "create"): "a namespace",
    ("eksctl", "utils"): "the cluster's IAM OIDC provider",
    ("docker", "push"): "",
    ("docker", "login"): "",
}


def commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", WALKTHROUGH.read_text(), flags=re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def words(command: str) -> list[str]:
    """The command's words, shell variables and `<placeholders>` replaced by sample values."""
    command = re.sub(r"\$\(.*?\)", "123456789012", command)
    command = re.sub(
        r"\$(\w+)", lambda m: {"REPO": "1.dkr.ecr.us-east-1.amazonaws.com/inf2serve"}.get(m[1], "x"), command
    )
    command = re.sub(r"<[^<>]*>", "placeholder", command)
    return shlex.split(command.split(" | ")[0])


def check_aws(argv: list[str]) -> None:
    service, operation = argv[1], argv[2]
    if (service, operation) in CLI_CUSTOMIZATIONS:
        if operation == "deploy":
            check_stack_deploy(argv)
        return
    model = botocore.session.get_session().get_service_model(CLI_SERVICES.get(service, service))
    name = "".join(part.capitalize() for part in operation.split("-"))
    assert name in model.operation_names, f"aws {service} {operation}: no {name} in {model.service_name}"


def check_stack_deploy(argv: list[str]) -> None:
    template = REPO / argv[argv.index("--template-file") + 1]
    parsed, problems = decode(str(template))
    assert not problems, problems
    overrides = argv[argv.index("--parameter-overrides") + 1 :]
    names = {pair.split("=", 1)[0] for pair in overrides}
    assert names <= set(parsed["Parameters"]), names - set(parsed["Parameters"])
    assert "CAPABILITY_IAM" in argv  # every template creates IAM roles


def check_python_module(argv: list[str]) -> None:
    module = importlib.import_module(argv[2])
    args = module.parser().parse_args(argv[3:])
    if args.dry_run and argv[2] == "deploy.sagemaker.canary_job":  # needs no AWS: run it
        assert module.main(argv[3:]) == 0


def check_kubectl(argv: list[str]) -> None:
    if argv[1] == "kustomize" or argv[1:3] == ["apply", "-k"]:
        tree = REPO / argv[-1]
        subprocess.run([str(KUBECTL), "kustomize", str(tree)], capture_output=True, timeout=60, check=True)
    elif argv[1] == "apply":
        url = argv[argv.index("-f") + 1]
        assert re.search(r"/v\d+\.\d+\.\d+/", url), f"{url} is not pinned to a release"
    else:
        assert tuple(argv[:2]) in ACCEPTED, argv


def check(command: str) -> None:
    argv = words(command)
    program = argv[0]
    if program == "export":
        return
    if program == "aws":
        check_aws(argv)
    elif program == "inf2serve":
        build_parser(argv[1:]).parse_args(argv[1:])
    elif program == "python":
        assert argv[1] == "-m"
        check_python_module(argv)
    elif program == "kubectl":
        check_kubectl(argv)
    elif program == "helm":
        assert argv[1:3] == ["upgrade", "--install"] and "--version" in argv, command
        assert not argv[argv.index("--version") + 1].startswith("placeholder") or "tested" in command
    elif program == "docker" and argv[1] == "build":
        assert (REPO / argv[argv.index("-f") + 1]).is_file()
    elif program == "deploy/neuron/check-release.sh":
        subprocess.run(["sh", str(REPO / program), *argv[1:]], capture_output=True, timeout=30, check=True)
    else:
        assert tuple(argv[:2]) in ACCEPTED, f"no rule checks {command!r}"


def test_the_walkthrough_has_each_platform_from_zero() -> None:
    text = WALKTHROUGH.read_text()
    for heading in (
        "Prerequisites",
        "Compile on an inf2 host",
        "SageMaker",
        "EKS behind a Gateway",
        "EC2 + ALB",
    ):
        assert heading in text
    for step in ("**Quotas.**", "**Image in ECR.**", "**IRSA**", "**Canary", "**Rollback"):
        assert step in text
    assert "WALKTHROUGH.md" in (REPO / "deploy" / "README.md").read_text()
    assert len(commands()) >= 40, "the sh blocks' commands were not found, so none would be checked"


@pytest.mark.parametrize("command", commands())
def test_every_command_is_checked(command: str) -> None:
    check(command)


def test_an_unknown_command_or_parameter_fails() -> None:
    with pytest.raises(AssertionError):
        check("aws sagemaker create-endpoints --endpoint-name x")
    with pytest.raises(AssertionError):
        check(
            "aws cloudformation deploy --template-file deploy/alb/template.yaml --stack-name s "
            "--capabilities CAPABILITY_IAM --parameter-overrides CanaryWieght=0"
        )
    with pytest.raises(AssertionError):
        check("terraform apply")
    with pytest.raises(SystemExit):
        check("inf2serve artifacts promote s3://b/llm/a prod")  # --alias is required


def test_the_smoke_script_needs_a_checkpoint_and_names_none_outside_the_repository() -> None:
    # Audit H11: its default checkpoint was ../shared/models/stories260K, outside any fresh clone.
    script = REPO / "deploy" / "inf2-smoke.sh"
    assert "../shared" not in script.read_text()
    result = subprocess.run(
        ["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0 and "a checkpoint is required" in result.stderr
