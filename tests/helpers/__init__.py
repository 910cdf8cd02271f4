"""Builders that tests in several folders share (tests/ is on sys.path: ``pythonpath`` in
pyproject.toml), imported as ``from helpers.<module> import ...``.

- :mod:`helpers.tiny_targets`: tiny random Llama targets and a byte-level llama2.c tokenizer.
- :mod:`helpers.drafter_layouts`: synthetic drafter checkpoints in each published layout,
  written by hand, and the tiny target they draft for.
- :mod:`helpers.gpu_aot`: a ``python -m jspec.bench`` command compiled for an abstract H200 in
  the gpu-aot extra's Python.
"""
