"""Convert checkpoints to jspec's Orbax format, and drafters back to their published layouts.

Targets (an HF Llama directory, a GGUF file or a llama2.c ``.bin`` -> jspec Orbax, or HF
safetensors with ``--to hf``; a GGUF's quantized blocks are dequantized, to float32 unless
``--dtype`` says otherwise)::

    python -m jspec.convert SRC DST [--to orbax|hf] [--dtype bfloat16] [--tokenizer PATH] [--overwrite]
    python -m jspec.convert SRC DST --quantize int8|w8a8|fp8      # a quantized Orbax target

A quantized Orbax target holds the int8/fp8 values and their scales, so a pod restores each
slice straight into its sharding (:mod:`jspec.checkpoint.orbax_quant`); a GGUF's Q8_0/Q4_0
blocks are kept as they are under the int8 modes.

Drafters (every layout :func:`jspec.drafters.load_drafter` reads: SafeAILab/SpecForge
EAGLE-1/EAGLE-3, FasterDecoding and vLLM Medusa, DeepSeek MTP, jspec Orbax), checked
against the target they are paired with (only its config is read)::

    python -m jspec.convert drafter SRC DST --target TARGET            # -> jspec Orbax
    python -m jspec.convert drafter SRC DST --target TARGET --to hf \\
        [--layout fasterdecoding|vllm]                                  # -> HF layout

Failures print one line naming the offending tensor or field and exit with status 2,
before anything is written. DST is assembled in a hidden sibling directory and renamed
into place only once everything has been written (the savers share
:func:`jspec.checkpoint.orbax_io.atomic_dir`), so a failed or interrupted
conversion leaves no DST behind, and ``--overwrite`` keeps the old DST until the new one
is complete.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from tqdm import tqdm

from jspec.checkpoint import CheckpointError, load_config, load_target, save_hf, save_orbax
from jspec.checkpoint.orbax_io import atomic_dir
from jspec.args import add_quantize_arg
from jspec.config import ConfigError
from jspec.tokenizer import TokenizerError



def _hf_kinds():
    from jspec.drafters import registry
    return [registry.kind(n) for n in registry.names(lambda k: k.hf is not None)]


def _bar(iterable=None, **kw) -> tqdm:
    """The progress bar both conversions draw (on stderr, with the other progress lines)."""
    return tqdm(iterable, file=sys.stderr, **kw)


def _exists_error(dst: str) -> int:
    print(f"error: {dst} already exists (pass --overwrite to replace it)", file=sys.stderr)
    return 2


def _interrupted(dst: str) -> int:
    # atomic_dir has already removed the partial output: say so, without a traceback.
    print(f"interrupted: {dst} left as it was", file=sys.stderr)
    return 130


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["drafter"]:
        return drafter_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="python -m jspec.convert",
        description="Convert an HF Llama directory, a GGUF file or a llama2.c .bin to jspec's "
                    "Orbax checkpoint (or HF safetensors: --to hf).",
        epilog="drafters: python -m jspec.convert drafter --help")
    ap.add_argument("src", help="HF directory, .gguf file, llama2.c .bin or jspec Orbax directory")
    ap.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    ap.add_argument("--dtype", default=None, help="parameter dtype (default: the checkpoint's)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer file to use and copy")
    ap.add_argument("--to", choices=("orbax", "hf"), default="orbax",
                    help="output format (default: orbax)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    add_quantize_arg(ap)
    a = ap.parse_args(argv)
    if a.quantize is not None and a.to != "orbax":
        ap.error("--quantize writes a jspec Orbax checkpoint; HF safetensors hold float weights")
    if os.path.exists(a.dst) and not a.overwrite:  # before the slow part, not after
        return _exists_error(a.dst)
    try:
        target = load_target(a.src, dtype=a.dtype, tokenizer=a.tokenizer,
                             progress=functools.partial(_bar, desc="tensors", unit="tensor"),
                             quantize=a.quantize)
        if a.to == "hf":
            with atomic_dir(a.dst, overwrite=a.overwrite) as tmp:
                save_hf(target, tmp)
        else:
            save_orbax(target, a.dst, overwrite=a.overwrite)
    except KeyboardInterrupt:
        return _interrupted(a.dst)
    except (CheckpointError, ConfigError, TokenizerError, FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.dst}", file=sys.stderr)
    return 0


def drafter_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m jspec.convert drafter",
        description="Convert a drafter checkpoint (HF EAGLE-1/EAGLE-3/Medusa/MTP or jspec Orbax) "
                    "to jspec Orbax (default) or a published HF layout (--to hf), checked "
                    "against its target.")
    ap.add_argument("src", help="drafter directory: an HF layout or jspec Orbax")
    ap.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    ap.add_argument("--target", required=True,
                    help="the target it drafts for: HF directory, jspec Orbax directory or "
                         "llama2.c .bin (only its config is read)")
    ap.add_argument("--to", choices=("orbax", "hf"), default="orbax",
                    help="output format (default: orbax)")
    ap.add_argument("--layout", choices=sorted({x for k in _hf_kinds() for x in k.hf.layouts}),
                    default=None,
                    help="with --to hf, for a kind with several HF layouts: Medusa's (default: "
                         "fasterdecoding; vllm for a truncated vocabulary)")
    ap.add_argument("--kind", choices=[k.name for k in _hf_kinds()], default=None,
                    help="the source's layout (default: detected)")
    ap.add_argument("--dtype", default=None, help="parameter dtype (default: the target's)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    return ap


def drafter_main(argv=None) -> int:
    """``python -m jspec.convert drafter``: a drafter checkpoint to jspec Orbax or an HF layout."""
    ap = drafter_parser()
    a = ap.parse_args(argv)
    if a.layout is not None and a.to != "hf":
        ap.error("--layout applies to --to hf")
    if os.path.exists(a.dst) and not a.overwrite:  # before the slow part, not after
        return _exists_error(a.dst)
    if Path(a.dst).resolve() == Path(a.src).resolve():
        print("error: DST is SRC; write the conversion elsewhere", file=sys.stderr)
        return 2
    from jspec.drafters import load_drafter, save_drafter, save_hf_drafter

    # load_drafter and the savers take no per-tensor progress hook: the bar counts stages.
    stages = ("target config", "drafter", f"writing {a.to}")
    try:
        with _bar(total=len(stages), desc="drafter", unit="stage") as bar:
            bar.set_postfix_str(stages[0])
            cfg = load_config(a.target)
            bar.update()
            bar.set_postfix_str(stages[1])
            # Every check against the target (hidden size, vocabulary, aux layers, depth,
            # tensor shapes, index maps) happens here, before DST is touched.
            drafter = load_drafter(a.src, cfg, a.dtype, kind=a.kind)
            bar.update()
            bar.set_postfix_str(stages[2])
            if a.to == "hf":
                layouts = drafter.entry.hf.layouts if drafter.entry.hf is not None else ()
                if a.layout is not None and a.layout not in layouts:
                    raise ValueError(f"--layout {a.layout}: {a.src} holds a {drafter.kind} "
                                     f"drafter, whose HF layouts are "
                                     f"{list(layouts) or 'one, unnamed (or none)'}")
                save_hf_drafter(drafter, a.dst, layout=a.layout, target_config=cfg,
                                overwrite=a.overwrite)
            else:
                save_drafter(drafter, a.dst, overwrite=a.overwrite)
            bar.update()
    except KeyboardInterrupt:
        return _interrupted(a.dst)
    # CheckpointError, DrafterMismatchError and ConfigError are ValueErrors, as are the
    # savers' refusals (a layout that cannot hold the drafter).
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.dst} ({drafter.kind}, {a.to})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
