"""Benchmarks `filter_chunked_vmap` against its peers: memory, time, compile time.

    python benchmarks/run.py            # full run: docs/benchmarks/ + results JSON
    python benchmarks/run.py --quick    # CI: small sizes, fails if a result is wrong

See `benchmarks/README.md` for what is measured and `docs/performance.md` for how
to read the figures.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
from _measure import CompileCounter, peak_rss_bytes
from _peers import netket_available, peers
from _plots import plot_chunk_sizes, plot_headline, plot_scaling
from _report import (
    failures,
    key_ratios_table,
    markdown,
    page_blocks,
    targets,
    targets_markdown,
    targets_table,
)
from _runner import (
    cpu_model,
    eager_calls,
    jit_repeated_calls,
    measure_config,
    refine_compile_times,
)
from _workloads import workloads


ROOT = Path(__file__).resolve().parent.parent
FULL_JSON = Path("benchmarks") / "results" / "full.json"
FULL_DOCS = Path("docs") / "benchmarks"
QUICK_SCALING = ("fc", "vmap", "lax_map")
REFINED = ("fc", "fc_separate", "vmap", "lax_map")
PERFORMANCE_PAGE = Path("docs") / "performance.md"
README = Path("benchmarks") / "README.md"


def _netket_version() -> str | None:
    try:
        return importlib.metadata.version("netket")
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_name(device: Any) -> str:
    kind = device.device_kind
    return device.platform if kind == device.platform else f"{device.platform} ({kind})"


def _meta(command: str, quick: bool) -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "command": command,
        "mode": "quick" if quick else "full",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores; JAX backend "
        + _device_name(device),
        "versions": f"jax {jax.__version__}, equinox {eqx.__version__}, "
        f"python {platform.python_version()}"
        + (f", netket {_netket_version()}" if _netket_version() else ""),
        "netket": _netket_version(),
        "load_before": round(os.getloadavg()[0], 2),
    }


_START = time.perf_counter()


def _log(*parts: Any) -> None:
    print(f"[{time.perf_counter() - _START:6.1f} s]", *parts, flush=True)


def run(quick: bool, only: set[str] | None) -> dict[str, Any]:
    counter = CompileCounter()
    all_peers = peers(quick)
    if not netket_available():
        _log("netket is not installed: skipping netket.jax.vmap_chunked")
    timing = dict(warmup=1, repeats=5 if quick else 7)
    results: dict[str, Any] = {"configs": [], "eager": [], "jit_repeated": []}
    results["workloads"] = {}
    fc_peer = all_peers[0]
    for w in workloads(quick):
        if only and w.key not in only:
            continue
        results["workloads"][w.key] = {"title": w.title, "description": w.description}
        for k in w.sizes.chunk_sizes:
            _log(f"({w.key}) {w.title}: N={w.sizes.batch_size} K={k}")
            results["configs"].append(
                measure_config(
                    w,
                    all_peers,
                    w.sizes.batch_size,
                    k,
                    section="chunk",
                    **timing,
                )
            )
        # Scaling: the targets need fc and jax.lax.map at 1x and 16x the batch
        # (and jax.vmap for the floor); the full run shows every peer at 4x too.
        scaling_peers = [p for p in all_peers if p.key in QUICK_SCALING or not quick]
        scaling = []
        for factor in (1, 16) if quick else (1, 4, 16):
            n, k = w.sizes.scaling_base * factor, w.sizes.scaling_chunk
            _log(f"({w.key}) {w.title}: scaling N={n} K={k}")
            scaling.append(
                measure_config(
                    w, scaling_peers, n, k, section="scaling", warmup=1, repeats=3
                )
            )
        # Compile times for the targets: the fastest of several fresh compilations.
        refined = [p for p in scaling_peers if p.key in REFINED]
        refine_compile_times(w, refined, scaling, repeats=2 if quick else 9)
        results["configs"] += scaling
        k = w.sizes.chunk_sizes[-1]
        for peer in all_peers[:1] if quick else all_peers[:2]:
            results["eager"].append(eager_calls(w, peer, k, counter))
        results["jit_repeated"].append(jit_repeated_calls(w, fc_peer, k, counter))
    results["meta_timing"] = timing
    return results


def write_outputs(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_headline(results, out_dir)
    plot_chunk_sizes(results, out_dir)
    plot_scaling(results, out_dir)
    (out_dir / "results.md").write_text(markdown(results))
    if out_dir.resolve() == (ROOT / FULL_DOCS).resolve():
        _update_page(PERFORMANCE_PAGE, page_blocks(results, "benchmarks/"))
        _update_page(README, {"targets": targets_markdown(results)})


def _update_page(path: Path, blocks: dict[str, str]) -> None:
    """Replaces each generated block `name` of the page at `path`, between
    `<!-- benchmarks/run.py: begin name -->` and `<!-- ...: end name -->`."""
    page = ROOT / path
    text = page.read_text() if page.exists() else ""
    for name, content in blocks.items():
        begin = f"<!-- benchmarks/run.py: begin {name} -->"
        end = f"<!-- benchmarks/run.py: end {name} -->"
        if begin not in text or end not in text:
            _log(f"{path} has no generated block {name!r}: not updated")
            continue
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + "\n".join([begin, content, end]) + tail
    page.write_text(text)


def summary(results: dict[str, Any]) -> str:
    return "\n\n".join([targets_table(results), key_ratios_table(results)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast CI mode")
    parser.add_argument("--out", type=Path, help="folder for the table and plots")
    parser.add_argument("--only", help="comma-separated workload keys, e.g. a,c")
    parser.add_argument("--from-json", type=Path, help="redraw from saved results")
    opts = parser.parse_args()
    # Paths given on the command line are relative to where it was run.
    opts.out = opts.out and opts.out.resolve()
    opts.from_json = opts.from_json and opts.from_json.resolve()
    os.chdir(ROOT)
    if opts.from_json:
        results = json.loads(opts.from_json.read_text())
    else:
        command = "python benchmarks/run.py" + (" --quick" if opts.quick else "")
        command += f" --only {opts.only}" if opts.only else ""
        meta = _meta(command, opts.quick)
        start = time.perf_counter()
        only = set(opts.only.split(",")) if opts.only else None
        results = run(opts.quick, only)
        results["meta"] = meta | {
            "runtime_s": time.perf_counter() - start,
            "load_after": round(os.getloadavg()[0], 2),
            "peak_rss_mib": round(peak_rss_bytes() / 2**20),
        }
        results["meta"] |= results.pop("meta_timing")
    out_dir = opts.out
    if out_dir is None:
        default = opts.quick or opts.only or opts.from_json
        out_dir = Path(tempfile.mkdtemp(prefix="fc_bench_")) if default else FULL_DOCS
    if not opts.from_json:
        json_path = FULL_JSON if out_dir == FULL_DOCS else out_dir / "results.json"
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1) + "\n")
        _log(f"Results written to {json_path}")
    write_outputs(results, out_dir)
    _log(summary(results))
    _log(f"\nTables and plots written to {out_dir}")
    bad = failures(results)
    for line in bad:
        _log("WRONG RESULT:", line)
    missed = [t["target"] for t in targets(results) if not t["met"]]
    _log("Targets missed:", "; ".join(missed) if missed else "none")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
