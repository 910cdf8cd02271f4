"""``python -m jspec generate --stream`` prints what ``--no-stream`` prints, as it comes."""

import json

from jspec import cli


def test_stream_prints_the_same_tokens(stories_dir, capsys):
    cases = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"]
    ids = [",".join(map(str, c["prompt_token_ids"])) for c in cases[:3]]
    base = ["generate", "--model", str(stories_dir), "--max-new-tokens", "12", "--stop-ids", "",
            "--drafter", "random:eagle3", "--kernels", "reference"]
    one = base + ["--prompt-ids", ids[0]]
    assert cli.main(one + ["--no-stream"]) == 0
    static = capsys.readouterr().out
    assert cli.main(one + ["--stream"]) == 0
    streamed = capsys.readouterr()
    assert streamed.out == static
    assert "mean accept length" in streamed.err
    many = base + [x for i in ids for x in ("--prompt-ids", i)]
    assert cli.main(many + ["--no-stream"]) == 0
    static = capsys.readouterr().out.splitlines()
    assert cli.main(many + ["--stream"]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == sorted(static)
