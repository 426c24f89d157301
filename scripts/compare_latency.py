"""Thin entry point: the same as ``graphburst bench latency``.

Usage: PYTHONPATH=. python3 scripts/compare_latency.py [--json FILE] [...] (see ``graphburst bench latency --help``)
"""

import sys

from graphburst.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "latency", *sys.argv[1:]]))
