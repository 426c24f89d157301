"""The zero-cost ``refill`` workload under two versions of graphburst, interleaved in one process.

A lease's host speed drifts 1.5-2x within minutes, so runs of two code versions in sequence,
or in two processes, compare the host more than the code. Here the working tree's
``graphburst`` and another commit's (extracted with ``git archive`` into a temporary
directory and imported under the name ``gb_base``: the package imports itself relatively)
run alternately, each repeat in the opposite order, in one process on one device.

The workload is ``scripts/admit_profile.py``'s (256 requests of 16 prompt and 256 new tokens
through 64 slots of zero-cost stubs, k=4), at each M and pipeline depth. Every request must get
all its tokens. Reports, per version: GPU idle (median and runs), wall ms, median time to
first token, bursts; and in how many pairs the working tree idled less.

Usage: ``PYTHONPATH=. python scripts/version_ab.py --base COMMIT | --base-tree DIR [-m 8 16] [--depth 4]
[--repeats 8] [--json FILE]``
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, ".")
import graphburst  # noqa: E402

BASE_NAME = "gb_base"
PROMPT, NEW, REQUESTS, BATCH, K = 16, 256, 256, 64, 4
# the lazy-import table of graphburst/__init__.py names modules absolutely
_ABSOLUTE = re.compile(r"([\"'])graphburst\.")


def import_base(commit: str | None, into: pathlib.Path, repo: str = ".", tree: str | None = None):
    """``graphburst/`` of ``commit`` in the git repository ``repo`` (or the copy of it in the directory
    ``tree``, for a machine without the repository), importable as :data:`BASE_NAME`."""
    package = into / BASE_NAME
    if tree is not None:
        shutil.copytree(pathlib.Path(tree) / "graphburst", package)
    else:
        archive = subprocess.run(["git", "-C", repo, "archive", commit, "graphburst"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        (into / "graphburst").rename(package)
    for path in package.rglob("*.py"):
        text = path.read_text()
        if _ABSOLUTE.search(text):
            path.write_text(_ABSOLUTE.sub(rf"\g<1>{BASE_NAME}.", text))
    sys.path.insert(0, str(into))
    return importlib.import_module(BASE_NAME)


def serve_checked(loop, reqs: list, new: int, label: str = "") -> tuple:
    """Submit ``reqs`` to a warmed ``loop`` (of any graphburst version) and serve them to the end,
    timed; every request must get ``new`` tokens. Returns ``(states, wall ms, GPU busy ms, GPU idle
    ms)`` of the pass (busy and idle 0 without a device clock)."""
    clock = loop.pipeline.clock
    busy0, idle0 = clock.overall.busy_ms, clock.overall.idle_ms
    states = [loop.submit(r) for r in reqs]
    t0 = time.perf_counter()
    loop.run_until_idle()
    wall = (time.perf_counter() - t0) * 1e3
    bad = [s.request.id for s in states if s.error or len(s.tokens) != new]
    assert not bad, f"{label}requests without all their tokens: {bad[:5]}"
    return states, wall, clock.overall.busy_ms - busy0, clock.overall.idle_ms - idle0


def run(pkg, backend_name: str, m: int, depth: int) -> dict:
    """One pass of the workload through ``pkg``'s serving loop, after a warm-up request."""
    backend_mod = importlib.import_module(f"{pkg.__name__}.backend")
    common = importlib.import_module(f"{pkg.__name__}.bench.common")
    loop_mod = importlib.import_module(f"{pkg.__name__}.serving.loop")
    backend = backend_mod.get_backend(backend_name)
    rng = np.random.default_rng(0)
    target, draft = common.stub_models(backend, batch=BATCH, capacity=64 + NEW + m * (K + 1))
    reqs = [loop_mod.Request(rng.integers(0, common.VOCAB, PROMPT).tolist(), NEW, options={"seed": i})
            for i in range(REQUESTS)]
    loop = loop_mod.ServeLoop(target, draft, k=K, m_rounds=m, depth=depth)
    loop.submit(loop_mod.Request([1, 2, 3], m * (K + 1)))
    loop.run_until_idle()  # compiles kernels, captures the graph
    states, wall, busy, idle = serve_checked(loop, reqs, NEW, label=f"{pkg.__name__}: ")
    return {"code": pkg.__name__, "m": m, "depth": depth, "wall_ms": wall, "busy_ms": busy, "idle_ms": idle,
            "idle": idle / (busy + idle) if busy + idle > 0 else None, "bursts": loop.bursts,
            "deferred": getattr(loop, "deferred_boundaries", None),  # an older graphburst may have none
            "ttft_p50_ms": statistics.median((s.first_token - s.submitted) * 1e3 for s in states)}


def summarize(rows: list) -> list[str]:
    """One line per (M, depth, version), then the pairs won by the working tree."""
    lines = []
    for m, depth in sorted({(r["m"], r["depth"]) for r in rows}):
        for code in (BASE_NAME, "graphburst"):
            rs = [r for r in rows if (r["m"], r["depth"], r["code"]) == (m, depth, code)]
            idles = [r["idle"] for r in rs]
            idle = "-" if None in idles else (f"{100 * statistics.median(idles):5.1f}% (runs "
                                              f"{', '.join(f'{100 * x:.1f}' for x in idles)})")
            lines.append(f"M={m} depth={depth} {code:10s} idle {idle}, wall "
                         f"{statistics.median(r['wall_ms'] for r in rs):.2f} ms, TTFT p50 "
                         f"{statistics.median(r['ttft_p50_ms'] for r in rs):.2f} ms, {rs[0]['bursts']} bursts")
        pairs = [(a, b) for a in rows for b in rows if a["code"] == "graphburst" and b["code"] == BASE_NAME
                 and (a["m"], a["depth"]) == (m, depth) and (b["m"], b["depth"], b["rep"]) == (m, depth, a["rep"])]
        if pairs and None not in (pairs[0][0]["idle"], pairs[0][1]["idle"]):
            won = sum(a["idle"] < b["idle"] for a, b in pairs)
            lines.append(f"M={m} depth={depth}: the working tree idled less in {won} of {len(pairs)} pairs")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base = p.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", help="the commit to compare the working tree with")
    base.add_argument("--base-tree", help="a directory holding that commit's graphburst/ (from git archive)")
    p.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"))
    p.add_argument("-m", type=int, nargs="+", default=[8, 16], help="rounds per burst")
    p.add_argument("--depth", type=int, nargs="+", default=[4], help="bursts kept in flight")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = import_base(a.base, pathlib.Path(tmp), tree=a.base_tree)
        rows = []
        for rep in range(a.repeats):
            for m in a.m:
                for depth in a.depth:
                    for pkg in (base, graphburst) if rep % 2 == 0 else (graphburst, base):
                        row = run(pkg, a.backend, m, depth) | {"rep": rep}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    for line in summarize(rows):
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"base": a.base or a.base_tree, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
