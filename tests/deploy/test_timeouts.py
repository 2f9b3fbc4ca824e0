"""The timeout budget (deploy/timeouts.py): its invariants, the table in deploy/README.md, and every number
the templates, manifests and images carry, which must be the budget's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cfnlint.decode import decode

from deploy import timeouts
from tests.deploy.test_dockerfiles import DOCKERFILES, only
from tests.deploy.test_kubernetes import _container, _env, _one, _render

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("generation", timeouts.GENERATION_CHOICES)
def test_budget_orders_every_timeout(generation: int) -> None:
    for budget in (timeouts.alb(generation), timeouts.eks(generation)):
        assert budget.request_timeout_s == budget.shutdown_timeout_s == generation
        assert budget.idle_timeout_s > generation  # a silent, non-streamed generation fits
        assert budget.keep_alive_s > budget.idle_timeout_s  # no reuse of a connection the server closed
        assert budget.deregistration_delay_s > generation
    ec2 = timeouts.alb(generation)
    assert ec2.drain_s > timeouts.ALB_HEALTH_INTERVAL_S * timeouts.ALB_UNHEALTHY_THRESHOLD
    cut = timeouts.SERVER_CUT_GRACE_S + timeouts.MARGIN_S
    # Audit W5 (shared/research/audit-deploy-2026-11-25.md): the server's own cut takes CUT_GRACE_S after
    # the in-flight time; the kill must come after it and a margin, or exit code 3 is replaced by 137.
    assert ec2.stop_timeout_s >= ec2.drain_s + ec2.shutdown_timeout_s + cut
    eks = timeouts.eks(generation)
    assert eks.stop_timeout_s >= eks.prestop_s + eks.drain_s + eks.shutdown_timeout_s + cut
    assert eks.deregistration_delay_s >= eks.stop_timeout_s  # the ALB never cuts what the pod finishes


def test_sagemaker_fits_its_hard_limits() -> None:
    budget = timeouts.sagemaker()
    assert budget.request_timeout_s < timeouts.SAGEMAKER_INVOCATION_LIMIT_S
    # SIGKILL 30 s after SIGTERM (SageMaker "Custom Inference Code with Hosting Services"), after the
    # drain, the in-flight time, the server's cut grace and a margin (audit W5).
    spent = budget.drain_s + budget.shutdown_timeout_s + timeouts.SERVER_CUT_GRACE_S + timeouts.MARGIN_S
    assert spent <= timeouts.SAGEMAKER_SIGKILL_AFTER_S == 30
    assert budget.client_timeout_s > timeouts.SAGEMAKER_INVOCATION_LIMIT_S


def test_the_cut_grace_is_the_servers() -> None:
    from app.api.server import CUT_GRACE_S

    assert timeouts.SERVER_CUT_GRACE_S == CUT_GRACE_S


@pytest.mark.parametrize("document", ["README.md", "RUNBOOK.md"])
def test_documents_show_the_budget_table(document: str) -> None:
    assert timeouts.markdown_table() in (REPO / "deploy" / document).read_text()


def test_eks_manifests_carry_the_budget() -> None:
    docs = _render("base")
    budget = timeouts.eks()
    env = _env(docs)
    assert float(env["INF2SERVE_REQUEST_TIMEOUT_S"]) == budget.request_timeout_s
    assert float(env["INF2SERVE_DRAIN_S"]) == budget.drain_s
    assert float(env["INF2SERVE_SHUTDOWN_TIMEOUT_S"]) == budget.shutdown_timeout_s
    assert float(env["INF2SERVE_KEEP_ALIVE_S"]) == budget.keep_alive_s
    container = _container(docs)
    pod = _one(docs, "Rollout")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == budget.stop_timeout_s
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == budget.prestop_s
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == budget.startup_s
    readiness = container["readinessProbe"]
    assert readiness["periodSeconds"] * readiness["failureThreshold"] == budget.drain_s
    annotations = _one(docs, "Ingress")["metadata"]["annotations"]
    assert (
        f"idle_timeout.timeout_seconds={budget.idle_timeout_s}"
        in annotations["alb.ingress.kubernetes.io/load-balancer-attributes"]
    )
    assert (
        f"deregistration_delay.timeout_seconds={budget.deregistration_delay_s},"
        in annotations["alb.ingress.kubernetes.io/target-group-attributes"]
    )


def test_sagemaker_template_startup_is_the_budgets() -> None:
    template, problems = decode(str(REPO / "deploy/sagemaker/template.yaml"))
    assert not problems
    startup = template["Parameters"]["StartupHealthCheckTimeoutSeconds"]["Default"]
    assert startup == timeouts.sagemaker().startup_s


@pytest.mark.parametrize("image", DOCKERFILES)
def test_healthcheck_start_period_covers_the_longest_startup(image: str) -> None:
    start_period = re.search(r"--start-period=(\d+)s", only(DOCKERFILES[image], "HEALTHCHECK"))
    assert start_period is not None and int(start_period[1]) >= timeouts.DEFAULT_STARTUP_S
