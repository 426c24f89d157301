"""The package's import graph: no circles, and no import from a lower layer to a higher one.

Every ``import`` counts, the ones inside functions too: a lazy import still ties two
modules together. The layers, lowest first:

0. base: constants, validate, guard
1. kernels/: the CUDA wrappers, their numpy twins and the module loader
2. ground: backend, buffers, burst_tokens, protocol, sampling.params
3. engine: engine/ (the burst program, the decoder, its admission, capture helpers, the host's
   bookkeeping in C), capture (``BurstGraph``), sampling.mode, sampling.fields
4. models/ (models/decode/: the Triton decode kernels and their torch oracle)
5. serving/ and the parallel runners
6. commands: the package facade, cli, cli_args, demo, serve_cli, bench/, and the parallel commands
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "graphburst"

LAYERS = {
    0: {"constants", "validate", "guard"},
    1: {"kernels"},
    2: {"backend", "buffers", "burst_tokens", "protocol", "sampling", "sampling.params"},
    3: {"engine", "capture", "sampling.mode", "sampling.fields"},
    4: {"models"},
    5: {"serving", "parallel", "parallel.dist", "parallel.check", "parallel.models", "parallel.tp", "parallel.pp",
        "parallel.runner", "parallel.lockstep"},
    6: {"", "__main__", "cli", "cli_args", "demo", "serve_cli", "bench", "parallel.launch", "parallel.serve_tp",
        "parallel.bench"},
}
# What may sit at the root of graphburst/: the commands, the base, the ground, and BurstGraph (capture.py),
# the one engine module users name by its file; the rest of the engine is engine/.
ROOT_MODULES = {"__init__", "__main__", "cli", "cli_args", "demo", "serve_cli", "constants", "validate", "guard",
                "backend", "buffers", "burst_tokens", "protocol", "capture"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def layer(mod: str) -> int:
    """The layer of a module: the most specific entry of LAYERS that names it or a package above it."""
    parts = mod.split(".") if mod else [""]
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        for rank, names in LAYERS.items():
            if key in names:
                return rank
    raise KeyError(f"graphburst.{mod} is in no layer: add it to tests/test_layers.py LAYERS")


def imports(mod: str) -> set[str]:
    """Every graphburst module ``mod`` imports, lazily or not (package-relative names)."""
    path = MODULES[mod]
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".") if pkg else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "graphburst" or node.module.startswith("graphburst.")):
                target = node.module.removeprefix("graphburst").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("graphburst."):
                    found.add(alias.name.removeprefix("graphburst."))
    found.discard(mod)
    return {m for m in found if m in MODULES}


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer(m)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_no_import_runs_up_a_layer(mod):
    up = sorted(f"{d} (layer {layer(d)})" for d in GRAPH[mod] if layer(d) > layer(mod))
    assert not up, f"graphburst.{mod or '__init__'} (layer {layer(mod)}) imports a higher layer: {up}"


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more modules: the import circles."""
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles():
    circles = find_circles(GRAPH)
    assert not circles, f"import circles: {circles}"


def test_only_commands_ground_and_engine_sit_at_the_root():
    root = {p.stem for p in PKG.glob("*.py")}
    assert root <= ROOT_MODULES, f"modules at the root of graphburst/ that belong in a folder: {sorted(root - ROOT_MODULES)}"


def test_the_checker_sees_a_planted_circle_and_an_upward_import():
    # The rules must be able to fail: plant a kernel twin importing the serving loop.
    planted = {m: set(d) for m, d in GRAPH.items()}
    planted["kernels.burst_ref"].add("serving.loop")
    assert layer("serving.loop") > layer("kernels.burst_ref")
    assert any("kernels.burst_ref" in c for c in find_circles(planted))  # the loop reaches the twins back
    assert imports("backend") >= {"kernels.cuda_ops", "kernels.reference"}  # lazy imports are seen
