"""A picture of a benchmark's headline figures, written beside its JSON.

Every benchmark's `--json out.json` also writes `out.png` through `write_plot`: grouped
bars, one panel per quantity, each bar labelled with its value. The benchmark picks its
headline figures; this module only draws them (matplotlib, Agg backend: no display).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping

Panels = Mapping[str, Mapping[str, Mapping[str, "float | None"]]]


def png_path(json_path: str) -> str:
    """`out.json` -> `out.png` (any other name gets `.png` appended)."""
    root, ext = os.path.splitext(json_path)
    return (root if ext.lower() == ".json" else json_path) + ".png"


def write_plot(
    json_path: str,
    title: str,
    panels: Panels,
    baselines: Mapping[str, float] | None = None,
    log_scale: Iterable[str] = (),
) -> str | None:
    """Draw `panels`, {y-axis label: {group (x tick): {series (bar): value}}}, side by side
    under `title`, into the PNG beside `json_path`; returns its path. A `None` value draws
    no bar. `baselines` lets a panel's bars rise from a value other than 0 (e.g. 1 for a
    ratio whose floor is 1), so close figures can be told apart; panels named in `log_scale`
    get a logarithmic y-axis (figures spanning orders of magnitude). Without matplotlib it
    says so and returns None (the JSON is already written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    series = list(
        dict.fromkeys(s for groups in panels.values() for row in groups.values() for s in row)
    )
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(series)}
    bars_per_panel = [sum(len(row) for row in groups.values()) for groups in panels.values()]
    fig, axes = plt.subplots(
        1,
        len(panels),
        squeeze=False,
        figsize=(1.2 + sum(max(4.6, 0.4 * n) for n in bars_per_panel), 4.2),
    )
    for ax, (ylabel, groups), n_bars in zip(axes[0], panels.items(), bars_per_panel):
        base = (baselines or {}).get(ylabel, 0.0)
        names = [s for s in series if any(s in row for row in groups.values())]
        width = 0.8 / max(1, len(names))
        if ylabel in log_scale:
            ax.set_yscale("log")
        for i, name in enumerate(names):
            xs = [
                g + (i - (len(names) - 1) / 2) * width
                for g, row in enumerate(groups.values())
                if row.get(name) is not None
            ]
            ys = [row[name] for row in groups.values() if row.get(name) is not None]
            bars = ax.bar(
                xs, [y - base for y in ys], width, bottom=base, label=name, color=colors[name]
            )
            ax.bar_label(
                bars,
                labels=[f"{y:.4g}" for y in ys],
                fontsize=7,
                padding=1,
                rotation=90 if n_bars > 8 else 0,
            )
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set_ylabel(ylabel)
        ax.margins(y=0.12)
        if base:
            ax.set_ylim(bottom=base)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = png_path(json_path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"Wrote {path}")
    return path
