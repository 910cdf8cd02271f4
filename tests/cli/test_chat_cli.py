"""``python -m jspec chat`` driven through piped stdin: each turn streams the reply ``jspec.chat``
gives for the history so far, the history grows, ``/reset`` clears it, ``/exit`` ends, and
one engine serves every turn."""

import io
import re

import pytest

import jspec
from helpers.chat_targets import chat_target
from jspec import chat_cli, cli

STATS = re.compile(r"^\[accept len (\d+\.\d\d), [\d.]+ tok/s, (\d+) tokens(, cut at "
                   r"--max-new-tokens)?\]$")


@pytest.fixture
def chat(monkeypatch, capsys):
    """Run the command on ``lines`` of stdin with the tiny ChatML target as --model."""
    target = chat_target()
    monkeypatch.setattr(jspec, "load_target", lambda *a, **k: target)
    engines = []
    make = chat_cli.make_engine
    monkeypatch.setattr(chat_cli, "make_engine", lambda *a: engines.append(make(*a)) or
                        engines[-1])

    def run(lines, *flags):
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(x + "\n" for x in lines)))
        rc = cli.main(["chat", "--model", "tiny", "--max-new-tokens", "8",
                       "--kernels", "reference", *flags])
        out = capsys.readouterr()
        return rc, out.out, out.err.splitlines(), target, engines
    return run


def test_two_turns_then_exit(chat):
    rc, out, err, target, engines = chat(["hi there", "and again", "/exit", "never read"],
                                         "--system", "be brief.")
    assert rc == 0 and len(engines) == 1
    stats = [STATS.match(x) for x in err]
    assert sum(m is not None for m in stats) == 2, err
    # Each turn's reply is jspec.chat's for the history so far.
    history = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi there"}]
    first = jspec.chat(target, history, max_new_tokens=8)
    history += [first.replies()[0], {"role": "user", "content": "and again"}]
    second = jspec.chat(target, history, max_new_tokens=8)
    assert out == first.text + "\n" + second.text + "\n"
    assert [int(m.group(2)) for m in stats if m] == \
        [len(first.result.tokens[0]), len(second.result.tokens[0])]


def test_reset_and_speculation(chat):
    rc, out, err, target, _ = chat(["hi there", "/reset", "hi there"], "--drafter", "ngram")
    assert rc == 0 and "(history cleared)" in err
    one = jspec.chat(target, [{"role": "user", "content": "hi there"}], max_new_tokens=8).text
    assert out == one + "\n" + one + "\n"                 # the same first turn twice
    assert all(float(m.group(1)) >= 1 for m in map(STATS.match, err) if m)


def test_without_a_template_it_stops_before_compiling(monkeypatch, capsys):
    monkeypatch.setattr(jspec, "load_target", lambda *a, **k: chat_target(None))
    monkeypatch.setattr(chat_cli, "make_engine", lambda *a: pytest.fail("compiled"))
    assert cli.main(["chat", "--model", "tiny"]) == 2
    assert "no chat template" in capsys.readouterr().err
