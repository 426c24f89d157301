"""``python -m graphburst``, the form ``torchrun ... -m graphburst demo --tp 2`` needs."""

import os
import sys

from .cli import main

if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank of a torchrun job: the process group is already torn down (or timed out
        # doing so); skip interpreter teardown, where NCCL's exit hooks were seen to hang.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
