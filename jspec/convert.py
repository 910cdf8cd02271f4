"""Convert an HF Llama directory or a llama2.c ``.bin`` to jspec's Orbax checkpoint.

    python -m jspec.convert SRC DST [--dtype bfloat16] [--tokenizer PATH] [--overwrite]

Failures print one line naming the offending tensor or field and exit with status 2;
DST is only created once everything has been written (see ``save_orbax``).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from tqdm import tqdm

from jspec.checkpoint import CheckpointError, load_target, save_orbax
from jspec.config import ConfigError
from jspec.tokenizer import TokenizerError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jspec.convert", description=__doc__.split("\n")[0])
    ap.add_argument("src", help="HF directory, llama2.c .bin or jspec Orbax directory")
    ap.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    ap.add_argument("--dtype", default=None, help="parameter dtype (default: the checkpoint's)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer file to use and copy")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    a = ap.parse_args(argv)
    if os.path.exists(a.dst) and not a.overwrite:  # before the slow part, not after
        print(f"error: {a.dst} already exists (pass --overwrite to replace it)", file=sys.stderr)
        return 2
    bar = functools.partial(tqdm, desc="tensors", unit="tensor", file=sys.stderr)
    try:
        target = load_target(a.src, dtype=a.dtype, tokenizer=a.tokenizer, progress=bar)
        save_orbax(target, a.dst, overwrite=a.overwrite)
    except (CheckpointError, ConfigError, TokenizerError, FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
