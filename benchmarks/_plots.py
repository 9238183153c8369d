"""The plots, as SVG: each answers one question, from the results only.

- `headline.svg`: how much memory each way of mapping needs, at one chunk size;
- `memory.svg`: the same against the chunk size, per workload;
- `time.svg`: the time against the chunk size, over the faster of `jax.vmap` and
  `jax.lax.map(batch_size=)` (the baseline of every table);
- `compile.svg`: the XLA compile time against the batch size.

Lines that coincide everywhere (to 3%) are drawn once and named in a note below
the legend, so that the legend never names a line nobody can see.
"""

import textwrap
from pathlib import Path
from typing import Any

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _report import (  # noqa: E402
    _configs,
    _scaling_groups,
    headline_chunk_size,
    LABELS,
    mem_ratio,
    time_ratio,
)
from matplotlib.ticker import (  # noqa: E402
    FixedLocator,
    FuncFormatter,
    NullFormatter,
    NullLocator,
)


# Text stays text in the SVG: small files, crisp at any width.
# Reproducible files: the same results give the same bytes.
# Readable on a phone: the figures are 5.5 inches wide and the docs show them at
# 350 px or more there, so 13 pt text is 11 px or more (no text below 10.5 pt).
WIDTH = 5.5
plt.rcParams.update(
    {
        "svg.fonttype": "none",
        "font.size": 13,
        "axes.titlesize": 13,
        "xtick.labelsize": 11.5,
        "ytick.labelsize": 11.5,
        "svg.hashsalt": "filtered_chunk",
    }
)
METADATA = {"Date": None}
STYLES = {  # colour, marker, line style: no two alike
    "fc": ("#1f77b4", "o", "-"),
    "fc_separate": ("#17becf", "s", (0, (5, 2))),
    "vmap": ("#7f7f7f", "X", ":"),
    "filter_vmap": ("#8c564b", "P", (0, (1, 3))),
    "lax_map": ("#ff7f0e", "^", "-."),
    "loop": ("#d62728", "v", (0, (3, 1, 1, 1, 1, 1))),
    "netket": ("#2ca02c", "D", (0, (8, 3))),
}
# Legend labels: the tables' names, the long one on two lines.
NAMES = LABELS | {"fc_separate": 'filter_chunked_vmap,\nremainder="separate"'}
ORDER = ("fc", "fc_separate", "lax_map", "netket", "vmap", "filter_vmap", "loop")
SHORT = {
    "fc": "filter_chunked_vmap",
    "fc_separate": '"separate"',
    "vmap": "jax.vmap",
    "filter_vmap": "eqx.filter_vmap",
    "lax_map": "jax.lax.map",
    "loop": "Python loop",
    "netket": "NetKet",
}


def _workload_axes(results: dict[str, Any], title: str):
    """A 3 x 2 grid: one panel per workload, the last one for the legend."""
    keys = list(results["workloads"])
    fig, grid = plt.subplots(3, 2, figsize=(WIDTH, 11))
    fig.suptitle(textwrap.fill(title, 36), fontsize=14)
    panels = list(grid.flat)
    for ax, key in zip(panels, keys):
        title = results["workloads"][key]["title"].replace("`", "")
        ax.set_title(textwrap.fill(f"({key}) {title}", 20, break_long_words=False))
        ax.grid(True, which="major", alpha=0.3)
    for ax in panels[len(keys) :]:
        ax.axis("off")
    return fig, dict(zip(keys, panels)), panels[-1]


def _same(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> bool:
    """Two lines at the same points, with values equal to 3%."""
    dx, dy = dict(x), dict(y)
    return dx.keys() == dy.keys() and all(abs(dx[k] / dy[k] - 1) <= 0.03 for k in dx)


def _coinciding(series: dict[str, dict[str, list[tuple[float, float]]]]) -> dict:
    """`{hidden: shown}` for peers whose line equals another's in every panel."""
    hidden: dict[str, str] = {}
    for i, a in enumerate(ORDER):
        for b in ORDER[i + 1 :]:
            if b in hidden or a in hidden:
                continue
            pairs = [(s[a], s[b]) for s in series.values() if a in s and b in s]
            if pairs and all(_same(x, y) for x, y in pairs):
                hidden[b] = a
    return hidden


def _panel_note(ax: Any, series: dict[str, list[tuple[float, float]]]) -> None:
    """Names, under the panel's title, the lines of the panel that lie on top of
    each other wherever both are drawn."""
    shown = [k for k in ORDER if k in series]
    groups: list[list[str]] = []
    for key in shown:
        for group in groups:
            a, b = dict(series[group[0]]), dict(series[key])
            common = a.keys() & b.keys()
            if len(common) >= 2 and _same(
                [(k, a[k]) for k in common], [(k, b[k]) for k in common]
            ):
                group.append(key)
                break
        else:
            groups.append([key])
    notes = [" = ".join(SHORT[k] for k in g) for g in groups if len(g) > 1]
    if notes:
        title = ax.get_title()
        note = textwrap.fill("; ".join(notes) + ": one line", 26)
        ax.set_title(title + "\n" + note, fontsize=10.5)


def _legend(
    fig: Any, axes: dict[str, Any], legend_ax: Any, hidden: dict, extra: str = ""
) -> None:
    handles: dict[str, Any] = {}
    for ax in axes.values():
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    legend_ax.legend(
        list(handles.values()),
        list(handles),
        loc="upper center",
        fontsize=11,
        frameon=False,
        handlelength=2.5,
    )
    same = ", ".join(f"{SHORT[h]} = {SHORT[s]}" for h, s in hidden.items())
    notes = [f"In every panel {same}: drawn once."] if hidden else []
    if extra:
        notes.append(extra)
    # The notes go under the panels, full width: beside the legend they would
    # overlap it on a figure narrow enough for a phone.
    text = "\n".join(textwrap.fill(n, 60) for n in notes)
    bottom = (text.count("\n") + 1) * 14 / (fig.get_figheight() * 72) if notes else 0
    if notes:
        fig.text(0.5, 0.005, text, ha="center", va="bottom", fontsize=10.5)
    fig.tight_layout(rect=(0, bottom, 1, 1))


def _log_ticks(axis: Any, values: list[float]) -> None:
    """A log-scaled axis labelled at `values`, as plain numbers, no minor labels."""
    axis.set_major_locator(FixedLocator(values))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


def nice_ticks(lo: float, hi: float) -> list[float]:
    """Round values spanning [lo, hi] on a log axis: at least three."""
    decades = [10.0**e for e in range(-3, 5)]
    for steps in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 7)):
        cands = sorted({round(d * m, 6) for d in decades for m in steps})
        inside = [t for t in cands if lo / 1.05 <= t <= hi * 1.05]
        if len(inside) >= 3:
            return inside
    return inside or [1.0]


def _plot_lines(ax: Any, series: dict[str, list[tuple[float, float]]]) -> None:
    for key in ORDER:
        points = series.get(key)
        if not points:
            continue
        color, marker, line = STYLES[key]
        xs, ys = zip(*sorted(points))
        ax.plot(
            xs, ys, color=color, marker=marker, ls=line, ms=6, lw=1.8, label=NAMES[key]
        )


def _by_chunk(results: dict[str, Any], value: Any, peers: tuple[str, ...]) -> dict:
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for c in _configs(results, "chunk"):
        series = out.setdefault(c["workload"], {})
        for key in peers:
            y = value(c, key) if key in c["peers"] else None
            if y is not None:
                series.setdefault(key, []).append((c["chunk_size"], y))
    return out


def _chunk_plot(
    results: dict[str, Any], path: Path, value: Any, title: str, ylabel: str, note: str
) -> None:
    peers = tuple(k for k in ORDER if k != "filter_vmap" or "time" not in path.stem)
    data = _by_chunk(results, value, peers)
    hidden = _coinciding(data)
    fig, axes, legend_ax = _workload_axes(results, title)
    for key, series in data.items():
        ax = axes[key]
        shown = {k: v for k, v in series.items() if k not in hidden}
        _plot_lines(ax, shown)
        _panel_note(ax, shown)
        ax.axhline(1.0, color="k", lw=0.6, zorder=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _log_ticks(ax.xaxis, sorted({x for s in series.values() for x, _ in s}))
        # Chunk sizes such as 64 and 100 lie close on a narrow log axis.
        ax.tick_params(axis="x", labelrotation=90)
        ys = [y for s in series.values() for _, y in s] + [1.0]
        _log_ticks(ax.yaxis, nice_ticks(min(ys), max(ys)))
        ax.set_xlabel("chunk size K")
        ax.set_ylabel(ylabel)
    _legend(fig, axes, legend_ax, hidden, note)
    fig.savefig(path, metadata=METADATA)
    plt.close(fig)


def plot_chunk_sizes(results: dict[str, Any], out_dir: Path) -> list[Path]:
    memory, time = out_dir / "memory.svg", out_dir / "time.svg"
    _chunk_plot(
        results,
        memory,
        mem_ratio,
        "How much memory, against the chunk size K?",
        "memory / floor (1 = ideal)",
        "Floor: the outputs + jax.vmap's working set on K elements.",
    )
    _chunk_plot(
        results,
        time,
        time_ratio,
        "How long, against the chunk size K?",
        "time / best of\njax.vmap, jax.lax.map",
        "1 = the faster of jax.vmap and jax.lax.map at the same K; eqx.filter_vmap "
        "(jax.vmap's program) left out.",
    )
    return [memory, time]


def plot_scaling(results: dict[str, Any], out_dir: Path) -> list[Path]:
    title = "Does compile time grow with the batch size N?"
    fig, axes, legend_ax = _workload_axes(results, title)
    data: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for key, configs in _scaling_groups(results).items():
        for c in configs:
            for peer, row in c["peers"].items():
                if "skipped" not in row:
                    data.setdefault(key, {}).setdefault(peer, []).append(
                        (c["batch_size"], row["compile_s"])
                    )
    for key, configs in _scaling_groups(results).items():
        ax, series = axes[key], data[key]
        _plot_lines(ax, series)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _log_ticks(ax.xaxis, [c["batch_size"] for c in configs])
        ys = [y for s in series.values() for _, y in s]
        _log_ticks(ax.yaxis, nice_ticks(min(ys), max(ys)))
        ax.set_xlabel(f"batch size N (K = {configs[0]['chunk_size']})")
        ax.set_ylabel("XLA compile time (s)")
    _legend(fig, axes, legend_ax, {}, "")
    path = out_dir / "compile.svg"
    fig.savefig(path, metadata=METADATA)
    plt.close(fig)
    return [path]


def plot_headline(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Memory / floor of each way of mapping, per workload, at one chunk size."""
    k = headline_chunk_size(results)
    configs = [c for c in _configs(results, "chunk") if c["chunk_size"] == k]
    peers = ("fc", "lax_map", "vmap")
    fig, ax = plt.subplots(figsize=(WIDTH, 6.2))
    height = 0.26
    for i, key in enumerate(peers):
        color, _, _ = STYLES[key]
        ys = [j + (i - 1) * height for j in range(len(configs))]
        values = [mem_ratio(c, key) or 0.0 for c in configs]
        bars = ax.barh(ys, values, height=height, color=color, label=NAMES[key])
        ax.bar_label(bars, [f"{v:.2f}x" for v in values], padding=3, fontsize=10.5)
    ax.set_yticks(range(len(configs)))
    ax.set_yticklabels(
        [
            textwrap.fill(
                f"({c['workload']}) "
                + results["workloads"][c["workload"]]["title"].replace("`", ""),
                12,
                break_long_words=False,
            )
            for c in configs
        ]
    )
    ax.invert_yaxis()
    ax.set_xscale("log")
    values = [mem_ratio(c, p) or 1.0 for c in configs for p in peers]
    _log_ticks(ax.xaxis, nice_ticks(min(values + [1.0]), max(values)))
    ax.set_xlim(right=max(values) * 2.2)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("memory / floor (1 = the outputs\nplus one chunk's working set)")
    ax.set_title(
        f"Memory needed at chunk size K = {k}\n({_device(results)})", fontsize=13
    )
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.35, -0.22),
        ncols=2,
        fontsize=11.5,
        frameon=False,
    )
    fig.tight_layout()
    path = out_dir / "headline.svg"
    fig.savefig(path, metadata=METADATA)
    plt.close(fig)
    return [path]


def _device(results: dict[str, Any]) -> str:
    machine, _, backend = results["meta"]["machine"].partition("; JAX backend ")
    return f"{machine}, {backend.upper() or 'CPU'}"
