"""The goodput benchmark's HTML report: its tables and, per preset and trace, SLO attainment against rate
for each policy and the TTFT / TPOT distributions at one rate, as inline SVG (no plotting dependency)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e")
WIDTH, HEIGHT, PAD = 420, 240, 40


def _scale(values: Sequence[float], low: float | None = None) -> tuple[float, float]:
    lo = min(values) if low is None else low
    hi = max(values)
    return lo, hi if hi > lo else lo + 1


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str, y_label: str) -> str:
    """One SVG: a polyline per series (x, y points), a legend, the axes' ranges."""
    points = [p for line in series.values() for p in line]
    if not points:
        return ""
    x0, x1 = _scale([p[0] for p in points], 0.0)
    y0, y1 = _scale([p[1] for p in points], 0.0)

    def xy(x: float, y: float) -> str:
        px = PAD + (x - x0) / (x1 - x0) * (WIDTH - 2 * PAD)
        py = HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg" font-size="10">',
        f'<text x="{PAD}" y="14" font-weight="bold">{html.escape(title)}</text>',
        f'<rect x="{PAD}" y="{PAD}" width="{WIDTH - 2 * PAD}" height="{HEIGHT - 2 * PAD}" '
        'fill="none" stroke="#999"/>',
        f'<text x="{PAD}" y="{HEIGHT - 8}">{html.escape(x_label)}: {x0:g} .. {x1:.3g}</text>',
        f'<text x="4" y="{PAD - 4}">{html.escape(y_label)}: {y0:g} .. {y1:.3g}</text>',
    ]
    for index, (name, line) in enumerate(series.items()):
        color = COLORS[index % len(COLORS)]
        path = " ".join(xy(x, y) for x, y in sorted(line))
        parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        y = PAD + 12 * index + 8
        parts.append(f'<text x="{WIDTH - PAD + 2}" y="{y}" fill="{color}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def cdf(values: Sequence[float]) -> list[tuple[float, float]]:
    n = len(values)
    step = max(1, n // 100)
    return [(v, (i + 1) / n) for i, v in enumerate(sorted(values)) if i % step == 0 or i == n - 1]


def _table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r[k]))}</td>" for k in keys) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def write_html(report: dict[str, Any], path: Path) -> None:
    parts = [
        "<!doctype html><meta charset='utf-8'><title>goodput</title>",
        "<style>body{font-family:sans-serif} td,th{padding:2px 6px;border:1px solid #ccc}",
        "table{border-collapse:collapse}</style>",
        "<h1>Goodput under latency SLOs</h1><h2>Goodput (requests/s)</h2>",
        _table(report["table"]),
        "<h2>Calibration</h2>",
        _table(report["calibration"]),
    ]
    for cell in report["cells"]:
        parts.append(f"<h2>{html.escape(cell['preset'])} / {html.escape(cell['trace'])}</h2><div>")
        for slo_name, by_policy in cell["attainment"].items():
            slo = cell["slos"][slo_name]
            series = {policy: [(r, a) for r, a in points] for policy, points in by_policy.items()}
            title = f"SLO attainment, {slo_name} ({slo['ttft_ms']:g} ms / {slo['tpot_ms']:g} ms)"
            parts.append(line_chart(title, series, "rate (req/s)", "attainment"))
        dists = cell["distributions"]
        for metric in ("ttft_ms", "tpot_ms"):
            series = {f"{p} @{d['rate_rps']:g}": cdf(d[metric]) for p, d in dists.items() if d[metric]}
            parts.append(line_chart(f"{metric} CDF", series, metric, "share of requests"))
        parts.append("</div>")
    path.write_text("\n".join(parts) + "\n")
