"""lm-evaluation-harness, unmodified, scoring the served model through its `local-completions` model type
(loglikelihood by `echo` + `logprobs`, greedy generation with `stop`) on the small local tasks in
`lm_eval_tasks/`, against the same harness on transformers' model (`hf`) from the same checkpoint: the
same scores, per-choice loglikelihoods within 1e-4, the same greedy flags and generations."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ["stories_cloze", "stories_continue"]
SCORES = [("stories_cloze", "acc,none"), ("stories_cloze", "acc_norm,none")]
SCORES += [("stories_continue", "exact_match,strip")]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """lm_eval's entry point, with the Hub off: the tasks' data and the tokenizer are local files."""
    with pytest.MonkeyPatch.context() as env:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.setenv(name, "1")
        env.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        def evaluate(model: str, model_args: dict) -> dict:
            return simple_evaluate(
                model=model,
                model_args=model_args,
                tasks=TASKS,
                task_manager=TaskManager(include_path=str(TASK_DIR)),
                batch_size=4,
                device="cpu",
                bootstrap_iters=0,
                log_samples=True,
            )

        yield evaluate


@pytest.fixture(scope="module")
def reference(harness, stories260k):
    return harness("hf", {"pretrained": str(stories260k), "dtype": "float32", "add_bos_token": True})


def served(harness, server, tokenizer: dict[str, str]) -> dict:
    model_args = {
        "base_url": server.url + "/v1/completions",
        "model": "stories260K",
        **tokenizer,
        "add_bos_token": True,
        "max_retries": 1,
    }
    return harness("local-completions", model_args)


def test_served_scores_equal_transformers_scores(harness, reference, stories_server, stories260k):
    results = served(harness, stories_server, {"tokenizer": str(stories260k)})
    for task, metric in SCORES:
        assert results["results"][task][metric] == reference["results"][task][metric], (task, metric)
    assert 0 < reference["results"]["stories_cloze"]["acc,none"] < 1  # the task separates right from wrong

    for ours, theirs in zip(
        results["samples"]["stories_cloze"], reference["samples"]["stories_cloze"], strict=True
    ):
        assert ours["doc_id"] == theirs["doc_id"]
        for (logprob, greedy), (ref_logprob, ref_greedy) in zip(
            ours["filtered_resps"], theirs["filtered_resps"], strict=True
        ):
            assert logprob == pytest.approx(ref_logprob, abs=1e-4)
            assert greedy == ref_greedy
    generations = [s["filtered_resps"] for s in results["samples"]["stories_continue"]]
    assert generations == [s["filtered_resps"] for s in reference["samples"]["stories_continue"]]


def test_the_remote_tokenizer_scores_the_same(harness, reference, stories_server):
    """Without a local tokenizer: the harness reads the server's `/tokenizer_info`, `/tokenize` and
    `/detokenize` (issue 23), and scores loglikelihoods as before. (Its remote backend never adds BOS to
    a generation prompt, whatever `add_bos_token` says, so greedy generations differ from the run with
    the local tokenizer: they are only checked to have run.)"""
    results = served(harness, stories_server, {"tokenizer_backend": "remote"})
    for task, metric in SCORES:
        if task == "stories_cloze":
            assert results["results"][task][metric] == reference["results"][task][metric], (task, metric)
    generations = [s["filtered_resps"][0] for s in results["samples"]["stories_continue"]]
    assert generations and all(isinstance(text, str) for text in generations)
