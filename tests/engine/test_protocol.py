"""Protocol v1: check_pair names what is missing, options route to the models that
claim them, and no generic module knows the stubs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from graphburst import SpecDecoder, stub_pair
from graphburst.protocol import hook

PKG = Path(__file__).resolve().parents[2] / "graphburst"
# The engine (every module of engine/), the capture, the buffers and the serving loop's core.
GENERIC = tuple(sorted(str(p.relative_to(PKG).with_suffix("")) for p in (PKG / "engine").rglob("*.py"))) + (
    "capture", "buffers", "serving/loop", "serving/pipeline", "serving/intake", "serving/request")


class _Without:
    """A copy of a model's public face without one member."""

    def __init__(self, inner, drop):
        for name in ("vocab", "cache", "prefill", "verify", "draft_step"):
            if name != drop and hasattr(inner, name):
                setattr(self, name, getattr(inner, name))


@pytest.mark.parametrize("role,member", [("target", "prefill"), ("target", "verify"), ("target", "vocab"),
                                         ("target", "cache"), ("draft", "prefill"), ("draft", "draft_step")])
def test_check_pair_names_the_missing_member(role, member):
    target, draft = stub_pair(1, 50, 1, 1, 16, backend="numpy")
    models = {"target": target, "draft": draft}
    models[role] = _Without(models[role], member)
    with pytest.raises(TypeError, match=rf"{role} _Without lacks the required member '{member}'"):
        SpecDecoder(models["target"], models["draft"], k=2, m_rounds=1)


def test_check_pair_rejects_disagreeing_vocab_batch_and_bad_capture_api():
    t, _ = stub_pair(2, 50, 1, 1, 16, backend="numpy")
    _, d = stub_pair(2, 60, 1, 1, 16, backend="numpy")
    with pytest.raises(ValueError, match="target vocab 50 != draft vocab 60"):
        SpecDecoder(t, d, k=2, m_rounds=1)
    _, d = stub_pair(3, 50, 1, 1, 16, backend="numpy")
    with pytest.raises(ValueError, match="target batch 2 != draft batch 3"):
        SpecDecoder(t, d, k=2, m_rounds=1)
    _, d = stub_pair(2, 50, 1, 1, 16, backend="numpy")
    d.capture_api = "tensorflow"
    with pytest.raises(ValueError, match="draft.capture_api must be one of"):
        SpecDecoder(t, d, k=2, m_rounds=1)


@pytest.mark.parametrize("vocab,exc,msg", [(1, ValueError, "draft.vocab must be >= 2, got 1"),
                                            (50.0, TypeError, "draft.vocab must be an int, got float"),
                                            (True, TypeError, "draft.vocab must be an int, got bool")])
def test_check_pair_names_a_bad_vocab(vocab, exc, msg):
    target, draft = stub_pair(1, 50, 1, 1, 16, backend="numpy")
    duck = _Without(draft, None)
    duck.vocab = vocab
    with pytest.raises(exc, match=msg):
        SpecDecoder(target, duck, k=2, m_rounds=1)


def test_duck_typed_model_gets_the_default_hooks_and_bind_is_called():
    target, draft = stub_pair(1, 50, 1, 1, 16, backend="numpy")
    duck = _Without(draft, None)
    seen = []
    duck.bind = seen.append
    dec = SpecDecoder(target, duck, k=2, m_rounds=1)
    assert seen == [dec.bufs]
    assert dec.assemble  # writes_verify_tokens defaults to False
    assert hook(duck, "graph_buffers")() == {} and tuple(hook(duck, "watched")()) == ()
    assert hook(duck, "warm_prefill")(4) == {}  # nothing to warm before serving
    dec.prefill([[1, 2]])
    assert len(dec.run_burst()[0]) > 0


def test_stub_options_route_to_the_draft_and_reject_unknown_keys():
    target, draft = stub_pair(2, 50, 1, 1, 16, accept_prob=0.25, seed=9, backend="numpy")
    dec = SpecDecoder(target, draft, k=2, m_rounds=1)
    with pytest.raises(ValueError, match=r"unknown model option 'temp'; the models accept \['accept_prob', 'seed'\]"):
        dec.slot_options({"temp": 1})
    with pytest.raises(ValueError, match="accept_prob"):
        dec.slot_options({"accept_prob": 2.0})
    with pytest.raises(TypeError, match="options must be a dict"):
        dec.slot_options([("seed", 1)])
    dec.set_slot_options({1: dec.slot_options({"accept_prob": 1.0, "seed": 3})})
    assert draft.agree24.tolist() == [1 << 22, 1 << 24] and draft.seed.tolist() == [9, 3]
    dec.set_slot_options({1: None})
    assert draft.agree24.tolist() == [1 << 22, 1 << 22] and draft.seed.tolist() == [9, 9]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{a.name}" if not base.endswith(".") else base + a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("module", GENERIC)
def test_generic_modules_never_import_the_stubs(module):
    bad = {n for n in _imports(PKG / f"{module}.py")
           if "stubs" in n.split(".") or "Stub" in n or n.endswith("stub_pair") or "models" in n.split(".")}
    assert not bad, f"graphburst/{module}.py imports stub code: {sorted(bad)}"
    source = (PKG / f"{module}.py").read_text()
    for name in ("StubDraft", "StubTarget", "kv_table", "len_table", "for_stub", "storage_ptr_table"):
        assert name not in source, f"graphburst/{module}.py names the stub-only {name}"
