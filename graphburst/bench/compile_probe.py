"""Build the torch.compile engine in a child process first: a compiler crash (a segfault, rc 139,
was seen on the H200) kills only the child, and ``graphburst bench real`` reports the engine
``not run`` instead of dying.

    python -m graphburst.bench.compile_probe MODEL BATCH K CAPACITY PROMPT_LEN DTYPE

Random weights of ``MODEL``'s shape (what the compiler sees is the shapes, not the values);
exit status 0 once the engine has prefilled and run two rounds.
"""

from __future__ import annotations

import signal
import subprocess
import sys

#: seconds the probe may take (compiling a 1B forward takes about a minute)
PROBE_TIMEOUT_S = 900


def probe(spec, batch: int, k: int, capacity: int, prompt_len: int, dtype: str,
          timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the compile engine cannot run (its child's exit status and last words), or None if it ran."""
    cmd = [sys.executable, "-m", "graphburst.bench.compile_probe", spec.name, str(batch), str(k), str(capacity),
           str(prompt_len), dtype]
    return child_verdict(cmd, timeout_s)


def child_verdict(cmd: list, timeout_s: float) -> str | None:
    """Run ``cmd``; None if it exits 0, else one ``not run: ...`` line (a signal, a status, a timeout)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"not run: torch.compile probe took over {timeout_s:g} s"
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:  # killed by a signal (a compiler segfault: SIGSEGV, the shell's rc 139)
        try:
            how = f"signal {-proc.returncode} ({signal.Signals(-proc.returncode).name})"
        except ValueError:
            how = f"signal {-proc.returncode}"
    else:
        how = f"exit status {proc.returncode}"
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"not run: torch.compile probe died ({how}): {tail}"[:300]


def main(argv) -> int:
    import torch

    from .real_engines import TorchLoop
    from .real_models import MODELS, random_target

    name, batch, k, capacity, prompt_len, dtype = argv
    batch, k, capacity, prompt_len = int(batch), int(k), int(capacity), int(prompt_len)
    spec = MODELS[name]
    src = random_target(spec, batch=batch, capacity=capacity, kv_slack=k + 2, dtype=getattr(torch, dtype),
                        device="cuda")
    eng = TorchLoop(src, compile_forward=True, draft_layers=spec.draft_layers, batch=batch, k=k)
    eng.prefill([[0] * prompt_len] * batch)
    eng.run(2)
    torch.cuda.synchronize()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
