"""`deploy/inf2-smoke.sh`, the first run on Inferentia, as far as it runs without it: its syntax, its help,
and its parity rule between two graphs' bf16 outputs (the same tokens, or a first difference at a near tie
of the reference; logprobs of the agreeing tokens within the bf16 tolerance). Its `--dry-run` (the whole
run on the CPU backend, a few minutes) is run by hand, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "inf2-smoke.sh"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env)


def test_the_script_parses_and_explains_itself() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    shown = run("--help")
    assert shown.returncode == 0
    assert "--dry-run" in shown.stdout and "--compare" in shown.stdout


def output(tokens: list[str], logprobs: list[float], runner_up: str = "x", margin: float = 2.0) -> dict:
    """A completion's `logprobs`: each token's top 2 are itself and `runner_up`, `margin` below."""
    tops = [{token: lp, runner_up: lp - margin} for token, lp in zip(tokens, logprobs, strict=True)]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops}


REFERENCE = output(["a", "b", "c", "d"], [-0.5, -0.6, -0.7, -0.8], runner_up="z", margin=0.3)


@pytest.mark.parametrize(
    ("candidate", "passed", "agreeing"),
    [
        (output(["a", "b", "c", "d"], [-0.5, -0.7, -0.7, -0.8]), True, 4),
        (output(["a", "b", "z", "q"], [-0.5, -0.6, -0.9, -3.0]), True, 2),  # a near tie, then its own way
        (output(["a", "b", "y", "d"], [-0.5, -0.6, -0.9, -0.8]), False, 2),  # y is not in the top: no tie
        (output(["a", "b", "c", "d"], [-0.5, -1.2, -0.7, -0.8]), False, 4),  # a logprob 0.6 off
        (output(["a", "b"], [-0.5, -0.6]), False, 2),  # ended early
    ],
    ids=["same", "near-tie", "other-token", "logprob-off", "shorter"],
)
def test_parity_is_token_agreement_up_to_a_near_tie_and_logprobs_within_tolerance(
    tmp_path: Path, candidate: dict, passed: bool, agreeing: int
) -> None:
    reference, got = tmp_path / "reference.json", tmp_path / "candidate.json"
    reference.write_text(json.dumps([REFERENCE]))
    got.write_text(json.dumps([candidate]))
    compared = run("--compare", str(reference), str(got))
    verdict = json.loads(compared.stdout)
    assert (compared.returncode == 0) is passed and verdict["passed"] is passed
    assert verdict["prompts"][0]["agreeing_tokens"] == agreeing
