"""Shift traffic to the ALB template's canary track in steps that advance only on a canary pass.

For a stack of deploy/alb/template.yaml whose canary track is up (`CanaryCapacity` >= 1, `CanaryWeight` 0):
for each step, set `CanaryWeight` (a stack update: CloudFormation stays the owner, and with the AMI pinned
and the listener no longer waiting on the groups it changes the listener only), let the new share of
production run for `--soak` seconds, then run `inf2serve canary` through the balancer, every prompt to
both tracks at once (`alb:<dns>#stable` and `#canary`, the listener's track rules). The first step is the
equal share: the canary's instances get as much production traffic each as the stable ones
(`StableWeight x CanaryCapacity / StableCapacity`), so the verdict compares equal loads. A pass advances
to the next step; anything else (exit 1 roll back, 2 cannot judge) sets the canary's weight to 0 at once
with ModifyListener (the emergency lever: no stack update to wait for), then makes the stack agree, and
exits with the canary's code. After the last step it prints how to promote (point the stable track at the
canary's image and artifact).

    python -m deploy.alb.release --stack inf2serve [--steps equal,50] [--soak 300] [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

EQUAL = "equal"


@dataclass(frozen=True, slots=True)
class Stack:
    name: str
    parameters: dict[str, str]
    outputs: dict[str, str]

    def artifact(self, track: str) -> str:
        prefix = f"s3://{self.parameters['ArtifactBucket']}/{self.parameters[f'{track}ArtifactPrefix']}"
        digest = self.parameters.get(f"{track}ArtifactDigest", "")
        return f"{prefix}@{digest}" if digest else prefix

    def equal_share(self) -> int:
        """The canary weight at which each canary instance gets what each stable instance gets."""
        stable, canary = int(self.parameters["StableCapacity"]), int(self.parameters["CanaryCapacity"])
        if canary < 1 or stable < 1:
            raise SystemExit("release: both tracks need instances (StableCapacity and CanaryCapacity >= 1)")
        return max(1, round(int(self.parameters["StableWeight"]) * canary / stable))


def describe(cloudformation: Any, name: str) -> Stack:
    (stack,) = cloudformation.describe_stacks(StackName=name)["Stacks"]
    parameters = {p["ParameterKey"]: p.get("ParameterValue", "") for p in stack.get("Parameters", [])}
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    return Stack(name, parameters, outputs)


def weights(stack: Stack, steps: Sequence[str]) -> list[int]:
    return [stack.equal_share() if step == EQUAL else int(step) for step in steps]


def canary_argv(stack: Stack, extra: Sequence[str]) -> list[str]:
    balancer = f"http://{stack.outputs['LoadBalancerDns']}"
    return [
        "canary",
        "--baseline",
        f"alb:{balancer}#stable",
        "--candidate",
        f"alb:{balancer}#canary",
        "--baseline-artifact",
        stack.artifact("Stable"),
        "--candidate-artifact",
        stack.artifact("Canary"),
        *extra,
    ]


def set_weight(cloudformation: Any, stack: Stack, weight: int) -> None:
    """A stack update that changes CanaryWeight only, waited for."""
    parameters = [
        {"ParameterKey": key, "ParameterValue": str(weight)}
        if key == "CanaryWeight"
        else {"ParameterKey": key, "UsePreviousValue": True}
        for key in stack.parameters
    ]
    cloudformation.update_stack(
        StackName=stack.name,
        UsePreviousTemplate=True,
        Parameters=parameters,
        Capabilities=["CAPABILITY_IAM"],
    )
    cloudformation.get_waiter("stack_update_complete").wait(StackName=stack.name)


def cut_canary(elbv2: Any, stack: Stack) -> None:
    """The emergency lever: the listener forwards everything to the stable track, now."""
    action = {
        "Type": "forward",
        "ForwardConfig": {
            "TargetGroups": [
                {"TargetGroupArn": stack.outputs["StableTargetGroupArn"], "Weight": 1},
                {"TargetGroupArn": stack.outputs["CanaryTargetGroupArn"], "Weight": 0},
            ]
        },
    }
    elbv2.modify_listener(ListenerArn=stack.outputs["ListenerArn"], DefaultActions=[action])


def release(
    stack: Stack,
    steps: Sequence[int],
    judge: Callable[[], int],
    cloudformation: Any,
    elbv2: Any,
    soak_s: float,
) -> int:
    for weight in steps:
        print(f"release: CanaryWeight {weight}, soaking {soak_s:.0f} s, then the canary")
        set_weight(cloudformation, stack, weight)
        time.sleep(soak_s)
        code = judge()
        if code != 0:
            print(f"release: canary exit {code} at weight {weight}: canary weight 0 now", file=sys.stderr)
            cut_canary(elbv2, stack)
            set_weight(cloudformation, stack, 0)
            return code
    print(
        "release: every step passed. Promote: set StableImageUri/StableArtifactPrefix/StableArtifactDigest "
        "to the canary's, then CanaryWeight 0 and CanaryCapacity 0."
    )
    return 0


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(
        prog="python -m deploy.alb.release",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    out.add_argument("--stack", required=True, help="the deploy/alb/template.yaml stack")
    out.add_argument(
        "--steps",
        default=f"{EQUAL},50",
        help="canary weights in order ('equal': the equal per-instance share)",
    )
    out.add_argument("--soak", type=float, default=300.0, help="seconds at each weight before judging")
    out.add_argument("--region", help="AWS Region (default: the environment's)")
    out.add_argument("--dry-run", action="store_true", help="print the steps and the canary command")
    out.add_argument("extra", nargs="*", help="after --: more `inf2serve canary` flags")
    return out


def main(argv: Sequence[str] | None = None, clients: tuple[Any, Any] | None = None) -> int:
    args = parser().parse_args(argv)
    if clients is None:
        import boto3

        clients = (
            boto3.client("cloudformation", region_name=args.region),
            boto3.client("elbv2", region_name=args.region),
        )
    cloudformation, elbv2 = clients
    stack = describe(cloudformation, args.stack)
    steps = weights(stack, args.steps.split(","))
    argv_canary = canary_argv(stack, args.extra)
    if args.dry_run:
        for weight in steps:
            print(f"CanaryWeight {weight}; soak {args.soak:.0f} s; inf2serve {' '.join(argv_canary)}")
        print("on any exit but 0: ModifyListener canary weight 0, then CanaryWeight 0")
        return 0

    def judge() -> int:
        from app.cli import main as inf2serve

        return inf2serve(argv_canary)

    return release(stack, steps, judge, cloudformation, elbv2, args.soak)


if __name__ == "__main__":
    sys.exit(main())
