"""Key ratios, target checks, the Markdown tables and the plots, from the results.

Everything here reads the results dictionary only (the JSON that `run.py` writes),
so `python benchmarks/run.py --from-json FILE` redraws the tables and plots.
"""

import math
import statistics
from pathlib import Path
from typing import Any


MIB = 2**20
FORWARD = ("a", "b", "c", "e")  # workloads whose program is a forward map
TIME_MIN_CHUNK = 16
LABELS = {
    "fc": "filter_chunked_vmap",
    "fc_separate": 'filter_chunked_vmap (remainder="separate")',
    "vmap": "jax.vmap",
    "filter_vmap": "eqx.filter_vmap",
    "lax_map": "jax.lax.map(batch_size=)",
    "loop": "Python loop (in jit)",
    "netket": "netket.jax.vmap_chunked",
}


def _ok(row: dict[str, Any]) -> bool:
    return "skipped" not in row


def mem_ratio(
    config: dict[str, Any], key: str, accumulator: bool = False
) -> float | None:
    """(temporary + output bytes) / floor; with `accumulator`, the floor includes
    the running sum a gradient over chunks needs (workload (d))."""
    row = config["peers"].get(key)
    if row is None or not _ok(row):
        return None
    floor = config["floor_bytes"]
    if accumulator:
        floor += config.get("accumulator_bytes", 0)
    return (row["temp_bytes"] + row["output_bytes"]) / floor


def time_ratio(config: dict[str, Any], key: str) -> float | None:
    """`key`'s time over the faster of `jax.vmap` and `jax.lax.map`.

    Against each, the median of the ratios of the same round's runs (the peers
    run interleaved, so a round's runs share the machine's load); then the
    larger of the two, i.e. the ratio to the faster peer.
    """
    rows = config["peers"]
    row = rows.get(key)
    if row is None or "times_s" not in row:
        return None
    ratios = [
        statistics.median(a / b for a, b in zip(row["times_s"], rows[p]["times_s"]))
        for p in ("vmap", "lax_map")
    ]
    return max(ratios)


def _configs(results: dict[str, Any], section: str) -> list[dict[str, Any]]:
    return [c for c in results["configs"] if c["section"] == section]


def _scaling_groups(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in _configs(results, "scaling"):
        groups.setdefault(c["workload"], []).append(c)
    return {w: sorted(cs, key=lambda c: c["batch_size"]) for w, cs in groups.items()}


def _first_call_s(row: dict[str, Any]) -> float:
    return row["lower_s"] + row["compile_s"]


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue with its measured figure and whether it is met."""
    chunk = _configs(results, "chunk")
    out = []
    forward = [c for c in chunk if c["workload"] in FORWARD]
    worst = max(mem_ratio(c, "fc") or 0.0 for c in forward)
    worst_sep = max(mem_ratio(c, "fc_separate") or 0.0 for c in forward)
    out.append(
        _target(
            "forward memory / floor <= 1.05 (default remainder mode), every chunk",
            worst,
            worst <= 1.05,
            f'max {worst:.3f}; remainder="separate": max {worst_sep:.3f}',
        )
    )
    reverse = [c for c in chunk if c["workload"] == "d"]
    if reverse:
        plain = max(mem_ratio(c, "fc") or 0.0 for c in reverse)
        acc = max(mem_ratio(c, "fc", accumulator=True) or 0.0 for c in reverse)
        lax = min(mem_ratio(c, "lax_map") or 0.0 for c in reverse)
        out.append(
            _target(
                "gradient through the map (d): memory / (floor + one gradient "
                "accumulator) <= 1.05 (not an issue target)",
                acc,
                acc <= 1.05,
                f"max {acc:.3f}; against the forward floor: max {plain:.3f}; "
                f"jax.lax.map (no rematerialisation): at least {lax:.2f}",
            )
        )
    if any(c["workload"] == "e" for c in chunk):
        out.append(_unmapped_target(chunk))
    timed = [c for c in chunk if c["chunk_size"] >= TIME_MIN_CHUNK]
    times = [time_ratio(c, "fc") or 0.0 for c in timed]
    each = {
        key: max(time_ratio(c, "fc") or 0.0 for c in timed if c["workload"] == key)
        for key in results["workloads"]
    }
    out.append(
        _target(
            "time <= 1.05x min(jax.vmap, jax.lax.map), chunk >= 16",
            max(times),
            max(times) <= 1.05,
            f"median {statistics.median(times):.2f}; max per workload "
            + ", ".join(f"({k}) {v:.2f}" for k, v in each.items())
            + f"; vs jax.lax.map alone, max {_vs_lax_map(timed):.2f}",
        )
    )
    out += _compile_targets(results)
    out += _retrace_targets(results)
    return out


def _vs_lax_map(configs: list[dict[str, Any]]) -> float:
    """fc's time over `jax.lax.map`'s (median of the same round's ratios)."""
    return max(
        statistics.median(
            a / b
            for a, b in zip(
                c["peers"]["fc"]["times_s"], c["peers"]["lax_map"]["times_s"]
            )
        )
        for c in configs
    )


def _target(name: str, value: float, met: bool, detail: str) -> dict[str, Any]:
    return {"target": name, "value": value, "met": bool(met), "detail": detail}


def _unmapped_target(chunk: list[dict[str, Any]]) -> dict[str, Any]:
    """`out_axes=None` outputs: same output bytes as `jax.vmap`, within the floor."""
    ens = [c for c in chunk if c["workload"] == "e"]
    extra = max(
        c["peers"]["fc"]["output_bytes"] - c["peers"]["vmap"]["output_bytes"]
        for c in ens
    )
    worst = max(mem_ratio(c, "fc") or 0.0 for c in ens)
    lax = max(mem_ratio(c, "lax_map") or 0.0 for c in ens)
    return _target(
        "`out_axes=None` outputs cost no batch-sized memory (e)",
        worst,
        extra == 0 and worst <= 1.05,
        f"output bytes vs jax.vmap: +{extra}; memory / floor max {worst:.3f} "
        f"(jax.lax.map, which must stack them: {lax:.2f})",
    )


def _compile_ratios(results: dict[str, Any], field: Any) -> dict[str, Any]:
    """Per workload: fc's compile time at 16x over 1x the batch, and fc's over
    `jax.lax.map`'s (geometric mean over the three batch sizes)."""
    out = {}
    for key, cs in _scaling_groups(results).items():
        fc = [field(c["peers"]["fc"]) for c in cs]
        lax = [field(c["peers"]["lax_map"]) for c in cs]
        out[key] = (fc[-1] / fc[0], _geomean([f / x for f, x in zip(fc, lax)]))
    return out


def _compile_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    xla = _compile_ratios(results, lambda row: row["compile_s"])
    first = _compile_ratios(results, _first_call_s)
    flat = max(f for f, _ in xla.values())
    vs_lax = _geomean([v for _, v in xla.values()])

    def _each(ratios: dict[str, Any], i: int) -> str:
        return ", ".join(f"({k}) {v[i]:.2f}" for k, v in ratios.items())

    hlo = {
        key: {c["peers"]["fc"].get("hlo_instructions") for c in cs}
        for key, cs in _scaling_groups(results).items()
    }
    same = all(len(v) == 1 for v in hlo.values())
    return [
        _target(
            "compile time flat in N: 16x the batch <= 1.2x the compile time",
            flat,
            flat <= 1.2,
            f"XLA compile {_each(xla, 0)}; with trace+lower {_each(first, 0)}; "
            f"optimised HLO {'identical in size' if same else 'differs'} at every N",
        ),
        _target(
            "compile time <= jax.lax.map's",
            vs_lax,
            vs_lax <= 1.0,
            f"geomean {vs_lax:.2f}; XLA compile {_each(xla, 1)}; with "
            f"trace+lower {_each(first, 1)}",
        ),
    ]


def _retrace_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    jit = results["jit_repeated"]
    jit_bad = sum(r["traces"] + r["compiles"] for r in jit)
    eager = [e for e in results["eager"] if e["peer"] == "fc"]
    forward = [e["calls"][1] for e in eager if e["workload"] in FORWARD]
    grads = [e["calls"][1] for e in eager if e["workload"] not in FORWARD]
    out = [
        _target(
            "no retrace or recompile on repeated jitted calls",
            jit_bad,
            jit_bad == 0,
            f"{jit_bad} traces + compilations over {2 * len(jit)} repeated calls",
        ),
        _eager_target(
            "eager calls: the second call with the same shapes compiles nothing",
            forward,
        ),
    ]
    if grads:
        out.append(
            _eager_target("eager `jax.grad` through the map (d): the same", grads)
        )
    return out


def _eager_target(name: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    compiles = sum(c["compiles"] for c in calls)
    traces = sum(c["traces"] for c in calls)
    seconds = max(c["seconds"] for c in calls)
    return _target(
        name,
        compiles,
        compiles == 0,
        f"{compiles} compilations and {traces} traces on the second call of "
        f"{len(calls)} workload(s); slowest second call {seconds * 1e3:.0f} ms",
    )


def _geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def failures(results: dict[str, Any]) -> list[str]:
    """Correctness failures: any peer whose result differs from `jax.vmap`'s."""
    bad = []
    for c in results["configs"]:
        for key, row in c["peers"].items():
            if _ok(row) and not row["correct"]:
                bad.append(
                    f"({c['workload']}) N={c['batch_size']} K={c['chunk_size']} "
                    f"{LABELS[key]}: max relative error {row['max_rel_error']}"
                )
    return bad


# ---------------------------------------------------------------- Markdown


def _mib(x: float | None) -> str:
    return "" if x is None else f"{x / MIB:,.1f}"


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def targets_table(results: dict[str, Any]) -> str:
    rows = [
        [t["target"], "met" if t["met"] else "**missed**", t["detail"]]
        for t in targets(results)
    ]
    return _table(["target", "status", "measured"], rows)


def _ratio_rows(
    results: dict[str, Any], value: Any, peers: tuple[str, ...], spec: str
) -> list[list[str]]:
    rows = []
    for c in _configs(results, "chunk"):
        n, k = c["batch_size"], c["chunk_size"]
        cells = [f"({c['workload']})", str(n), str(k), str(n % k)]
        rows.append(cells + [_fmt(value(c, p), spec) for p in peers])
    return rows


MEMORY_PEERS = ("fc", "fc_separate", "lax_map", "vmap")
TIME_PEERS = ("fc", "fc_separate", "lax_map", "vmap")
_SHORT = {
    "fc": "fc",
    "fc_separate": "fc, separate",
    "lax_map": "lax.map",
    "vmap": "vmap",
}


def memory_table(results: dict[str, Any]) -> str:
    """Per workload and chunk size: memory / floor of each implementation."""
    header = ["", "N", "K", "N mod K"] + [_SHORT[p] for p in MEMORY_PEERS]
    return _table(header, _ratio_rows(results, mem_ratio, MEMORY_PEERS, ".2f"))


def time_table(results: dict[str, Any]) -> str:
    """Per workload and chunk size: time over the faster of vmap and lax.map."""
    header = ["", "N", "K", "N mod K"] + [_SHORT[p] for p in TIME_PEERS]
    return _table(header, _ratio_rows(results, time_ratio, TIME_PEERS, ".2f"))


def key_ratios_table(results: dict[str, Any]) -> str:
    """Both tables, for the command line."""
    return memory_table(results) + "\n\n" + time_table(results)


def _detail_rows(configs: list[dict[str, Any]], cells: Any) -> list[list[str]]:
    rows = []
    for c in configs:
        for key, row in c["peers"].items():
            head = [str(c["chunk_size"]), LABELS[key]]
            rows.append(
                head + ([row["skipped"]] if not _ok(row) else cells(c, key, row))
            )
    return rows


def _detail_table(configs: list[dict[str, Any]]) -> str:
    """Memory, time and correctness of every implementation."""
    cells = lambda c, key, row: [
        _mib(row["temp_bytes"]),
        _mib(row["output_bytes"]),
        _fmt(mem_ratio(c, key), ".3f"),
        _fmt(row.get("time_s", 0) * 1e3, ".1f"),
        _fmt(time_ratio(c, key)),
        "yes" if row["correct"] else "**NO**",
    ]
    header = ["K", "implementation", "temp MiB", "output MiB", "mem/floor"]
    header += ["time ms", "time / best", "matches vmap"]
    return _table(header, _detail_rows(configs, cells))


def _compile_table(configs: list[dict[str, Any]]) -> str:
    """Trace and compile times, and the growth of the resident set in one call."""
    cells = lambda c, key, row: [
        _fmt(row["lower_s"], ".3f"),
        _fmt(row["compile_s"], ".3f"),
        _mib(row["rss_delta_bytes"]),
    ]
    header = ["K", "implementation", "trace+lower s", "compile s", "RSS growth MiB"]
    return _table(header, _detail_rows(configs, cells))


def _scaling_table(configs: list[dict[str, Any]]) -> str:
    rows = []
    for key in configs[0]["peers"]:
        for c in configs:
            row = c["peers"][key]
            cells = [LABELS[key], str(c["batch_size"])]
            if not _ok(row):
                rows.append(cells + ["skipped", "", "", ""])
                continue
            rows.append(
                cells
                + [
                    _fmt(mem_ratio(c, key), ".2f"),
                    _fmt(row["compile_s"], ".3f"),
                    _fmt(row["lower_s"], ".3f"),
                    str(row.get("hlo_instructions", "")),
                ]
            )
    header = [
        "implementation",
        "N",
        "mem/floor",
        "compile s",
        "trace+lower s",
        "HLO instr.",
    ]
    return _table(header, rows)


def _eager_table(results: dict[str, Any]) -> str:
    rows = []
    for e in results["eager"]:
        first, second, third = e["calls"]
        rows.append(
            [
                f"({e['workload']})",
                LABELS[e["peer"]],
                str(e["chunk_size"]),
                f"{first['traces']} / {first['compiles']}",
                f"{second['traces']} / {second['compiles']}",
                _fmt(first["seconds"] * 1e3, ".1f"),
                _fmt(second["seconds"] * 1e3, ".1f"),
                _fmt(third["seconds"] * 1e3, ".1f"),
            ]
        )
    header = [
        "workload",
        "implementation",
        "K",
        "1st call traces / compiles",
        "2nd call traces / compiles",
        "1st call ms",
        "2nd call ms",
        "3rd call ms",
    ]
    return _table(header, rows)


def headline_chunk_size(results: dict[str, Any]) -> int:
    """A chunk size measured on every workload, not dividing most batch sizes."""
    chunk = _configs(results, "chunk")
    sizes = {k: [c for c in chunk if c["chunk_size"] == k] for k in _chunk_sizes(chunk)}
    common = [k for k, cs in sizes.items() if len(cs) == len(results["workloads"])]
    return max(
        common or list(sizes),
        key=lambda k: sum(c["batch_size"] % k != 0 for c in sizes[k]),
    )


def _chunk_sizes(configs: list[dict[str, Any]]) -> list[int]:
    return sorted({c["chunk_size"] for c in configs})


def _hardware(meta: dict[str, Any]) -> str:
    """ "AMD EPYC, 2 cores; JAX backend cpu" -> "a CPU (AMD EPYC, 2 cores)"."""
    machine, _, backend = meta["machine"].partition("; JAX backend ")
    device = "a CPU" if backend in ("cpu", "") else f"a {backend.upper()}"
    versions = ", ".join(
        v for v in meta["versions"].split(", ") if v.split()[0] in ("jax", "equinox")
    )
    return f"{device} ({machine}; {versions})"


def _range(xs: list[float]) -> str:
    return f"{min(xs):.2f}x-{max(xs):.2f}x"


def headline_markdown(results: dict[str, Any]) -> str:
    """What it costs, on which hardware, against what: three lines."""
    chunk = _configs(results, "chunk")
    forward = [c for c in chunk if c["workload"] in FORWARD]
    grads = [c for c in chunk if c["workload"] not in FORWARD]
    fc = [mem_ratio(c, "fc") or 0.0 for c in forward]
    vmap = max(mem_ratio(c, "vmap") or 0.0 for c in forward)
    lax = max(mem_ratio(c, "lax_map") or 0.0 for c in forward)
    times = {c["workload"]: [] for c in chunk}
    for c in chunk:
        if c["chunk_size"] >= TIME_MIN_CHUNK:
            times[c["workload"]].append(time_ratio(c, "fc") or 0.0)
    slow = max(times, key=lambda w: max(times[w]))
    rest = [t for w, ts in times.items() if w != slow for t in ts]
    every = [t for ts in times.values() for t in ts]
    xla = _compile_ratios(results, lambda row: row["compile_s"])
    lines = [
        f"Measured on {_hardware(results['meta'])}, over five workloads and "
        "chunk sizes `K` from "
        f"{_chunk_sizes(chunk)[0]} to {_chunk_sizes(chunk)[-1]}, against "
        "`jax.vmap` and `jax.lax.map(f, xs, batch_size=K)`:",
        "",
        f"- **Memory**: {_range(fc)} the floor (the outputs plus one chunk's "
        f"working set), against up to {vmap:.0f}x for `jax.vmap` and "
        f"{lax:.1f}x for `jax.lax.map`; on a gradient through the map, "
        f"{_range([mem_ratio(c, 'fc') or 0.0 for c in grads])} against "
        f"`jax.lax.map`'s "
        f"{_range([mem_ratio(c, 'lax_map') or 0.0 for c in grads])}.",
        f"- **Time**: median {statistics.median(every):.2f}x the faster of the two "
        f"({_range(rest)} on the other workloads; {_range(times[slow])} on "
        f"{results['workloads'][slow]['title']}, where writing the output "
        "dominates).",
        f"- **Compile time**: {_geomean([v for _, v in xla.values()]):.2f}x "
        "`jax.lax.map`'s (geometric mean), and the same at 16 times the batch "
        f"({_range([f for f, _ in xla.values()])}).",
        "",
    ]
    return "\n".join(lines)


def alt_text(results: dict[str, Any], name: str) -> str:
    """A description of each plot for readers who cannot see it."""
    chunk = _configs(results, "chunk")
    ks = _chunk_sizes(chunk)
    mem = {p: [mem_ratio(c, p) or 0.0 for c in chunk] for p in ("fc", "vmap")}
    lax = [mem_ratio(c, "lax_map") or 0.0 for c in chunk]
    if name == "headline":
        k = headline_chunk_size(results)
        cs = [c for c in chunk if c["chunk_size"] == k]
        return (
            f"Bar chart of memory over the floor at chunk size {k}, one group of "
            "bars per workload: filter_chunked_vmap "
            f"{_range([mem_ratio(c, 'fc') or 0.0 for c in cs])}, jax.lax.map "
            f"{_range([mem_ratio(c, 'lax_map') or 0.0 for c in cs])}, jax.vmap "
            f"{_range([mem_ratio(c, 'vmap') or 0.0 for c in cs])}."
        )
    if name == "memory":
        return (
            "Five log-log panels, one per workload, of memory over the floor "
            f"against the chunk size ({ks[0]} to {ks[-1]}): filter_chunked_vmap "
            f"stays between {min(mem['fc']):.2f} and {max(mem['fc']):.2f} in "
            f"every panel; jax.vmap falls from {max(mem['vmap']):.0f} as the "
            f"chunk grows; jax.lax.map reaches up to {max(lax):.1f}, highest on "
            "the gradient through the map."
        )
    if name == "time":
        fc = [time_ratio(c, "fc") or 0.0 for c in chunk]
        return (
            "Five log-log panels, one per workload, of the time over the faster "
            "of jax.vmap and jax.lax.map against the chunk size: "
            f"filter_chunked_vmap between {min(fc):.2f} and {max(fc):.2f}, "
            "the Python loop the slowest."
        )
    return (
        "Five log-log panels, one per workload, of the XLA compile time against "
        "the batch size at a fixed chunk size: flat for filter_chunked_vmap, "
        "jax.vmap and jax.lax.map; growing with the batch for the Python loop."
    )


def image(results: dict[str, Any], path: str) -> str:
    """A Markdown image with its alt text, linked to itself: a tap on a phone
    opens the plot at full size."""
    return f"[![{alt_text(results, Path(path).stem)}]({path})]({path})"


def _provenance(results: dict[str, Any]) -> str:
    meta = results["meta"]
    return (
        f"Measured {meta['date']} with `{meta['command']}` "
        f"({meta['runtime_s'] / 60:.0f} minutes) on {_hardware(meta)}."
    )


def page_blocks(results: dict[str, Any], prefix: str) -> dict[str, str]:
    """The generated blocks of `docs/performance.md`, by name."""
    return {
        "headline": "\n".join(
            [headline_markdown(results), image(results, f"{prefix}headline.svg")]
        ),
        "memory": "\n".join(
            [
                memory_table(results),
                "",
                image(results, f"{prefix}memory.svg"),
            ]
        ),
        "time": "\n".join(
            [time_table(results), "", image(results, f"{prefix}time.svg")]
        ),
        "compile": image(results, f"{prefix}compile.svg"),
        "provenance": _provenance(results),
    }


def targets_markdown(results: dict[str, Any]) -> str:
    """The block `benchmarks/README.md` embeds: the targets, met or missed."""
    return "\n".join([_provenance(results), "", targets_table(results)])


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    parts = [
        "# Benchmark results",
        "",
        "Every table of the last full run of `python benchmarks/run.py`, from "
        "which the [Performance](../performance.md) page is drawn; that page "
        "says how to read them.",
        "",
        f"- Date: {meta['date']}; runtime {meta['runtime_s']:.0f} s",
        f"- Machine: {meta['machine']}",
        f"- Versions: {meta['versions']}",
        f"- Timing: median of {meta['repeats']} interleaved rounds, after "
        f"{meta['warmup']} warm-up round; 'best' is the faster of `jax.vmap` and "
        "`jax.lax.map(batch_size=)` at the same chunk size.",
        "",
    ]
    for key, info in results["workloads"].items():
        configs = [c for c in _configs(results, "chunk") if c["workload"] == key]
        floor = ", ".join(
            f"K={c['chunk_size']}: {_mib(c['floor_bytes'])}" for c in configs
        )
        parts += [
            f"## ({key}) {info['title']}",
            "",
            info["description"] + f" N = {configs[0]['batch_size']}.",
            "",
            f"Floor (MiB): {floor}.",
            "",
            _detail_table(configs),
            "",
            "Compile time and resident memory:",
            "",
            _compile_table(configs),
            "",
        ]
    parts += ["## Scaling: N x1, x4, x16 at a fixed chunk size", ""]
    for key, configs in _scaling_groups(results).items():
        parts += [
            f"### ({key}) {results['workloads'][key]['title']}, "
            f"K = {configs[0]['chunk_size']}",
            "",
            _scaling_table(configs),
            "",
        ]
    parts += [
        "## Eager calls and repeated calls",
        "",
        "Un-jitted calls with the same shapes; traces and compilations counted "
        "with `jax.monitoring`.",
        "",
        _eager_table(results),
        "",
    ]
    return "\n".join(parts)
