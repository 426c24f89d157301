"""Thin entry point: the same as ``graphburst bench serve``.

Usage: PYTHONPATH=. python3 scripts/serve_bench.py [--json FILE] [...] (see ``graphburst bench serve --help``)
"""

import sys

from graphburst.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
