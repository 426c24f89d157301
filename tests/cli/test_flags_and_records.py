"""Flags bounded and refused, request ids, long integers, logs, --help, README.

Flag checks run in-process through ``cli.main`` (one line on stderr, exit 2, no work done);
what needs a real process (stderr that is not a terminal, the CPU notice) runs one.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphburst import cli, cli_args, greedy_reference, stub_pair
from graphburst.serving.jsonl_input import parse_line
from graphburst.serving.request import Request
from graphburst.serving.loop import ServeLoop

from flag_errors import flag_error

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
VOCAB = 5003


# ---------------------------------------------------------------- item 3: bench size flags


@pytest.mark.parametrize("batches", ["100000", "99999999999999999999"])
def test_bench_real_batches_are_bounded_by_the_memory_they_take(capsys, batches):
    line = flag_error(capsys, "bench", "real", "--backend", "numpy", "--batches", batches)
    assert "--batches" in line and "GiB" in line


@pytest.mark.parametrize("flag, value", [("--eps", "nan"), ("--eps", "inf"), ("--eps", "1e9"), ("--eps", "0"),
                                         ("--eps", "0.1,-0.2"), ("--accepts", "nan"), ("--accepts", "0"),
                                         ("--accepts", "0.5,inf")])
def test_bench_real_refuses_eps_and_acceptance_outside_their_range(capsys, flag, value):
    line = flag_error(capsys, "bench", "real", "--backend", "numpy", "--smoke", flag, value)
    assert flag in line and "(0, 1]" in line


def test_bench_real_still_takes_sizes_and_levels_that_fit():
    args = argparse.Namespace(**vars(_parse("bench", "real", "--backend", "numpy", "--smoke", "--eps", "0.01,1",
                                            "--accepts", "0.5,1", "--batches", "1,64")))
    from graphburst.bench import real

    real.check_args(args)


def _parse(*argv):
    parser = cli_args.Parser(prog="graphburst")
    sub = parser.add_subparsers(dest="command")
    for module in (cli.demo, cli.bench, cli.serve_cli):
        module.add_parser(sub)
    return parser.parse_args(list(argv))


def test_bench_serve_requests_times_tokens_are_bounded(capsys):
    line = flag_error(capsys, "bench", "serve", "--backend", "numpy", "--num-requests", "1000000",
                      "--new-tokens", "1000")
    assert "--num-requests" in line and "GiB" in line


def test_bench_capture_bursts_are_bounded(capsys, monkeypatch):
    # Every --bursts the flag's range takes fits the real limit; a lower limit shows the check is there.
    monkeypatch.setattr(cli_args, "MAX_FLAG_BYTES", 2**20)
    line = flag_error(capsys, "bench", "capture", "--backend", "numpy", "--bursts", "100000")
    assert "--bursts" in line and "GiB" in line


# ---------------------------------------------------------------- item 5: sampling filters without sampling


@pytest.mark.parametrize("flag, value", [("--top-k", "5"), ("--top-p", "0.9")])
def test_demo_refuses_a_sampling_filter_without_temperature(capsys, flag, value):
    line = flag_error(capsys, "demo", "--backend", "numpy", flag, value)
    assert flag in line and "--temperature" in line


def test_demo_takes_the_filters_with_temperature():
    args = _parse("demo", "--backend", "numpy", "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9")
    cli.demo.check_args(args)
    assert (args.top_k, args.top_p) == (5, 0.9)
    plain = _parse("demo", "--backend", "numpy")
    cli.demo.check_args(plain)
    assert (plain.top_k, plain.top_p) == (0, 1.0)


# ---------------------------------------------------------------- items 11, 12: ids, long integers


def _loop():
    target, draft = stub_pair(4, VOCAB, [True, False], [True], 128, backend="numpy")
    return ServeLoop(target, draft, k=3, m_rounds=2)


def test_a_made_up_id_never_turns_away_a_later_user_id():
    loop = _loop()
    auto = loop.submit(parse_line('{"id": null, "prompt": [1], "max_new_tokens": 4}'), line=1)
    user = loop.submit(parse_line('{"id": "req-0", "prompt": [2], "max_new_tokens": 4}'), line=2)
    # The made-up form is refused from a caller whatever is in flight, so it never names another line.
    with pytest.raises(ValueError, match=r"'auto-7' has the form of the ids made up .*choose another"):
        loop.submit(parse_line('{"id": "auto-7", "prompt": [2], "max_new_tokens": 4}'), line=3)
    loop.run_until_idle()
    assert auto.request.id == "auto-0" and user.request.id == "req-0"
    assert auto.tokens == greedy_reference([1], 4, VOCAB) and user.tokens == greedy_reference([2], 4, VOCAB)


def test_a_loop_that_replays_another_loops_requests_takes_its_made_up_ids():
    """A lockstep follower (parallel/lockstep.py: its policy's replays_ids) submits rank 0's requests, made-up ids
    included."""
    import types

    from graphburst.parallel.lockstep import LockstepPolicy
    from graphburst.serving.policy import LocalPolicy

    assert LockstepPolicy(types.SimpleNamespace(rank=1)).replays_ids
    assert not LockstepPolicy(types.SimpleNamespace(rank=0)).replays_ids
    target, draft = stub_pair(2, VOCAB, [True], [True], 64, backend="numpy")
    replaying = type("Replaying", (LocalPolicy,), {"replays_ids": True})()
    follower = ServeLoop(target, draft, k=2, m_rounds=1, policy=replaying)
    state = follower.submit(Request([1], 3, id="auto-0"))
    with pytest.raises(ValueError, match="already in flight"):
        follower.submit(Request([1], 3, id="auto-0"))
    follower.run_until_idle()
    assert state.tokens == greedy_reference([1], 3, VOCAB)


def test_int_and_string_ids_are_two_ids():
    loop = _loop()
    a = loop.submit(parse_line('{"id": 7, "prompt": [1], "max_new_tokens": 4}'), line=1)
    b = loop.submit(parse_line('{"id": "7", "prompt": [2], "max_new_tokens": 4}'), line=2)
    with pytest.raises(ValueError, match="already in flight .line 1"):
        loop.submit(parse_line('{"id": 7, "prompt": [3], "max_new_tokens": 4}'), line=3)
    loop.run_until_idle()
    assert (a.request.id, b.request.id) == (7, "7") and a.finish_reason == b.finish_reason == "length"
    with pytest.raises(TypeError, match="id must be"):
        loop.submit(Request([1], 4, id=True))


@pytest.mark.parametrize("line, field", [
    ('{"prompt": [1], "max_new_tokens": %s}', "max_new_tokens"),
    ('{"prompt": [1, 2, %s], "max_new_tokens": 3}', r"prompt\[2\]"),
    ('{"prompt": [1], "max_new_tokens": 3, "seed": -%s}', "seed"),
])
def test_a_5000_digit_integer_names_its_field_and_the_limit(line, field):
    with pytest.raises(ValueError) as exc:
        parse_line(line % ("9" * 5000))
    msg = str(exc.value)
    assert re.match(field + r": an integer of 5000 digits, over the 4300-digit limit$", msg), msg
    assert "set_int_max_str_digits" not in msg


# ---------------------------------------------------------------- item 13: logs and notices


def test_stderr_off_a_terminal_is_plain_unwrapped_lines_and_one_cpu_notice():
    reqs = b"".join(b'{"id": "a-rather-long-request-id-%d", "prompt": [%d], "max_new_tokens": 3}\n' % (i, i)
                    for i in range(3))
    res = subprocess.run([sys.executable, "-m", "graphburst.cli", "serve", "--batch", "2", "--vocab", "5003",
                          "--capacity", "64"], input=reqs, capture_output=True, env=ENV, timeout=120)
    err = res.stderr.decode()
    assert res.returncode == 0, err
    lines = err.splitlines()
    summary = [x for x in lines if x.startswith("served ")]
    assert len(summary) == 1 and re.search(r"served 3 requests .* tokens/s$", summary[0]), err
    assert "RuntimeWarning" not in err and "\x1b[" not in err, err
    from graphburst.backend import cuda_available

    if not cuda_available():
        assert sum("numpy reference backend" in x for x in lines) == 1, err


# ---------------------------------------------------------------- item 14: --help


def _parsers(parser, name="graphburst"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _root():
    parser = cli_args.Parser(prog="graphburst", description=cli.__doc__)
    sub = parser.add_subparsers(dest="command")
    for module in (cli.demo, cli.bench, cli.serve_cli):
        module.add_parser(sub)
    return parser


def test_every_flag_has_help_and_every_default_is_shown():
    root = _root()
    assert "``" not in root.format_help()
    missing, hidden = [], []
    for name, parser in _parsers(root):
        fmt = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction) or \
                    action.help == argparse.SUPPRESS:
                continue
            if not action.help:
                missing.append(f"{name} {action.option_strings[-1]}")
            # each flag's own help line (not the whole page) must show a default it has
            own = fmt._expand_help(action) if action.help else ""
            if action.default not in (None, False) and "default" not in own:
                hidden.append(f"{name} {action.option_strings[-1]}")
    assert not missing and not hidden, (missing, hidden)
    assert all(parser.description for _, parser in _parsers(root)), "a command's --help says nothing of it"
    demo = " ".join(dict(_parsers(root))["graphburst demo"].format_help().split())
    assert "--bursts BURSTS bursts of M rounds to run and check (default: 4)" in demo


def test_bench_serve_counts_with_num_requests_and_the_old_spelling_still_works(capsys):
    args = _parse("bench", "serve", "--num-requests", "5")
    assert args.num_requests == 5
    old = _parse("bench", "serve", "--requests", "6")
    assert old.num_requests == 6 and "--requests is deprecated here; use --num-requests" in capsys.readouterr().err


# ---------------------------------------------------------------- item 15: the README's two commands


def test_readme_has_two_fresh_machine_commands_and_the_cpu_path_beside_the_gpu_one():
    text = (ROOT / "README.md").read_text()
    fresh = re.findall(r"^python3 -m venv .*$", text, flags=re.M)
    assert len(fresh) == 2, fresh
    main, tests = fresh
    assert "graphburst demo" in main and "pytest" in tests
    # The main command must not pull CUDA wheels on a machine without a GPU: the extra it installs is
    # chosen by what the machine has, so the CPU path is the same command.
    assert "nvidia-smi" in main and "'.[cuda12]'" in main and "echo .)" in main
    assert re.search(r"tests? (takes?|took|ran in) .*minutes? on (a )?2[- ]core", text), "no test time in README"


# ---------------------------------------------------------------- item 16: the suite's CPU use


def test_test_processes_use_one_cpu_thread_unless_told_otherwise():
    """conftest sets OMP_NUM_THREADS=1 (and the BLAS pools') for the suite and every subprocess it
    starts: idle pool threads spinning on a shared 2-core machine made the suite several times slower."""
    torch = pytest.importorskip("torch")
    assert "OMP_NUM_THREADS" in os.environ  # set by conftest, or given outside
    if os.environ["OMP_NUM_THREADS"] == "1":
        assert torch.get_num_threads() == 1
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=ENV,
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == os.environ["OMP_NUM_THREADS"], child.stderr
