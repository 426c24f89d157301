"""Every transfer in the package names its stream: a source check, no GPU needed.

``cupy.asarray(host)``, ``ndarray.get()`` and ``cupy.asnumpy`` work on the *current* stream,
the legacy default stream unless a ``with stream:`` is open, and the decoder's non-blocking
stream does not wait for it. On a shared GPU (``pytest -n 4``, or a second server) an upload
then landed after the kernel that read it, and a read returned values from before the writes
it was meant to see. The one right way is the backend's: ``to_device(host, stream)``,
``upload(dst, host, stream)``, ``to_host(arr, stream)`` (each refuses a missing stream on
cupy). This check refuses the bare calls anywhere else in ``graphburst/`` and ``tools/``,
and a literal ``None`` passed as the stream of the backend's transfers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "graphburst").rglob("*.py"), *(ROOT / "tools").rglob("*.py")])

#: receivers that name CuPy (or an array module that may be CuPy: a backend's ``xp``)
CUPY_NAMES = {"cp", "cupy", "xp"}
#: the backend's transfers -> the position of their stream argument
STREAM_POSITION = {"to_device": 1, "to_host": 1, "upload": 2, "copy_to_host": 2, "scatter": 3, "copy_rows": 3}

#: (file, function) -> why a bare call is right there
ALLOWED = {
    ("graphburst/backend.py", "to_device"): "the helper itself: the copy runs under `with stream:`",
    ("graphburst/backend.py", "scatter"): "the helper itself: the index and value copies run under `with stream:`",
    ("graphburst/backend.py", "copy_rows"): "the helper itself: the index copy runs under `with stream:`",
}


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_none(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


#: keywords of a queue's ``get`` (``queue.Queue.get(block=, timeout=)``): no array read
QUEUE_KEYWORDS = {"block", "timeout"}


def _problem(call: ast.Call, awaited: bool = False) -> str | None:
    """What is wrong with one call (``awaited``: an asyncio queue's ``await q.get()``), or None."""
    if not isinstance(call.func, ast.Attribute):
        return None
    attr, receiver = call.func.attr, _dotted(call.func.value).rsplit(".", 1)[-1]
    kwargs = {k.arg: k.value for k in call.keywords}
    if attr in ("asarray", "array") and receiver in CUPY_NAMES | {"backend"}:
        return f"{receiver}.{attr}(...) copies on the current stream: use backend.to_device(host, stream)"
    if attr == "asnumpy" and receiver in CUPY_NAMES and ("stream" not in kwargs or _is_none(kwargs["stream"])):
        return f"{receiver}.asnumpy(...) without a stream reads on the current stream: use backend.to_host(arr, stream)"
    if attr == "get" and not call.args and not awaited and not QUEUE_KEYWORDS & kwargs.keys() and \
            ("stream" not in kwargs or _is_none(kwargs["stream"])) and not any(k.arg is None for k in call.keywords):
        return ".get() without a stream reads on the current stream: use backend.to_host(arr, stream)"
    if attr == "memcpy" and receiver in ("runtime", "rt"):
        return "runtime.memcpy is a copy on the legacy stream: use a stream-ordered backend helper"
    at = STREAM_POSITION.get(attr)
    if at is not None:
        stream = kwargs.get("stream", call.args[at] if len(call.args) > at else None)
        if stream is not None and _is_none(stream):
            return f"{attr}(..., None): name the stream that orders the transfer"
    return None


def findings(source: str, path: str) -> list[str]:
    """``path:line: problem`` for each bare transfer in ``source`` outside :data:`ALLOWED`."""
    out = []

    def visit(node, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and (path, function) not in ALLOWED:
                problem = _problem(child, awaited=isinstance(node, ast.Await))
                if problem:
                    out.append(f"{path}:{child.lineno}: {problem}")
            visit(child, name)

    visit(ast.parse(source), "")
    return out


def test_the_package_names_a_stream_for_every_transfer():
    found = []
    for p in SOURCES:
        found += findings(p.read_text(), p.relative_to(ROOT).as_posix())
    assert not found, "transfers on the current stream:\n" + "\n".join(found)


def test_every_allowed_place_still_exists():
    """An allow-list entry whose function is gone would let a new bare call in silently."""
    for path, function in ALLOWED:
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert function in names, f"{path} has no function {function!r}: drop its ALLOWED entry"


@pytest.mark.parametrize("line", [
    "dev = cp.asarray(host)",
    "dev = cupy.asarray(host, dtype=np.int32)",
    "dev = self.backend.xp.asarray(host)",
    "dev = xp.array([1, 2])",
    "host = arr.get()",
    "host = arr.get(stream=None)",
    "host = cupy.asnumpy(arr)",
    "backend.to_host(arr, None)",
    "backend.upload(dst, host, None)",
    "backend.to_device(host, stream=None)",
    "backend.scatter(dst, rows, 0, None)",
    "rt.memcpy(dst, src, n, kind)",
])
def test_the_check_refuses_each_bare_transfer(line):
    assert findings(f"def f():\n    {line}\n", "graphburst/x.py"), line


@pytest.mark.parametrize("line", [
    "dev = np.asarray(host)",
    "dev = backend.to_device(host, stream)",
    "host = arr.get(stream=stream)",
    "host = cupy.asnumpy(arr, stream=s)",
    "value = options.get('seed')",
    "item = lines.get(block=True, timeout=0.1)",
    "item = await queue.get()",
    "backend.to_host(arr, stream)",
    "backend.upload(dst, host, self.stream)",
    "graph.upload(stream)",
    "rt.memcpyAsync(dst, src, n, kind, stream.ptr)",
])
def test_the_check_passes_the_stream_ordered_forms(line):
    assert not findings(f"async def f():\n    {line}\n", "graphburst/x.py"), line


def test_the_allow_list_is_per_function():
    src = "def scatter():\n    xp.asarray(rows)\n\ndef other():\n    xp.asarray(rows)\n"
    assert [f.split(": ", 1)[0] for f in findings(src, "graphburst/backend.py")] == ["graphburst/backend.py:5"]


def test_the_numpy_backend_copies_and_needs_no_stream():
    """On numpy a stream is program order: any (or none) is accepted, and ``to_device`` copies, as a
    device copy would, so writing the result never changes the caller's array."""
    from graphburst.backend import Backend
    from graphburst.buffers import PtrTable

    be = Backend("numpy")
    host = np.arange(3, dtype=np.int32)
    dev = be.to_device(host, None)
    dev[0] = 9
    assert host.tolist() == [0, 1, 2] and be.to_host(dev, None).tolist() == [9, 1, 2]
    assert be.to_device(host, be.current_stream(), dtype=np.int64).dtype == np.int64
    table = PtrTable([dev, None], be)
    first, second = table.resolve()
    assert first is dev and second is None and table.ptrs.dtype == np.uint64
