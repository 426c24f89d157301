"""Latency comparison of every burst mode; the same as ``graphburst bench``.

Usage: PYTHONPATH=. python3 scripts/compare_latency.py [--quick] [--json FILE]
"""

import sys

from graphburst.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
