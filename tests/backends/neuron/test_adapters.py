"""Both Neuron adapters end to end against their STAND-IN libraries (real logits from the portable model,
fp32, tp=2 presharded): greedy output equal to the reference, and continuous batching (sequences joining
and leaving, slots reused) giving each sequence exactly the tokens it gets alone."""

from __future__ import annotations

from app.backends.base import Backend

from .helpers import (
    PROMPTS,
    assert_same_outputs,
    decode_batch,
    greedy,
    greedy_sampled,
    library_calls,
    prefill,
    run_interleaved,
    settled,
)

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
    alone = {i: greedy_sampled(neuron_backend, 0, prompt, 10) for i, prompt in enumerate(PROMPTS)}
    together = run_interleaved(neuron_backend, 10)
    for index, outputs in alone.items():
        assert_same_outputs(together[index], outputs, tolerance=1e-4)


def test_a_slot_prefilled_this_step_is_parked_at_its_prompt_length(neuron_backend: Backend) -> None:
    """The engine's step: prefill a new sequence, then decode the running ones without it. The new
    slot's padded row must write where the sequence writes first (its prompt length), not inside it."""
    backend = settled(neuron_backend)
    running = prefill(backend, 0, PROMPTS[0])
    fresh_prompt = PROMPTS[2]
    prefill(backend, 2, fresh_prompt)
    backend.decode(decode_batch([0], [running], [len(PROMPTS[0])]))
    call = library_calls(backend)[-1]
    positions = call.get("position_ids", call.get("cache_ids"))[:, 0].tolist()
    assert positions == [len(PROMPTS[0]), len(PROMPTS[0]), len(fresh_prompt), len(PROMPTS[0])]
