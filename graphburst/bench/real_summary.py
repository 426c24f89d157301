"""``graphburst bench real --summary FILE.json ...``: one line per config of saved results, nothing run.

For the JSON of the engine comparison: each engine's tokens/s, µs per round and x floor, and
every engine that did not run with its reason; for the JSON of ``--profile``: one line per
forward config and per prefill case. Then the run's correctness failures. A batch log's
summary, without opening the JSON.
"""

from __future__ import annotations

import json

from . import real_forward, real_prefill


def load(path: str) -> dict:
    """A bench-real JSON document (``{"meta": ..., "results": ...}``); ValueError saying why it is not one."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path!r} is not JSON: {exc}") from None
    results = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(results, dict) or not any(key in results for key in ("configs", "forward", "prefill")):
        raise ValueError(f"{path!r} is not the JSON of graphburst bench real (no results.configs, .forward or .prefill)")
    return doc


def lines(doc: dict) -> list[str]:
    """The summary lines of one bench-real JSON document."""
    out = []
    for cfg in doc["results"].get("configs", []):
        head = f"{cfg['model']} B={cfg['batch']} eps={cfg['eps']:.3g}"
        if cfg.get("floor_us") is not None:
            head += f" floor {cfg['floor_us']:.0f} us"
        cells = []
        for name, r in cfg["engines"].items():
            cell = f"{name} {r['tokens_per_s']:.0f} tok/s {r['us_per_round']:.0f} us/round acc {r['acceptance']:.2f}"
            if r.get("x_floor") is not None:
                cell += f" {r['x_floor']:.3f}x floor"
            if r.get("compile_s") is not None:
                cell += f" (compiled in {r['compile_s']:.0f} s)"
            cells.append(cell)
        # HF's reason (batch 1 only) is the same in every B > 1 config: it would drown the others
        cells += [f"{name} {why}" for name, why in cfg.get("not_run", {}).items() if name != "hf"]
        out.append(f"{head}: " + "; ".join(cells))
    out += [f"forward {real_forward.summary(r)}" for r in doc["results"].get("forward", [])]
    out += [f"prefill {line}" for e in doc["results"].get("prefill", []) for line in real_prefill.summary(e)]
    out += [f"FAILURE: {f}" for f in doc.get("meta", {}).get("failures", [])]
    return out


def run(paths: list[str], console) -> int:
    """Print every file's lines, each prefixed with its path (the files were checked by the flag checks)."""
    for path in paths:
        for line in lines(load(path)):
            console.print(f"{path}: {line}", markup=False, highlight=False, soft_wrap=True)
    return 0
