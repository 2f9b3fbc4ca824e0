"""PNG plots of one or more sweep reports (`loadtest/sweep.py`), each report one colour, so a run against
ours and one against a peer read side by side: latency percentiles against the throughput each load
reached, and SLO attainment and goodput against the offered load."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import matplotlib.pyplot as plt

LATENCIES = (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"))
LATENCIES += (("itl_ms", "inter-token latency"), ("e2e_ms", "end-to-end latency"))


def _load_label(report: dict[str, Any]) -> str:
    return "request rate (req/s)" if report["mode"] == "rate" else "concurrency (requests in flight)"


def latency_vs_throughput(reports: Sequence[dict[str, Any]], path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), layout="constrained")
    for (metric, title), ax in zip(LATENCIES, axes.flat, strict=True):
        for index, report in enumerate(reports):
            color = f"C{index}"
            points = [p for p in report["points"] if p[metric]]
            x = [p["output_throughput"] for p in points]
            ax.plot(x, [p[metric]["p50"] for p in points], "o-", color=color, label=f"{report['label']} p50")
            ax.plot(x, [p[metric]["p99"] for p in points], "s--", color=color, label=f"{report['label']} p99")
            for p, xi in zip(points, x, strict=True):
                ax.annotate(
                    f"{p['load']:g}",
                    (xi, p[metric]["p99"]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                    color=color,
                )
        limit = reports[0]["slo"].get(metric)  # no SLO on inter-token latency
        if limit:
            ax.axhline(limit, color="grey", linestyle=":", label=f"SLO {limit:g} ms")
        ax.set(title=title, xlabel="output throughput (tokens/s)", ylabel="ms")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Latency vs throughput (labels: {_load_label(reports[0])})")
    return _save(fig, path)


def slo_attainment(reports: Sequence[dict[str, Any]], path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    slo = reports[0]["slo"]
    for index, report in enumerate(reports):
        color = f"C{index}"
        loads = [p["load"] for p in report["points"]]
        left.plot(
            loads,
            [100 * p["slo_attainment"] for p in report["points"]],
            "o-",
            color=color,
            label=report["label"],
        )
        right.plot(
            loads,
            [p["goodput"] for p in report["points"]],
            "o-",
            color=color,
            label=f"{report['label']} goodput",
        )
        right.plot(
            loads,
            [p["request_throughput"] for p in report["points"]],
            "x:",
            color=color,
            label=f"{report['label']} completed",
        )
        if (best := report["summary"]["max_load_meeting_slo"]) is not None:
            left.axvline(
                best,
                color=color,
                linestyle="--",
                alpha=0.6,
                label=f"{report['label']} meets it up to {best:g}",
            )
    left.axhline(
        100 * slo["attainment"], color="grey", linestyle=":", label=f"target {slo['attainment']:.0%}"
    )
    limits = ", ".join(
        f"{name.removesuffix('_ms').upper()} <= {slo[name]:g} ms"
        for name in ("ttft_ms", "tpot_ms", "e2e_ms")
        if slo.get(name)
    )
    left.set(
        title=f"SLO attainment ({limits})",
        xlabel=_load_label(reports[0]),
        ylabel="% of requests",
        ylim=(0, 105),
    )
    right.set(
        title="Goodput (requests/s meeting the SLO)", xlabel=_load_label(reports[0]), ylabel="requests/s"
    )
    right.set_ylim(bottom=0)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(reports: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    return [
        latency_vs_throughput(reports, out_dir / "latency_vs_throughput.png"),
        slo_attainment(reports, out_dir / "slo_attainment.png"),
    ]
