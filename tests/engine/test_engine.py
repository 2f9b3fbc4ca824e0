"""The engine end to end on a zero-cost sim device: outputs, stop rules, admission, cancellation, deadlines,
failing steps. The sim checks every call (distinct slots, each decode continuing its slot's sequence), so
a slot used twice fails the step that uses it."""

from __future__ import annotations

import asyncio
import pickle
import random
import threading
import time
from collections.abc import AsyncIterator
from functools import partial

import pytest

from app import metrics
from app.backends.base import BackendSpec, DecodeBatch, PrefillBatch, SampledToken, SamplingParams, Tokens
from app.backends.sim import CostModel, SimBackend
from app.engine.clock import VirtualClock
from app.engine.engine import LLMEngine
from app.engine.policies import POLICIES
from app.engine.stats import StepStats
from app.engine.types import FinishReason, GenerationParams, RequestOutput
from app.errors import (
    ContextLengthError,
    DeadlineExceededError,
    GenerationError,
    InvalidRequestError,
    NotReadyError,
    OverloadedError,
)
from app.tokenizer import Tokenizer
from tests.engine.helpers import (
    EOS_IDS,
    TIMEOUT_S,
    TINY_GRID,
    collect,
    drain,
    expected_tokens,
    make_backend,
    params,
    run,
    running_engine,
)

RUN_AHEAD = pytest.mark.parametrize("run_ahead", [True, False], ids=["ahead", "in-step"])


def joined(outputs: list[RequestOutput]) -> tuple[list[int], str]:
    return [t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs)


def check_stream(outputs: list[RequestOutput]) -> None:
    """In order, exactly once, one final delta at the end."""
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    counts = [o.num_generated_tokens for o in outputs]
    assert counts == sorted(counts)
    assert sum(len(o.token_ids) for o in outputs) == counts[-1]
    assert all(len(o.samples) == len(o.token_ids) for o in outputs)


def check_idle(engine: LLMEngine) -> None:
    """Nothing leaked: every slot free, nothing queued, every request's final delta out."""
    deadline = time.monotonic() + 10
    while (engine.num_unfinished or engine.num_running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (engine.num_running, engine.num_waiting, engine.num_unfinished) == (0, 0, 0)
    assert engine.core.scheduler.num_free_slots == engine.grid.num_slots
    assert engine.is_alive


@RUN_AHEAD
def test_tokens_arrive_in_order_whatever_shares_the_batch(tokenizer: Tokenizer, run_ahead: bool) -> None:
    backend = make_backend()
    prompts = [tokenizer.encode(t) for t in ("Once upon a time", "The cat", "Lily and Ben went", "A")]

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(
            *(collect(engine, f"r{i}", p, params(20 + i, seed=i)) for i, p in enumerate(prompts))
        )

    with running_engine(tokenizer, backend, run_ahead=run_ahead) as engine:
        results = run(main())
        check_idle(engine)
    for i, (prompt, outputs) in enumerate(zip(prompts, results, strict=True)):
        check_stream(outputs)
        token_ids, text = joined(outputs)
        assert token_ids == expected_tokens(backend, prompt, seed=i, count=20 + i)
        assert text == tokenizer.decode(prompt + token_ids)[len(tokenizer.decode(prompt)) :]
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        timings = outputs[-1].timings
        assert timings.total_s is not None and timings.time_to_first_token_s is not None
        assert 0 <= timings.queue_s <= timings.time_to_first_token_s <= timings.total_s  # type: ignore[operator]


@RUN_AHEAD
def test_eos_stops_with_the_token_counted_but_not_shown(tokenizer: Tokenizer, run_ahead: bool) -> None:
    backend = make_backend(eos_probability=0.2)
    prompt = tokenizer.encode("Once upon a time")
    with running_engine(tokenizer, backend, run_ahead=run_ahead) as engine:
        stopped = run(collect(engine, "eos", prompt, params(60, seed=3)))
        ignored = run(collect(engine, "ignore", prompt, params(60, seed=3, ignore_eos=True)))
    token_ids, text = joined(stopped)
    assert stopped[-1].finish_reason is FinishReason.STOP and token_ids[-1] in EOS_IDS
    assert not set(token_ids[:-1]) & set(EOS_IDS)
    assert text == tokenizer.decode(prompt + token_ids[:-1])[len(tokenizer.decode(prompt)) :]
    all_ids, _ = joined(ignored)
    assert ignored[-1].finish_reason is FinishReason.LENGTH and len(all_ids) == 60
    assert all_ids[: len(token_ids)] == token_ids  # the same tokens, run past EOS


def test_a_stop_token_id_stops_and_is_not_shown(tokenizer: Tokenizer) -> None:
    backend = make_backend()
    prompt = tokenizer.encode("The dog")
    reference = expected_tokens(backend, prompt, seed=5, count=12)
    stop_id = reference[6]
    with running_engine(tokenizer, backend) as engine:
        outputs = run(collect(engine, "r", prompt, params(12, seed=5, stop_token_ids=(stop_id,))))
    token_ids, text = joined(outputs)
    cut = reference.index(stop_id)
    assert token_ids == reference[: cut + 1] and outputs[-1].finish_reason is FinishReason.STOP
    assert text == tokenizer.decode(prompt + reference[:cut])[len(tokenizer.decode(prompt)) :]


def test_a_stop_string_across_tokens_is_cut_out_of_the_stream(tokenizer: Tokenizer) -> None:
    backend = make_backend()
    prompt = tokenizer.encode("Once upon a time")
    with running_engine(tokenizer, backend) as engine:
        free_text = joined(run(collect(engine, "free", prompt, params(40, seed=9))))[1]
        pieces = [tokenizer.decode(prompt + expected_tokens(backend, prompt, 9, n)) for n in range(1, 41)]
        boundary = next(len(p) for p in pieces if len(p) > len(tokenizer.decode(prompt)) + 8)
        offset = boundary - len(tokenizer.decode(prompt))  # a token boundary inside the generated text
        stop = free_text[offset - 3 : offset + 3]
        outputs = run(collect(engine, "cut", prompt, params(40, seed=9, stop_strings=(stop,))))
        check_idle(engine)
    check_stream(outputs)
    text = joined(outputs)[1]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert text == free_text[: free_text.index(stop)]
    assert all(stop not in o.text for o in outputs)


def test_admission_refuses_what_cannot_fit_naming_the_numbers(tokenizer: Tokenizer) -> None:
    async def main(engine: LLMEngine) -> None:
        with pytest.raises(
            ContextLengthError,
            match=r"length is 128 tokens.*requested 140 tokens \(60 in the prompt, 80 for max_tokens",
        ):
            engine.generate("long", [5] * 60, params(80))
        with pytest.raises(ContextLengthError, match=r"70 tokens.*largest compiled context bucket \(64\)"):
            engine.generate("prompt", [5] * 70, params(4))
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            engine.generate("vocab", [5, 9999], params(4))
        with pytest.raises(InvalidRequestError, match="no tokens"):
            engine.generate("empty", [], params(4))

    with running_engine(tokenizer) as engine:
        run(main(engine))
        check_idle(engine)


def test_a_full_queue_refuses_with_a_retry_estimate(tokenizer: Tokenizer) -> None:
    """One slot, held by a long request: the next two wait, the third is refused."""
    grid = type(TINY_GRID)(1, 128, (16, 32, 64), (32, 64, 128), (1,))

    async def main(engine: LLMEngine) -> None:
        holder = engine.generate("holder", [5, 6], params(120))
        await holder.__anext__()  # it holds the slot now, for at least 120 steps of 5 ms
        queued = [engine.generate(f"q{i}", [5, 6], params(4, seed=i)) for i in range(2)]
        with pytest.raises(OverloadedError, match="max_waiting=2") as refused:
            engine.generate("one-too-many", [5, 6], params(4))
        assert refused.value.retry_after_s > 0
        for stream in (holder, *queued):
            await stream.aclose()

    with running_engine(tokenizer, make_backend(grid, cost_model=CostModel(0.005)), max_waiting=2) as engine:
        run(main(engine))
        check_idle(engine)


def test_not_ready_before_start_and_after_stop(tokenizer: Tokenizer) -> None:
    engine = LLMEngine(make_backend(), tokenizer)

    async def attempt() -> None:
        engine.generate("r", [5], params(2))

    with pytest.raises(NotReadyError):
        run(attempt())
    engine.start()
    run(collect(engine, "ok", [5], params(2)))
    engine.stop()
    assert not engine.is_alive
    with pytest.raises(NotReadyError):
        run(attempt())


def test_overload_is_served_first_come_first_served(tokenizer: Tokenizer) -> None:
    """One slot, eight requests queued at once: first tokens come in arrival order, nobody starves."""
    grid = type(TINY_GRID)(1, 128, (16, 32, 64), (32, 64, 128), (1,))
    order: list[int] = []

    async def client(index: int, stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
        outputs = [await anext(stream)]
        order.append(index)
        return outputs + await drain(stream)

    async def main(engine: LLMEngine) -> list[list[RequestOutput]]:
        streams = [engine.generate(f"r{i}", [5 + i] * (1 + 7 * (i % 3)), params(5, seed=i)) for i in range(8)]
        return await asyncio.gather(*(client(i, s) for i, s in enumerate(streams)))

    with running_engine(tokenizer, make_backend(grid)) as engine:
        results = run(main(engine))
        check_idle(engine)
    assert order == list(range(8))
    assert all(r[-1].finish_reason is FinishReason.LENGTH for r in results)


@RUN_AHEAD
@pytest.mark.parametrize("policy", POLICIES)
def test_cancellation_storm_leaves_no_slot_behind(tokenizer: Tokenizer, run_ahead: bool, policy: str) -> None:
    rng = random.Random(11)

    async def client(engine: LLMEngine, index: int) -> tuple[str, list[RequestOutput]]:
        stream = engine.generate(
            f"r{index}", [5 + index % 50] * rng.randint(1, 60), params(rng.randint(1, 60), index)
        )
        outputs, give_up = [], rng.choice([0, 1, 3, None])
        async for out in stream:
            outputs.append(out)
            if give_up is not None and len(outputs) > give_up:
                await stream.aclose()
                return "closed", outputs
        return "finished", outputs

    async def main(engine: LLMEngine) -> list[tuple[str, list[RequestOutput]]]:
        tasks = []
        for index in range(120):
            tasks.append(asyncio.create_task(client(engine, index)))
            if index % 7 == 0:
                engine.abort(f"r{rng.randrange(index + 1)}")  # server-side aborts too, some already finished
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks)

    config = {"max_waiting": 200, "max_prefills_per_step": 2, "run_ahead": run_ahead, "policy": policy}
    with running_engine(tokenizer, **config) as engine:
        results = run(main(engine))
        check_idle(engine)
    for how, outputs in results:
        if how == "finished":
            check_stream(outputs)
            assert outputs[-1].finish_reason in (FinishReason.LENGTH, FinishReason.ABORT)
    assert any(o[-1].finish_reason is FinishReason.ABORT for how, o in results if how == "finished")


@RUN_AHEAD
def test_deadlines_fail_requests_and_free_their_slots(tokenizer: Tokenizer, run_ahead: bool) -> None:
    async def main(engine: LLMEngine) -> list[list[RequestOutput]]:
        soon = time.monotonic() + 0.05
        coros = [collect(engine, f"d{i}", [5, 6], params(120, seed=i, deadline=soon)) for i in range(6)]
        return await asyncio.gather(*coros, collect(engine, "free", [7], params(3)))

    slow = make_backend(cost_model=CostModel(0.002))
    with running_engine(tokenizer, slow, run_ahead=run_ahead) as engine:
        *doomed, free = run(main(engine))
        check_idle(engine)
    for outputs in doomed:
        check_stream(outputs)
        assert outputs[-1].finish_reason is FinishReason.ERROR
        assert isinstance(outputs[-1].error, DeadlineExceededError)
    assert free[-1].finish_reason is FinishReason.LENGTH


class FlakySim(SimBackend):
    """Every prefill of context bucket 32 fails on the device (while the engine waits for its tokens,
    possibly after it launched the next step); the decode calls it is told to are refused at launch."""

    decode_failures = 0

    def launch(self, batch: PrefillBatch | DecodeBatch) -> Tokens:
        if isinstance(batch, DecodeBatch) and self.decode_failures:
            self.decode_failures -= 1
            raise RuntimeError("decode exploded")
        tokens = super().launch(batch)
        if isinstance(batch, PrefillBatch) and batch.context_bucket == 32:
            return partial(_explode, tokens)
        return tokens


def _explode(tokens: Tokens) -> list[SampledToken]:
    tokens()
    raise RuntimeError("prefill exploded")


@RUN_AHEAD
def test_a_failing_prefill_fails_only_its_requests(tokenizer: Tokenizer, run_ahead: bool) -> None:
    async def main(engine: LLMEngine) -> list[list[RequestOutput]]:
        prompts = [[5] * 20, [6] * 3, [7] * 3, [8] * 3]  # one step: bucket 32 (fails), then bucket 16
        return await asyncio.gather(
            *(collect(engine, f"r{i}", p, params(6, i)) for i, p in enumerate(prompts))
        )

    with running_engine(
        tokenizer, make_backend(cls=FlakySim), max_prefills_per_step=4, run_ahead=run_ahead
    ) as engine:
        results = run(main(engine))
        check_idle(engine)
    error = results[0][-1].error
    assert results[0][-1].finish_reason is FinishReason.ERROR
    assert isinstance(error, GenerationError) and "prefill exploded" in error.message
    assert [r[-1].finish_reason for r in results[1:]] == [FinishReason.LENGTH] * 3


@RUN_AHEAD
def test_the_engine_serves_on_after_a_failing_decode(tokenizer: Tokenizer, run_ahead: bool) -> None:
    backend = make_backend(cls=FlakySim)
    backend.decode_failures = 1

    async def main(engine: LLMEngine) -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(engine, f"r{i}", [5, i + 6], params(6, i)) for i in range(3)))

    with running_engine(tokenizer, backend, max_prefills_per_step=4, run_ahead=run_ahead) as engine:
        failed = run(main(engine))
        served = run(collect(engine, "after", [9, 9], params(4)))
        check_idle(engine)
    for i, outputs in enumerate(failed):  # each row run again alone (running ahead too: issue 28 item 6)
        check_stream(outputs)  # the device failed once, so every row now succeeds
        assert joined(outputs)[0] == expected_tokens(backend, [5, i + 6], i, 6)
    assert served[-1].finish_reason is FinishReason.LENGTH and served[-1].num_generated_tokens == 4


def test_stop_cancels_what_is_unfinished(tokenizer: Tokenizer) -> None:
    async def main(engine: LLMEngine) -> list[RequestOutput]:
        stream = engine.generate("long", [5], params(120))
        first = await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        return [first, *[o async for o in stream]]

    slow = make_backend(cost_model=CostModel(0.002))
    engine = LLMEngine(slow, tokenizer)
    engine.start()
    outputs = run(main(engine))
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.ABORT
    assert isinstance(outputs[-1].error, NotReadyError)
    assert engine.num_unfinished == 0 and not engine.is_alive


def test_metrics_are_recorded(tokenizer: Tokenizer) -> None:
    """The server's stats sink records each step's `StepStats` into this process's metrics, replica "0"."""

    def value(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(metrics.PREFIX + name, {"replica": "0", **labels}) or 0.0

    before = (value("request_success_total", finished_reason="length"), value("generation_tokens_total"))
    engine = LLMEngine(make_backend(), tokenizer, stats_sink=metrics.record_step_stats)
    engine.start()
    try:
        run(collect(engine, "m", [5, 6, 7], params(9)))
    finally:
        engine.stop(timeout=TIMEOUT_S)
    # stopped: the output thread has recorded everything
    assert value("request_success_total", finished_reason="length") == before[0] + 1
    assert value("generation_tokens_total") == before[1] + 9
    assert value("step_duration_seconds_count", phase="prefill", bucket="16") >= 1
    assert value("num_batched_tokens_padding_total", phase="prefill", bucket="16") >= 13


def test_steps_are_reported_as_data_to_the_sink(tokenizer: Tokenizer) -> None:
    """A given sink gets one `StepStats` per step, as plain data: nothing needs Prometheus."""
    records: list[StepStats] = []
    engine = LLMEngine(make_backend(), tokenizer, stats_sink=records.append)
    engine.start()
    try:
        run(collect(engine, "s", [5, 6, 7], params(4)))
    finally:
        engine.stop(timeout=TIMEOUT_S)
    assert sum(r.generated_tokens for r in records) == 4
    assert [f.num_prompt_tokens for r in records for f in r.first_tokens] == [3]
    assert len([s for r in records for s in r.inter_token_s]) == 3
    (finished,) = [f for r in records for f in r.finished]
    assert (finished.reason, finished.failed, finished.num_generated_tokens) == ("length", False, 4)
    phases = {call.phase for r in records for call in r.calls}
    assert phases == {"prefill", "decode"}
    assert all(r.num_slots == TINY_GRID.num_slots for r in records)
    assert pickle.loads(pickle.dumps(records)) == records  # a replica process ships them to the front


def test_a_failing_stats_sink_does_not_stop_delivery(tokenizer: Tokenizer) -> None:
    """A bug in reporting statistics (a negative padding count once crashed Prometheus recording) used to
    end the output thread: the engine stepped on, no stream got another delta, and the probes said 200."""

    def broken_sink(stats: StepStats) -> None:
        raise ValueError("a statistics bug")

    engine = LLMEngine(make_backend(), tokenizer, stats_sink=broken_sink)
    engine.start()
    try:
        first = run(collect(engine, "a", [5, 6, 7], params(4)))
        second = run(collect(engine, "b", [5, 6, 7], params(4)))
        assert first[-1].finished and second[-1].finished
        assert engine.is_alive
    finally:
        engine.stop(timeout=TIMEOUT_S)


def test_the_engine_is_not_alive_once_its_delivery_thread_is_gone(tokenizer: Tokenizer) -> None:
    engine = LLMEngine(make_backend(), tokenizer)
    engine.start()
    try:
        assert engine.is_alive
        engine._output.close(timeout=TIMEOUT_S)  # as if the delivery thread had died
        assert not engine.is_alive and not engine.is_ready
    finally:
        engine.stop(timeout=TIMEOUT_S)


def test_running_ahead_gives_every_request_the_tokens_it_gets_in_step(tokenizer: Tokenizer) -> None:
    """EOS ends requests while the next step is already launched: their rows are dropped and their slots
    refilled, and each request still gets exactly what the device generates for it alone."""
    prompts = [[5 + i % 40] * (1 + 5 * (i % 4)) for i in range(24)]

    async def main(engine: LLMEngine) -> list[list[RequestOutput]]:
        return await asyncio.gather(
            *(collect(engine, f"r{i}", p, params(2 + i % 12, i)) for i, p in enumerate(prompts))
        )

    results = {}
    for run_ahead in (True, False):
        backend = make_backend(eos_probability=0.1)
        with running_engine(tokenizer, backend, max_prefills_per_step=2, run_ahead=run_ahead) as engine:
            results[run_ahead] = run(main(engine))
            check_idle(engine)
    for i, (ahead, in_step) in enumerate(zip(results[True], results[False], strict=True)):
        check_stream(ahead)
        assert joined(ahead) == joined(in_step)
        assert ahead[-1].finish_reason is in_step[-1].finish_reason
        token_ids = joined(ahead)[0]
        assert token_ids == expected_tokens(backend, prompts[i], seed=i, count=len(token_ids))
    reasons = {outputs[-1].finish_reason for outputs in results[True]}
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}


class OrderLog(SimBackend):
    """Logs when calls are launched and when their tokens are waited for, and the batches launched."""

    events: list[tuple[str, int]]
    batches: list[PrefillBatch | DecodeBatch]

    def launch(self, batch: PrefillBatch | DecodeBatch) -> Tokens:
        index = len(self.batches)
        self.events.append(("launch", index))
        self.batches.append(batch)
        tokens = super().launch(batch)
        return partial(self._logged, index, tokens)

    def _logged(self, index: int, tokens: Tokens) -> list[SampledToken]:
        self.events.append(("wait", index))
        return tokens()


@RUN_AHEAD
def test_running_ahead_launches_each_step_before_waiting_for_the_one_before(
    tokenizer: Tokenizer, run_ahead: bool
) -> None:
    backend = make_backend(cls=OrderLog)
    backend.events, backend.batches = [], []
    with running_engine(tokenizer, backend, run_ahead=run_ahead) as engine:
        run(collect(engine, "r", [5, 6], params(6)))
    expected = ["launch 0"] + [f"launch {i + 1} wait {i}" for i in range(5)] + ["wait 5"]
    if not run_ahead:
        expected = [f"launch {i} wait {i}" for i in range(6)]
    assert " ".join(f"{kind} {i}" for kind, i in backend.events) == " ".join(expected)


def test_in_step_each_call_is_waited_for_before_the_next_is_launched(tokenizer: Tokenizer) -> None:
    """A step with a prefill and a decode: each call completes before the next starts, so a backend
    that runs its calls inside `launch` has each one timed alone."""
    backend = make_backend(cls=OrderLog, cost_model=CostModel(0.01))
    backend.events, backend.batches = [], []

    async def main(engine: LLMEngine) -> None:
        first = engine.generate("first", [5, 6], params(30))
        await first.__anext__()
        await asyncio.gather(drain(first), collect(engine, "second", [7, 8], params(4)))

    with running_engine(tokenizer, backend, run_ahead=False, policy="fifo") as engine:
        run(main(engine))
    second_prefill = [i for i, b in enumerate(backend.batches) if isinstance(b, PrefillBatch)][1]
    step_decode = backend.batches[second_prefill + 1]
    assert isinstance(step_decode, DecodeBatch) and step_decode.slots == (0,)  # that step decoded the first
    assert backend.events == [(kind, i) for i in range(len(backend.batches)) for kind in ("launch", "wait")]


class PoisonSim(SimBackend):
    """A call of kind `poisoned` fails on the device when any of its rows samples with top_k 7 (one bad
    row, as a value the device cannot represent would be): refused at launch, or (`at_wait`) failing
    when its tokens are waited for, having run nothing. The first call waits for `gate`, so the test can
    queue requests that then share one step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.poisoned: type = PrefillBatch
        self.at_wait = False
        self.entered, self.gate = threading.Event(), threading.Event()

    def launch(self, batch: PrefillBatch | DecodeBatch) -> Tokens:
        self.entered.set()
        assert self.gate.wait(TIMEOUT_S)
        if isinstance(batch, self.poisoned) and any(p.top_k == 7 for p in batch.sampling):
            if self.at_wait:
                return partial(_fail, "a row the device cannot run")
            raise RuntimeError("a row the device cannot run")
        return super().launch(batch)


def _fail(message: str) -> list[SampledToken]:
    raise RuntimeError(message)


@pytest.mark.parametrize("poisoned", [PrefillBatch, DecodeBatch], ids=["prefill", "decode"])
@pytest.mark.parametrize(
    ("run_ahead", "at_wait"),
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["in-step-launch", "in-step-wait", "ahead-launch", "ahead-wait"],
)
def test_a_bad_row_fails_only_its_own_request(
    tokenizer: Tokenizer, poisoned: type, run_ahead: bool, at_wait: bool
) -> None:
    """Issue 28 item 6: running ahead too, where the next step was launched on top of the failed call
    (waited for, its rows of the failed call's requests dropped and decoded again)."""
    backend = make_backend(cls=PoisonSim)
    backend.poisoned, backend.at_wait = poisoned, at_wait
    prompts = [[5, 6], [7, 8, 9]]  # with "first" and "bad": every slot, one step
    bad = GenerationParams(SamplingParams(seed=9, top_k=7), 6)

    async def main(engine: LLMEngine) -> list[list[RequestOutput]]:
        first = asyncio.create_task(collect(engine, "first", [3, 4], params(6, 0)))
        await asyncio.to_thread(backend.entered.wait, TIMEOUT_S)  # the engine waits in the first call
        others = [
            asyncio.create_task(collect(engine, f"r{i}", p, params(6, i + 1))) for i, p in enumerate(prompts)
        ]
        others.append(asyncio.create_task(collect(engine, "bad", [13, 14], bad)))
        await asyncio.sleep(0)  # each task has called generate: all are queued for one step
        backend.gate.set()
        return await asyncio.gather(first, *others)

    with running_engine(
        tokenizer, backend, policy="fifo", max_prefills_per_step=4, run_ahead=run_ahead
    ) as engine:
        first, *good, bad_outputs = run(main(engine))
        check_idle(engine)
    assert bad_outputs[-1].finish_reason is FinishReason.ERROR
    assert isinstance(bad_outputs[-1].error, GenerationError)
    assert joined(first)[0] == expected_tokens(backend, [3, 4], 0, 6)
    for i, outputs in enumerate(good):
        check_stream(outputs)
        assert joined(outputs)[0] == expected_tokens(backend, prompts[i], i + 1, 6)


def test_a_library_running_ahead_in_call_gets_each_step_decode_before_its_prefills(
    tokenizer: Tokenizer,
) -> None:
    """NxD Inference's async mode: a prefill resets the library's run-ahead, so a new sequence's first
    decode must be the first decode call after its prefill; the plain loop then runs the decode first."""
    backend = make_backend(cls=OrderLog, cost_model=CostModel(0.01))
    backend.events, backend.batches = [], []
    backend.runs_ahead_in_call = True

    async def main(engine: LLMEngine) -> None:
        first = engine.generate("first", [5, 6], params(30))
        await first.__anext__()
        await asyncio.gather(drain(first), collect(engine, "second", [7, 8], params(4)))

    with running_engine(tokenizer, backend, run_ahead=False) as engine:
        run(main(engine))
    second_prefill = [i for i, b in enumerate(backend.batches) if isinstance(b, PrefillBatch)][1]
    step_decode, next_decode = backend.batches[second_prefill - 1], backend.batches[second_prefill + 1]
    assert isinstance(step_decode, DecodeBatch) and step_decode.slots == (0,)
    assert isinstance(next_decode, DecodeBatch) and next_decode.slots == (0, 1)


def test_a_submitted_request_is_relayed_a_step_at_a_time(tokenizer: Tokenizer) -> None:
    """Without a stream (a replica process), each step's deltas go to the relay in one call."""
    batches: list[list[RequestOutput]] = []
    both_done = threading.Event()

    def relay(batch: list[RequestOutput]) -> None:
        batches.append(batch)
        if sum(o.finished for b in batches for o in b) == 2:
            both_done.set()

    engine = LLMEngine(make_backend(), tokenizer, relay=relay)
    engine.start()
    try:
        engine.submit("a", [5, 6, 7], params(3))
        engine.submit("b", [8, 9], params(3))
        assert both_done.wait(TIMEOUT_S)
    finally:
        engine.stop(timeout=TIMEOUT_S)
    outputs = [o for batch in batches for o in batch]
    for request_id in ("a", "b"):
        mine = [o for o in outputs if o.request_id == request_id]
        assert mine[-1].finished and mine[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(o.token_ids) for o in mine) == 3
    assert any(len({o.request_id for o in batch}) == 2 for batch in batches)  # one call per step


class WedgedSim(SimBackend):
    """A device call that hangs until `release` is set (a wedged device); `entered` once it hangs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def launch(self, batch: PrefillBatch | DecodeBatch) -> Tokens:
        self.entered.set()
        assert self.release.wait(TIMEOUT_S)
        return super().launch(batch)


def test_a_wedged_device_call_makes_the_engine_unready_but_alive(tokenizer: Tokenizer) -> None:
    """Issue 21: with work pending and no step for a bounded multiple of the expected step, the engine is
    not ready (a probe fails it); once the call returns it is ready again. Virtual time: no sleeps."""
    clock = VirtualClock()
    spec = BackendSpec("sim", 1, "fp32", TINY_GRID)
    backend = WedgedSim.create(spec, CostModel(0.01), 512, EOS_IDS, clock=clock)
    done = threading.Event()
    engine = LLMEngine(backend, tokenizer, clock=clock, relay=lambda outputs: done.set())
    engine.start()
    try:
        assert engine.is_ready and engine.stalled_s() == 0.0  # nothing pending: never stalled
        engine.submit("a", [5, 6], params(1))
        assert backend.entered.wait(TIMEOUT_S)
        clock.advance_to(clock.monotonic() + engine.stall_limit_s + 1.0)
        assert engine.is_alive and not engine.is_ready
        backend.release.set()
        assert done.wait(TIMEOUT_S)
        assert engine.is_ready and engine.stalled_s() == 0.0
    finally:
        backend.release.set()
        engine.stop(timeout=TIMEOUT_S)


def test_the_deadline_holds_while_the_device_call_hangs(tokenizer: Tokenizer) -> None:
    """Issue 21: the request deadline holds wherever the request is. With the engine thread stuck in a
    device call the scheduler cannot expire anything; the stream ends itself with a deadline error."""
    backend = make_backend(cls=WedgedSim)
    with running_engine(tokenizer, backend, request_timeout_s=0.2) as engine:
        try:
            outputs = run(collect(engine, "w", [5, 6, 7], params(4)))
        finally:
            backend.release.set()
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert isinstance(outputs[-1].error, DeadlineExceededError)
