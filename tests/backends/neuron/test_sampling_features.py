"""What the Neuron backends refuse at admission (`Backend.check_sampling`): prompt logprobs (their
context-encoding graph returns only the last position's logits: research/neuron-signatures.md, "Facts
for the 0.8 / Inf2 path" (c)) and top-k past the device sampler's candidates. What the device sampler
lacks (min_p, penalties, min_tokens, masks) is drawn on the host in step (`test_host_rows.py`)."""

from __future__ import annotations

import pytest

from app.backends.base import Backend, SamplingParams
from app.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(prompt_logprobs=0), "prompt_logprobs"),
        (SamplingParams(top_k=2**40), "top_k"),
    ],
)
def test_what_the_device_cannot_do_is_refused_naming_it(
    neuron_backend: Backend, params: SamplingParams, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        neuron_backend.check_sampling(params)
    assert refused.value.param == param
    neuron_backend.check_sampling(SamplingParams(temperature=0.5, top_k=5, top_p=0.9))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.0, typical_p=0.9),
        SamplingParams(repetition_penalty=1.1),
        SamplingParams(min_tokens=3),
        SamplingParams(logit_bias=((5, 2.0),)),
    ],
)
def test_what_the_host_draws_is_accepted_in_step(neuron_backend: Backend, params: SamplingParams) -> None:
    neuron_backend.check_sampling(params)
