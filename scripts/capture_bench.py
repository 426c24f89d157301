"""Thin entry point: the same as ``graphburst bench capture``.

Usage: PYTHONPATH=. python3 scripts/capture_bench.py [--json FILE] [...] (see ``graphburst bench capture --help``)
"""

import sys

from graphburst.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "capture", *sys.argv[1:]]))
