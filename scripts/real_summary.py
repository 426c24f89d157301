"""One line per config of a ``graphburst bench real --json`` file: each engine's tokens/s, µs per
round and x floor, and every engine that did not run with its reason (for a batch log).

    python3 scripts/real_summary.py OUT/real_small.json [OUT/real_1b.json ...]
"""

from __future__ import annotations

import json
import sys


def lines(doc: dict) -> list[str]:
    """The summary lines of one bench-real JSON document (``{"meta": ..., "results": ...}``)."""
    out = []
    for cfg in doc["results"]["configs"]:
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
        cells += [f"{name} {why}" for name, why in cfg.get("not_run", {}).items() if name != "hf"]
        out.append(f"{head}: " + "; ".join(cells))
    out += [f"FAILURE: {f}" for f in doc["meta"].get("failures", [])]
    return out


def main(argv) -> int:
    for path in argv:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"{path}: no results ({type(exc).__name__}: {exc})")
            continue
        for line in lines(doc):
            print(f"{path}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
