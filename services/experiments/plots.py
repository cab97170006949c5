"""A self-contained SVG of the run's curves (eval accuracy, reward, accuracy of training samples),
written next to summary.json by `dapo run` so the outcome can be seen without a server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = ("#1f77b4", "#d62728", "#2ca02c")


def _panel(
    title: str,
    series: list[tuple[str, list[tuple[float, float]]]],
    x0: int,
    y0: int,
    w: int,
    h: int,
) -> list[str]:
    out = [
        f'<text x="{x0}" y="{y0 - 8}" font-size="14" font-weight="600">{title}</text>',
        f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>',
    ]
    pts = [p for _, line in series for p in line]
    if not pts:
        return out
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    lx, hx = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    ly, hy = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    for frac in (0.0, 0.5, 1.0):
        v = ly + frac * (hy - ly)
        y = y0 + h - frac * h
        out.append(
            f'<text x="{x0 - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{v:.2f}</text>'
        )
    out.append(f'<text x="{x0}" y="{y0 + h + 16}" font-size="11">step {lx:g}</text>')
    out.append(
        f'<text x="{x0 + w}" y="{y0 + h + 16}" font-size="11" text-anchor="end">step {hx:g}</text>'
    )
    for i, (name, line) in enumerate(series):
        if not line:
            continue
        d = " ".join(
            f"{'M' if j == 0 else 'L'}{x0 + (x - lx) / (hx - lx) * w:.1f},"
            f"{y0 + h - (y - ly) / (hy - ly) * h:.1f}"
            for j, (x, y) in enumerate(line)
        )
        out.append(f'<path d="{d}" fill="none" stroke="{COLORS[i]}" stroke-width="2"/>')
        out.append(
            f'<text x="{x0 + 10 + 170 * i}" y="{y0 + 16}" font-size="12" '
            f'fill="{COLORS[i]}">{name}</text>'
        )
    return out


def write_curves_svg(summary: dict[str, Any], path: Path) -> Path:
    evals = [(float(row[0]), float(row[1])) for row in summary.get("eval_history", [])]
    curve = summary.get("reward_curve", [])
    reward = [(float(s), float(r)) for s, r, _ in curve if r is not None]
    acc = [(float(s), float(a)) for s, _, a in curve if a is not None]
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="980" height="330" '
        'font-family="sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    parts += _panel(
        f"Eval accuracy (avg@k): {summary.get('base_eval_acc', 0):.3f} -> "
        f"{summary.get('final_eval_acc', 0):.3f}",
        [("eval acc", evals)],
        60,
        40,
        380,
        250,
    )
    parts += _panel(
        "Training samples", [("mean reward", reward), ("accuracy", acc)], 560, 40, 380, 250
    )
    parts.append("</svg>")
    path.write_text("\n".join(parts))
    return path


def write_series_svg(
    title: str, series: list[tuple[str, list[tuple[float, float]]]], path: Path
) -> Path:
    """One panel of up to three named curves (x: step): a bench's per-task accuracy."""
    w, h = 520, 260
    body = _panel(title, series[: len(COLORS)], 60, 40, w, h)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w + 100}" height="{h + 80}" '
        'font-family="sans-serif">' + "".join(body) + "</svg>\n"
    )
    path.write_text(svg)
    return path
