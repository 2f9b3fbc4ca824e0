"""The one timeout budget every deployment file derives its numbers from.

Everything starts from two figures an operator chooses: the longest generation a request may take
(`max_generation_s`, the server's request deadline) and the longest allowed startup (`startup_s`). Each
platform then adds its own fixed facts (health-check detection, SageMaker's 60 s invocation limit and its
SIGKILL 30 s after SIGTERM) and a safety margin. `budget()` computes the whole table; deploy/README.md
shows it (`markdown_table()` renders it, and a test keeps the two equal), the ALB template carries it as
a `Mappings` table keyed by `max_generation_s`, and the EKS manifests and the SageMaker template carry the
default's values. Why each line is what it is, in order of a request's end of life:

- EC2 behind an ALB: the Auto Scaling group deregisters the instance first; the balancer lets in-flight
  requests finish for the deregistration delay, and only then is the instance terminated and the
  container sent SIGTERM. So the deregistration delay must cover the longest generation, not the drain.
- EKS: endpoint removal and SIGTERM run in parallel; the preStop sleep holds SIGTERM back while the
  removal reaches the ALB, and `terminationGracePeriodSeconds` counts preStop + drain + in-flight.
- SageMaker: a non-streamed InvokeEndpoint is cut at 60 s, whatever the client's timeout, and SIGKILL
  follows SIGTERM by 30 s: the server's deadline stays under the first, drain + in-flight + the server's
  cut grace + margin under the second. Streams (InvokeEndpointWithResponseStream) have their own deadline,
  `INF2SERVE_STREAM_TIMEOUT_S`: AWS documents no figure for them (the API reference's ModelStreamError
  says only "within the timeout period allowed by Amazon SageMaker AI"), so they get the longest
  generation G every other platform allows.
- Everywhere: when in-flight time runs out the server cuts what is left and needs up to `CUT_GRACE_S`
  more to write the 503s and error events and exit with code 3 (app/api/server.py); the kill comes only
  after that plus the margin, so the exit code and the "responses cut short" line are seen, not SIGKILL.
- Everywhere a balancer keeps idle connections open: a non-streamed generation sends no byte until it is
  done, so the idle timeout must exceed the longest generation, and the server's keep-alive must exceed
  the idle timeout (or the balancer reuses a connection the server closed: 502).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MARGIN_S = 5
DEFAULT_MAX_GENERATION_S = 300
DEFAULT_STARTUP_S = 1800
# The choices the ALB template offers (its Mappings hold one column per value).
GENERATION_CHOICES = (120, 300, 600, 900)
ALB_HEALTH_INTERVAL_S = 10
ALB_UNHEALTHY_THRESHOLD = 2
K8S_READINESS_PERIOD_S = 5
K8S_READINESS_FAILURES = 2
K8S_PRESTOP_S = 15  # endpoint removal reaching the AWS Load Balancer Controller and the ALB
SAGEMAKER_INVOCATION_LIMIT_S = 60
SAGEMAKER_SIGKILL_AFTER_S = 30
SAGEMAKER_DRAIN_S = 10
# app/api/server.py CUT_GRACE_S: after the in-flight time, the server's own cut and exit (a test keeps
# the two equal; not imported, so the canary CLI does not load the web server).
SERVER_CUT_GRACE_S = 5


@dataclass(frozen=True, slots=True)
class Budget:
    """Every timeout of one platform, in seconds (0 where the platform has no such thing)."""

    request_timeout_s: int  # INF2SERVE_REQUEST_TIMEOUT_S: the server's deadline of one request
    stream_timeout_s: int  # INF2SERVE_STREAM_TIMEOUT_S: the deadline of one streamed request
    drain_s: int  # INF2SERVE_DRAIN_S: not ready, still serving, after SIGTERM
    shutdown_timeout_s: int  # INF2SERVE_SHUTDOWN_TIMEOUT_S: in-flight requests after the drain
    keep_alive_s: int  # INF2SERVE_KEEP_ALIVE_S
    idle_timeout_s: int  # ALB idle_timeout.timeout_seconds
    deregistration_delay_s: int  # target group deregistration_delay.timeout_seconds
    stop_timeout_s: int  # docker --stop-timeout (EC2) / terminationGracePeriodSeconds (EKS) / SIGKILL
    prestop_s: int  # EKS preStop sleep
    startup_s: int  # HEALTHCHECK start period, ASG grace, startupProbe window, SageMaker startup timeout
    client_timeout_s: int  # read timeout a client (the canary) should use


def _behind_alb(
    generation: int, startup: int, drain: int, prestop: int, deregistration: int, stop: int
) -> Budget:
    """What every platform behind an ALB shares: the deadline, in-flight time, idle timeout and
    keep-alive all follow the longest generation."""
    idle = generation + MARGIN_S
    return Budget(
        request_timeout_s=generation,
        stream_timeout_s=generation,
        drain_s=drain,
        shutdown_timeout_s=generation,
        keep_alive_s=idle + MARGIN_S,
        idle_timeout_s=idle,
        deregistration_delay_s=deregistration,
        stop_timeout_s=stop,
        prestop_s=prestop,
        startup_s=startup,
        client_timeout_s=idle + MARGIN_S,
    )


def alb(max_generation_s: int = DEFAULT_MAX_GENERATION_S, startup_s: int = DEFAULT_STARTUP_S) -> Budget:
    """EC2: deregistered first, SIGTERM after the delay; the drain covers health-check detection."""
    drain = ALB_HEALTH_INTERVAL_S * ALB_UNHEALTHY_THRESHOLD + MARGIN_S
    deregistration = max_generation_s + MARGIN_S
    stop = drain + max_generation_s + SERVER_CUT_GRACE_S + MARGIN_S
    return _behind_alb(max_generation_s, startup_s, drain, 0, deregistration, stop)


def eks(max_generation_s: int = DEFAULT_MAX_GENERATION_S, startup_s: int = DEFAULT_STARTUP_S) -> Budget:
    """EKS: preStop, then the drain (readiness noticing), then in-flight, all inside the grace period,
    which the ALB's deregistration delay equals."""
    drain = K8S_READINESS_PERIOD_S * K8S_READINESS_FAILURES
    grace = K8S_PRESTOP_S + drain + max_generation_s + SERVER_CUT_GRACE_S + MARGIN_S
    return _behind_alb(max_generation_s, startup_s, drain, K8S_PRESTOP_S, grace, grace)


def sagemaker(startup_s: int = DEFAULT_STARTUP_S) -> Budget:
    """SageMaker's limits decide: the deadline answers before the 60 s cut (a clear 504 rather than a
    ModelError), and drain + in-flight + the server's cut end before the SIGKILL. Streams send bytes all
    along and get the longest generation G instead (SageMaker documents no limit for them)."""
    request = SAGEMAKER_INVOCATION_LIMIT_S - MARGIN_S
    return Budget(
        request_timeout_s=request,
        stream_timeout_s=DEFAULT_MAX_GENERATION_S,
        drain_s=SAGEMAKER_DRAIN_S,
        shutdown_timeout_s=SAGEMAKER_SIGKILL_AFTER_S - SAGEMAKER_DRAIN_S - SERVER_CUT_GRACE_S - MARGIN_S,
        keep_alive_s=SAGEMAKER_INVOCATION_LIMIT_S + MARGIN_S,
        idle_timeout_s=0,
        deregistration_delay_s=0,
        stop_timeout_s=SAGEMAKER_SIGKILL_AFTER_S,
        prestop_s=0,
        startup_s=startup_s,
        client_timeout_s=SAGEMAKER_INVOCATION_LIMIT_S + 10,  # AWS: a 70 s socket timeout for 60 s models
    )


def budget() -> dict[str, Budget]:
    return {"EC2 + ALB": alb(), "EKS": eks(), "SageMaker": sagemaker()}


ROWS = {
    "request_timeout_s": ("request deadline `INF2SERVE_REQUEST_TIMEOUT_S`", "G (SageMaker: 60 - m)"),
    "stream_timeout_s": ("stream deadline `INF2SERVE_STREAM_TIMEOUT_S`", "G (SageMaker: none documented)"),
    "drain_s": ("drain `INF2SERVE_DRAIN_S`", "health-check detection + m (EKS: readiness 5 s x 2)"),
    "shutdown_timeout_s": (
        "in-flight `INF2SERVE_SHUTDOWN_TIMEOUT_S`",
        "G (SageMaker: 30 - drain - cut grace c - m)",
    ),
    "keep_alive_s": ("keep-alive `INF2SERVE_KEEP_ALIVE_S`", "idle timeout + m"),
    "idle_timeout_s": ("ALB idle timeout", "G + m"),
    "deregistration_delay_s": ("deregistration delay", "EC2: G + m; EKS: grace period"),
    "stop_timeout_s": (
        "kill after SIGTERM",
        "EC2 `--stop-timeout`: drain + G + c + m; EKS grace: preStop + drain + G + c + m",
    ),
    "prestop_s": ("preStop sleep", "EKS endpoint propagation"),
    "startup_s": ("startup window", "S: HEALTHCHECK start period, ASG grace, startupProbe"),
    "client_timeout_s": ("client read timeout (canary)", "keep-alive (SageMaker: 70, AWS's advice)"),
}


def markdown_table() -> str:
    """The budget as deploy/README.md shows it (G = 300 s, S = 1800 s, m = 5 s, c = 5 s)."""
    columns = budget()
    lines = [
        "| Timeout | Rule | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for field, (name, rule) in ROWS.items():
        values = [asdict(b)[field] for b in columns.values()]
        cells = " | ".join(str(v) if v else "—" for v in values)
        lines.append(f"| {name} | {rule} | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
