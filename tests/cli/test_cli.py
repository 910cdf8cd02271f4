import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args):
    return subprocess.run([sys.executable, "-m", "jspec", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_generate_json(stories_dir):
    case = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"][2]
    ids = ",".join(map(str, case["prompt_token_ids"]))
    # --prefill-chunk 4: the golden prompt is prefilled in chunks; the tokens do not change.
    p = run("generate", "--model", str(stories_dir), "--prompt-ids", ids, "--prompt-ids", "1,403",
            "--max-new-tokens", "25", "--stop-ids", "", "--json", "--prefill-chunk", "4")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["tokens"][0] == case["continuation_token_ids"][:25]
    assert len(out["tokens"][1]) == 25
    assert out["stats"]["rows"][0]["new_tokens"] == 25


def test_generate_text_prompt(stories_dir):
    p = run("generate", "--model", str(stories_dir), "--prompt", "Once upon a time",
            "--max-new-tokens", "12")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Once upon a time, there was a little girl")


def test_bad_input_is_one_line_not_a_traceback(stories_dir):
    p = run("generate", "--model", str(stories_dir), "--prompt-ids", "1,9999")
    assert p.returncode == 2
    assert "outside the vocabulary" in p.stderr and "Traceback" not in p.stderr
    p = run("generate", "--model", str(stories_dir / "nope"), "--prompt-ids", "1")
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_generate_with_drafter_flags(stories_dir, tmp_path):
    import jax

    from jspec.checkpoint import load_target
    from jspec.drafters import random_drafter, save_drafter

    target = load_target(stories_dir)
    save_drafter(random_drafter("eagle3", target.config, jax.random.key(1)), tmp_path / "d")
    case = json.loads((stories_dir / "reference_greedy.json").read_text())["cases"][1]
    ids = ",".join(map(str, case["prompt_token_ids"]))
    for drafter in (str(tmp_path / "d"),):
        p = run("generate", "--model", str(stories_dir), "--prompt-ids", ids, "--max-new-tokens", "20",
                "--stop-ids", "", "--drafter", drafter, "--spec-steps", "3", "--spec-topk", "2",
                "--spec-draft-tokens", "5", "--json")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["tokens"][0] == case["continuation_token_ids"][:20]
        row = out["stats"]["rows"][0]
        assert sum(row["accept_hist"]) == row["iterations"] and row["mean_accept_len"] >= 1
    p = run("generate", "--model", str(stories_dir), "--prompt-ids", ids, "--drafter", "random:eagle1",
            "--spec-steps", "3", "--spec-topk", "1", "--spec-draft-tokens", "6")
    assert p.returncode == 2 and "topk=1 is a chain" in p.stderr
