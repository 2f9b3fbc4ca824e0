"""Both Neuron adapters end to end against their STAND-IN libraries (real logits from the portable model,
fp32, tp=2 presharded): greedy output equal to the reference, and continuous batching (sequences joining
and leaving, slots reused) giving each sequence exactly the tokens it gets alone."""

from __future__ import annotations

from app.backends.base import Backend

from .helpers import PROMPTS, greedy, run_interleaved

# stories260K, "Once upon a time" (ids 1 403 407 261 378): transformers' and llama2.c's greedy ids
# (../shared/models/stories260K/README.md).
ONCE_UPON_A_TIME = (1, 403, 407, 261, 378)
REFERENCE = (
    432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292,
    411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426,
    338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415, 426, 13, 438, 310,
)  # fmt: skip


def test_greedy_tokens_equal_the_reference(neuron_backend: Backend) -> None:
    assert tuple(greedy(neuron_backend, 2, ONCE_UPON_A_TIME, len(REFERENCE))) == REFERENCE


def test_continuous_batching_matches_each_sequence_alone(neuron_backend: Backend) -> None:
    alone = {i: greedy(neuron_backend, 0, prompt, 10) for i, prompt in enumerate(PROMPTS)}
    assert run_interleaved(neuron_backend, 10) == alone
