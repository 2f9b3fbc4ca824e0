"""The load-test kit (`python -m loadtest.sweep`) end to end: a short rate sweep, a concurrency sweep over
a JSONL trace and a point over a shipped trace, against a real server on the simulated device, their JSON
reports and PNG plots; goodput arithmetic."""

from __future__ import annotations

import json

import pytest

from loadtest import traces
from loadtest.sweep import Sample, Slo, main, summarize_point

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("latency_vs_throughput.png", "slo_attainment.png")


def assert_plots(out_dir):
    for name in PLOTS:
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name


def test_rate_sweep_reports_every_point_and_plots(sim_server, stories260k, tmp_path):
    argv = [
        "--url",
        sim_server.url,
        "--rates",
        "10,40",
        "--num-requests",
        "8",
        "--tokenizer",
        str(stories260k),
    ]
    argv += ["--input-tokens", "24", "--input-stdev", "4", "--output-tokens", "12", "--slo-ttft-ms", "10000"]
    argv += ["--slo-tpot-ms", "10000", "--out-dir", str(tmp_path), "--quiet"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["model"] == "sim" and report["mode"] == "rate"
    assert [p["load"] for p in report["points"]] == [10.0, 40.0]
    for point in report["points"]:
        assert point["ok"] == 8 and point["failed"] == 0
        assert point["output_tokens"] == 8 * 12  # ignore_eos: every request ran to its length
        assert 8 * 20 <= point["prompt_tokens"] <= 8 * 28
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            stats = point[metric]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"], metric
        assert point["slo_attainment"] == 1.0  # a lax SLO every request meets
        assert point["goodput"] == pytest.approx(8 / point["duration_s"], rel=1e-3)
    assert report["summary"]["max_load_meeting_slo"] == 40.0
    assert report["summary"]["failed_requests"] == 0
    assert_plots(tmp_path)


def test_concurrency_sweep_over_a_jsonl_trace_and_side_by_side_plots(sim_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"prompt": f"Once upon a time there was a cat number {i}", "output_tokens": 4 + i} for i in range(3)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    argv = ["--url", sim_server.url + "/v1", "--concurrency", "1,4", "--num-requests", "6"]
    argv += [
        "--trace",
        str(trace),
        "--slo-ttft-ms",
        "0.001",
        "--out-dir",
        str(out),
        "--quiet",
        "--label",
        "ours",
    ]
    assert main(argv) == 0
    report = json.loads((out / "sweep.json").read_text())
    assert report["mode"] == "concurrency" and report["label"] == "ours"
    for point in report["points"]:
        assert point["failed"] == 0
        assert point["output_tokens"] == 2 * (4 + 5 + 6)  # the trace's lengths, cycled to 6 requests
        assert point["slo_attainment"] == 0.0 and point["goodput"] == 0.0  # no TTFT is 1 us
    assert report["summary"]["max_load_meeting_slo"] is None
    compare = tmp_path / "compare"
    assert main(["--plot", str(out / "sweep.json"), str(out / "sweep.json"), "--out-dir", str(compare)]) == 0
    assert_plots(compare)


def test_a_shipped_trace_gives_lengths_and_arrival_gaps(sim_server, stories260k, tmp_path):
    argv = ["--url", sim_server.url, "--rates", "50", "--num-requests", "4", "--trace", "chat"]
    argv += ["--tokenizer", str(stories260k), "--out-dir", str(tmp_path), "--quiet"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    chat = traces.load("chat")
    (point,) = report["points"]
    assert report["config"]["trace"] == "chat" and point["failed"] == 0
    assert point["prompt_tokens"] == sum(chat.prompt_lens[:4])
    assert point["output_tokens"] == sum(chat.output_lens[:4])
    assert_plots(tmp_path)


def test_goodput_counts_failed_and_slow_requests_as_missing_the_slo():
    fast = Sample(ok=True, ttft_s=0.1, e2e_s=0.5, chunk_times=[0.1, 0.2, 0.3], output_tokens=3)
    slow_first = Sample(ok=True, ttft_s=0.9, e2e_s=1.0, chunk_times=[0.9, 1.0], output_tokens=2)
    failed = Sample(ok=False, error="HTTP 400: bad", e2e_s=0.01)
    point = summarize_point([fast, slow_first, failed], wall_s=2.0, slo=Slo(ttft_ms=500, tpot_ms=250))
    assert (point["ok"], point["failed"], point["slo_met"]) == (2, 1, 1)
    assert point["slo_attainment"] == pytest.approx(1 / 3)
    assert point["goodput"] == pytest.approx(0.5)
    assert point["errors"] == ["HTTP 400: bad"]
    assert fast.tpot_s == pytest.approx(0.2) and point["itl_ms"]["max"] == pytest.approx(100.0)
