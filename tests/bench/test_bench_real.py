"""``graphburst bench real``: the smoke run as a user runs it, its checks, its models.

The smoke run is the H200 benchmark's code on CPU torch and the numpy backend: the
same engines, the same correctness rules (which raise before anything is timed), the
same table, JSON and plot writers, with a tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_cli import cli as real_cli

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from graphburst.bench.real_checks import check_config, compare_other
from graphburst.models.parity import near_tie
from graphburst.bench.real_report import SAME_KERNEL_RULE  # noqa: E402
from graphburst.bench.real_engines import TorchLoop  # noqa: E402
from graphburst.bench.real_models import (MODELS, Epsilon, hf_twin, instance, random_target,  # noqa: E402
                                          shares_weights, weight_bytes)
from graphburst.bench.real_report import plot_problem  # noqa: E402
from graphburst.models.parity import first_divergence  # noqa: E402

TINY = MODELS["tiny"]
torch.set_num_threads(1)


def cli(*args, tmp_path):
    return real_cli(*args, cwd=tmp_path)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    out, png = tmp / "real.json", tmp / "real.png"
    (tmp / "prof").mkdir()
    proc = cli("--smoke", "--backend", "numpy", "--json", str(out), "--plot", str(png), "--trace", str(tmp / "prof"),
               tmp_path=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, png, out


def test_smoke_checks_every_engine_before_timing(smoke):
    res, *_ = smoke
    assert res["meta"]["backend"] == "numpy" and "CPU REFERENCE" in res["meta"]["label"]
    configs = res["results"]["configs"]
    assert {(c["model"], c["batch"]) for c in configs} == {("tiny", 1), ("tiny", 2)}
    for cfg in configs:
        engines = cfg["engines"]
        assert {"graphburst", "gapless", "vllm", "eager"} <= set(engines)
        toks = {n: engines[n]["tokens"] for n in ("graphburst", "gapless", "vllm", "eager")}
        assert len(set(toks.values())) == 1, toks  # same tokens, so the same count
        for name in ("gapless", "vllm", "eager"):
            assert engines[name]["correctness"] == dict(rule=SAME_KERNEL_RULE, reference="graphburst",
                                                        tokens=toks["graphburst"],
                                                        common_prefix_tokens=toks["graphburst"])
        rounds = engines["graphburst"]["rounds"]
        # Each round commits 1 + accepted drafts per sequence.
        acc = engines["graphburst"]["acceptance"]
        assert toks["graphburst"] == pytest.approx(cfg["batch"] * rounds * (1 + 4 * acc))
        # One sync per burst of M=2 rounds against one per round.
        assert engines["graphburst"]["syncs_per_token"] * 2 == pytest.approx(engines["vllm"]["syncs_per_token"])
        if cfg["batch"] == 1:
            hf = engines["hf"]["correctness"]
            assert hf["rule"].startswith("near-tie") and hf["sequences"][0]["agreed"] >= 1
        else:
            assert "batch 1" in cfg["not_run"]["hf"]


def test_smoke_models_sweep_targets_and_outputs(smoke):
    res, stdout, png, _ = smoke
    r = res["results"]
    info = r["models"]["tiny"]
    fp = info["fp32_check"]
    assert fp["compared"] == 16 and (fp["divergence"] is None or fp["divergence"]["ok"])
    grid = [g["acceptance"] for g in info["eps_grid"]]
    assert grid[0] > 0.5 > grid[-1]  # ε = 0 is the draft's own function; ε = 1 disagrees
    assert {(s["m"], s["engine"]) for s in r["m_sweep"]} == {(m, e) for m in (1, 2, 4)
                                                            for e in ("graphburst", "gapless")}
    assert {t["target"] for t in r["targets"]} >= {"per round / model-only floor", "tokens/s / HF assisted tokens/s"}
    assert "targets (B=1)" in stdout and "every engine, every config" in stdout
    prof = info["profile"]
    assert set(prof) == {"hf", "eager", "vllm", "graphburst", "gapless"}
    for name, p in prof.items():
        assert Path(p["trace"]).stat().st_size > 0 and p["top"][0]["us_per_round"] > 0, name
    if plot_problem() is None:
        assert png.stat().st_size > 1000 and res["meta"]["plot"] == str(png)
    else:
        assert not png.exists() and "matplotlib" in res["meta"]["plot"] and "plot skipped" in stdout


def test_the_summary_of_the_smoke_run(smoke, tmp_path):
    """``--summary`` of the run's own JSON: one line per config, naming every engine that ran."""
    res, _, _, out = smoke
    proc = cli("--summary", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(res["results"]["configs"]) == 4
    for line, cfg in zip(lines, res["results"]["configs"]):
        assert line.startswith(f"{out}: tiny B={cfg['batch']} eps=")
        assert all(f"{name} {cfg['engines'][name]['tokens_per_s']:.0f} tok/s" in line for name in cfg["engines"])


@pytest.mark.parametrize("args, flag", [(["--models", "huge"], "--models"), (["--engines", "hf"], "--engines"),
                                        (["--rounds", "5", "--m-sweep", "2"], "--rounds"),
                                        (["--batches", "1,x"], "--batches"), (["--accepts", "1.5"], "--accepts"),
                                        (["--trace", "no/such/dir"], "--trace"),
                                        (["--profile", "prof"], "--profile"),
                                        (["--capacities", "64"], "--capacities"),
                                        (["--profile", "--engines", "vllm"], "--engines"),
                                        (["--profile", "forward", "--prefill-cases", "2"], "--prefill-cases"),
                                        (["--profile", "prefill", "--models", "8b-tp2"], "--models"),
                                        (["--profile", "--kernels", "fast"], "--kernels"),
                                        (["--decode-kernels", "folded"], "--decode-kernels"),
                                        (["--profile", "--decode-kernels", "off"], "--decode-kernels"),
                                        (["--profile", "--capacities", "8"], "--capacities"),
                                        (["--profile", "--valid", "60"], "--valid"),
                                        (["--profile", "forward", "--models", "8b", "--capacities", "1024",
                                          "--batches", "64"], "--capacities")])
def test_bad_flags_are_one_line_exit_2(args, flag, tmp_path):
    proc = cli("--smoke", "--backend", "numpy", *args, tmp_path=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and flag in proc.stderr, proc.stderr


def test_the_comparison_on_other_decode_kernels(tmp_path):
    """``--decode-kernels reference``: graphburst and the eager loop over the same weights run the fused decode
    path (on its references) and still agree token for token; the JSON says which kernels ran."""
    out = tmp_path / "real.json"
    proc = cli("--smoke", "--backend", "numpy", "--engines", "eager,graphburst", "--no-m-sweep", "--decode-kernels",
               "reference", "--json", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["settings"]["decode_kernels"] == "reference" and doc["meta"]["failures"] == []


# ---------------------------------------------------------------------- the parts


def tiny(seed=0, dtype=torch.float32, batch=2):
    return random_target(TINY, batch=batch, capacity=48, kv_slack=6, dtype=dtype, device="cpu", seed=seed)


def forward(model, tokens):
    b = tokens.shape[0]
    zero = torch.zeros(b, dtype=torch.int32)
    return model(tokens, zero, [zero] * len(model.layers), torch.arange(b))


def test_cli_model_names_are_the_models():
    from graphburst.bench.real_args import MODEL_NAMES

    assert MODEL_NAMES == tuple(MODELS)


def test_draft_shares_the_target_and_eps_zero_makes_them_one_function():
    target = tiny()
    draft = instance(target, layers=TINY.draft_layers)
    assert shares_weights(target, draft) and draft.kv[0].data_ptr() != target.kv[0].data_ptr()
    tokens = torch.randint(0, TINY.cfg.vocab_size, (2, 7))
    eps = Epsilon(target, TINY.draft_layers)
    eps.set(0.0)
    assert torch.equal(forward(target, tokens), forward(draft, tokens))
    eps.set(1.0)
    assert not torch.equal(forward(target, tokens), forward(draft, tokens))
    assert torch.equal(target.layers[3].mlp.down_proj.weight, eps.initial[-1])  # restored, not compounded


@pytest.mark.parametrize("name", ["tiny", "qwen3-tiny"])
def test_hf_twin_shares_tensors_and_matches_logits(name):
    """The twin is the family's transformers class (Qwen3ForCausalLM for qwen3-tiny: q/k norms, head_dim 24)."""
    spec = MODELS[name]
    target = random_target(spec, batch=2, capacity=32, kv_slack=6, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for n, p in target.hf_tensors().items():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(3))  # a norm on the wrong heads shows
    Epsilon(target, spec.draft_layers).set(0.3)
    hf = hf_twin(target)
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if name == "qwen3-tiny" else "LlamaForCausalLM")
    ptrs = {t.data_ptr() for t in target.hf_tensors().values()}  # q/k/v, gate/up: views into the fused weights
    assert all(p.data_ptr() in ptrs for p in hf.parameters())
    assert all(p.untyped_storage().data_ptr() in {q.data_ptr() for q in target.parameters()} for p in hf.parameters())
    tokens = torch.randint(0, spec.cfg.vocab_size, (2, 9))
    torch.testing.assert_close(forward(target, tokens), hf(tokens).logits.float(), rtol=1e-5, atol=1e-5)


def test_weight_bytes_counts_blocks_norm_and_head():
    c = TINY.cfg
    attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    per_layer = attn + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    head = c.vocab_size * c.hidden_size  # untied: the embedding table is only gathered
    assert weight_bytes(tiny()) == 4 * (c.num_hidden_layers * per_layer + c.hidden_size + head)


def test_check_config_refuses_an_engine_with_other_tokens():
    a, b = tiny(seed=0), tiny(seed=1)
    engines = {"eager": TorchLoop(a, draft_layers=2, batch=2, k=4), "vllm": TorchLoop(b, draft_layers=2, batch=2, k=4)}
    settings = dict(rounds=3, tol=0.01, k=4)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    with pytest.raises(AssertionError, match="eager differs from vllm .same kernels. in sequence 0"):
        check_config(engines, settings, prompts, None, cuda=False)
    engines["eager"] = TorchLoop(b, draft_layers=2, batch=2, k=4)
    runs, report = check_config(engines, settings, prompts, None, cuda=False)
    assert runs["eager"].tokens == runs["vllm"].tokens and report["eager"]["rule"] == SAME_KERNEL_RULE


def test_near_tie_rule():
    logits = torch.tensor([3.0, 2.99, 1.0, -4.0])
    assert near_tie(logits, 0, 1, 0.01)["ok"] and not near_tie(logits, 0, 2, 0.01)["ok"]
    oracle = lambda prompt, prefix: logits  # noqa: E731 - the logits a teacher-forced model would give
    out = compare_other("x", [5, 1, 9], [5, 0, 7], [1], oracle, 0.01)
    assert out["agreed"] == 1 and out["divergence"]["at"] == 1
    with pytest.raises(AssertionError, match="not a near-tie"):
        compare_other("x", [5, 2], [5, 0], [1], oracle, 0.01)
    assert first_divergence([1, 2], [1, 2]) is None and first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.gpu
def test_smoke_on_the_gpu(tmp_path):
    """The same smoke run on cupy + CUDA torch: real CUDA graphs for vllm-style and graphburst."""
    from graphburst.backend import cuda_available

    if not cuda_available() or not torch.cuda.is_available():
        pytest.skip("needs cupy, a CUDA device and CUDA torch")
    out = tmp_path / "real.json"
    proc = cli("--smoke", "--backend", "cupy", "--json", str(out), "--no-plot", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["meta"]["backend"] == "cupy"
    for cfg in res["results"]["configs"]:
        assert cfg["floor_us"] > 0
        gb = cfg["engines"]["graphburst"]
        assert gb["x_floor"] > 0 and gb["graph_us_per_round"] > 0
        assert cfg["engines"]["vllm"]["correctness"]["rule"] == SAME_KERNEL_RULE
    assert res["results"]["models"]["tiny"]["verify"]["us"] > 0


def test_check_config_reports_other_kernels_breaking_the_near_tie_rule():
    from graphburst.bench.real_checks import reference_logits
    from graphburst.bench.real_engines import HFAssisted

    a, b = tiny(seed=0, batch=1), tiny(seed=1, batch=1)  # HF twin of other weights: a real disagreement
    Epsilon(a, 2).set(0.3)
    Epsilon(b, 2).set(0.3)
    eager = TorchLoop(a, draft_layers=2, batch=1, k=4)
    engines = {"eager": eager, "hf": HFAssisted(b, draft_layers=2, k=4)}
    runs, report = check_config(engines, dict(rounds=3, tol=0.01, k=4), [[1, 2, 3, 4]],
                                lambda p, pre: reference_logits(eager.target, p, pre), cuda=False)
    assert "not a near-tie" in report["hf"]["failed"] and "hf" not in runs and "eager" in runs
    engines["hf"] = HFAssisted(a, draft_layers=2, k=4)  # the same weights: it passes
    runs, report = check_config(engines, dict(rounds=3, tol=0.01, k=4), [[1, 2, 3, 4]],
                                lambda p, pre: reference_logits(eager.target, p, pre), cuda=False)
    assert "failed" not in report["hf"] and report["hf"]["sequences"][0]["compared"] == len(runs["eager"].tokens[0])


def test_same_kernel_runs_may_end_a_few_tokens_apart_but_never_disagree():
    """A run that is a prefix of the reference passes (acceptance can differ in bf16); a changed token fails."""
    class Fixed:
        same_kernels = True

        def __init__(self, tokens):
            self.tokens = tokens

        def prefill(self, prompts):
            pass

        def run(self, rounds):
            return type("Run", (), {"tokens": self.tokens})()

    settings = dict(rounds=1, tol=0.01, k=4)
    ok = {"graphburst": Fixed([[1, 2, 3, 4]]), "eager": Fixed([[1, 2, 3]])}
    _, report = check_config(ok, settings, [[0]], None, cuda=False)
    assert report["eager"]["common_prefix_tokens"] == 3
    bad = {"graphburst": Fixed([[1, 2, 3, 4]]), "eager": Fixed([[1, 2, 5]])}
    with pytest.raises(AssertionError, match="eager differs from graphburst"):
        check_config(bad, settings, [[0]], None, cuda=False)


def test_m_sweep_rule_is_the_common_prefix_rule():
    """The M sweep checks each M's tokens with the same-kernel rule (bf16 runs may end apart)."""
    from graphburst.bench.real_checks import check_common_prefix

    assert check_common_prefix("M sweep: graphburst with M=4", [[1, 2, 3], [7]], [[1, 2], [7, 8]], "ref") == 3
    with pytest.raises(AssertionError, match="M sweep: gapless with M=2 differs from ref .same kernels. in sequence 1 "
                                             "at token 1"):
        check_common_prefix("M sweep: gapless with M=2", [[1, 2], [7, 9]], [[1, 2], [7, 8]], "ref")


def test_a_draft_of_its_own_shape_is_the_targets_function_at_eps_zero():
    """qwen3-tiny-pair (the qwen3-8b construction at CI size): a d=32 draft under a d=64 target.

    At ε = 0 the target's logits are ~sqrt(64 / 32) x the draft's (the same argmax), so the
    same-kernel engines accept every draft; at ε = 1 the target is its own function.
    """
    from graphburst.bench.real_engines import Burst
    from graphburst.bench.real_models import draft_instance, subspace_draft

    spec = MODELS["qwen3-tiny-pair"]
    target = random_target(spec, batch=2, capacity=64, kv_slack=6, dtype=torch.float32, device="cpu")
    draft = subspace_draft(target, spec)
    assert draft.cfg.hidden_size == 32 and draft.cfg.num_hidden_layers == 2 and target.cfg.hidden_size == 64
    eps = Epsilon(target, spec.draft_layers)
    tokens = torch.randint(0, spec.cfg.vocab_size, (2, 7))
    eps.set(0.0)
    want = forward(draft_instance(target, draft), tokens)
    got = forward(target, tokens)
    # sqrt(2) up to the norms' eps (1e-6 against a mean square of ~4e-4 and ~2e-4)
    torch.testing.assert_close(got, want * 2 ** 0.5, rtol=1e-2, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    runs = {}
    for name, eng in {"eager": TorchLoop(target, draft_layers=draft, batch=2, k=3),
                      "graphburst": Burst(target, draft_layers=draft, batch=2, k=3, m=2, backend="numpy")}.items():
        eng.prefill(prompts)
        runs[name] = eng.run(4)
    assert runs["eager"].tokens == runs["graphburst"].tokens
    assert runs["graphburst"].accepted == 4 * 3 * 2  # every draft, every round, both rows
    eps.set(1.0)
    assert not torch.equal(forward(target, tokens).argmax(-1), want.argmax(-1))
    # The start-up check: transformers' Qwen3 twins of the target and of the draft of its own shape.
    from graphburst.backend import Backend
    from graphburst.bench.real_checks import fp32_check

    eps.set(0.3)
    res = fp32_check(target, draft, dict(k=3), Backend("numpy"), [1, 2, 3, 4])
    assert res["divergence"] is None and res["agreed"] == res["compared"] > 0, res
