"""The PNG plots: memory and time against the chunk size, and scaling in N."""

import statistics
from pathlib import Path
from typing import Any

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _report import (  # noqa: E402
    _configs,
    _scaling_groups,
    LABELS,
    mem_ratio,
    STYLES,
)
from matplotlib.ticker import (  # noqa: E402
    FixedLocator,
    FuncFormatter,
    NullFormatter,
)


DPI = 80


def _workload_axes(results: dict[str, Any], title: str):
    """A 2 x 3 grid: one panel per workload, the last one for the legend."""
    keys = list(results["workloads"])
    fig, grid = plt.subplots(2, 3, figsize=(10, 6))
    fig.suptitle(title, fontsize=11)
    panels = list(grid.flat)
    for ax, key in zip(panels, keys):
        ax.set_title(f"({key}) {results['workloads'][key]['title']}", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(True, which="major", alpha=0.3)
    for ax in panels[len(keys) :]:
        ax.axis("off")
    return fig, dict(zip(keys, panels)), panels[-1]


def _legend(fig: Any, axes: dict[str, Any], legend_ax: Any) -> None:
    handles: dict[str, Any] = {}
    for ax in axes.values():
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    legend_ax.legend(
        list(handles.values()), list(handles), loc="center", fontsize=8, frameon=False
    )
    fig.tight_layout()


def _plain_ticks(axis: Any, values: list[float]) -> None:
    """Log-scaled axis labelled with the measured values as plain numbers."""
    axis.set_major_locator(FixedLocator(values))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _plot_lines(ax: Any, series: dict[str, list[tuple[float, float]]]) -> None:
    for key, points in series.items():
        if not points:
            continue
        color, marker, line = STYLES[key]
        xs, ys = zip(*points)
        ax.plot(xs, ys, color=color, marker=marker, ls=line, ms=3, label=LABELS[key])


def _by_chunk(results: dict[str, Any], value: Any) -> dict[str, Any]:
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for c in _configs(results, "chunk"):
        series = out.setdefault(c["workload"], {})
        for key in c["peers"]:
            y = value(c, key)
            if y is not None:
                series.setdefault(key, []).append((c["chunk_size"], y))
    return out


def _time_vs_vmap(c: dict[str, Any], key: str) -> float | None:
    """The median over rounds of the time over `jax.vmap`'s in the same round."""
    row, vmap = c["peers"][key], c["peers"]["vmap"]
    if "times_s" not in row:
        return None
    return statistics.median(a / b for a, b in zip(row["times_s"], vmap["times_s"]))


def plot_chunk_sizes(results: dict[str, Any], out_dir: Path) -> list[Path]:
    paths = []
    for name, value, title, ylabel in (
        (
            "memory",
            mem_ratio,
            "Memory / floor against the chunk size (1 = the floor)",
            "(temporary + output) / floor",
        ),
        (
            "time",
            _time_vs_vmap,
            "Steady-state time relative to jax.vmap",
            "time / jax.vmap's time",
        ),
    ):
        fig, axes, legend_ax = _workload_axes(results, title)
        for key, series in _by_chunk(results, value).items():
            ax = axes[key]
            _plot_lines(ax, series)
            ax.axhline(1.0, color="k", lw=0.6)
            ax.set_xscale("log")
            ax.set_yscale("log")
            _plain_ticks(ax.xaxis, sorted({x for s in series.values() for x, _ in s}))
            ys = [y for s in series.values() for _, y in s]
            _plain_ticks(ax.yaxis, _nice_ticks(min(ys + [1.0]), max(ys + [1.0])))
            ax.set_xlabel("chunk size K", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
        _legend(fig, axes, legend_ax)
        paths.append(out_dir / f"{name}.png")
        fig.savefig(paths[-1], dpi=DPI)
        plt.close(fig)
    return paths


def _nice_ticks(lo: float, hi: float) -> list[float]:
    decades = [10.0**e for e in range(-3, 4)]
    candidates = sorted({d * m for d in decades for m in (1, 1.2, 1.5, 2, 3, 5, 8)})
    if hi / lo > 4:  # a wide range: fewer, rounder ticks
        candidates = sorted({d * m for d in decades for m in (1, 2, 5)})
    ticks = [t for t in candidates if lo / 1.1 <= t <= hi * 1.1]
    return ticks or [1]


def plot_scaling(results: dict[str, Any], out_dir: Path) -> list[Path]:
    title = "XLA compile time against the batch size N, at a fixed chunk size (log)"
    fig, axes, legend_ax = _workload_axes(results, title)
    for key, configs in _scaling_groups(results).items():
        series: dict[str, list[tuple[float, float]]] = {}
        for c in configs:
            for peer, row in c["peers"].items():
                if "skipped" not in row:
                    series.setdefault(peer, []).append(
                        (c["batch_size"], row["compile_s"])
                    )
        ax = axes[key]
        _plot_lines(ax, series)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_ticks(ax.xaxis, [c["batch_size"] for c in configs])
        ys = [y for s in series.values() for _, y in s]
        _plain_ticks(ax.yaxis, _nice_ticks(min(ys), max(ys)))
        ax.set_xlabel(f"batch size N (K = {configs[0]['chunk_size']})", fontsize=8)
        ax.set_ylabel("compile seconds", fontsize=8)
    _legend(fig, axes, legend_ax)
    path = out_dir / "compile.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return [path]
