"""Measurement tools of a jspec source checkout, outside the installed package (as MaxText and
tpu-inference keep ``benchmarks/``): one module per purpose, each a subcommand of ``python -m
jspec.bench`` (run from the repository root) and runnable as ``python -m benchmarks.NAME``.

* ``forward`` — a 1-token decode step vs a block forward on a long cache.
* ``anatomy`` — the compiled decode programs: kernels, bytes, flops, memory (nothing timed),
  read from their optimized HLO by ``hlo`` (parser, kernel rule), ``hlo_bytes`` (HBM bytes)
  and ``collectives`` (one iteration's collectives).
* ``plan`` — per-device memory and collectives of sharded speculative decoding, compiled on
  simulated CPU devices or a TPU topology; ``serve-plan`` the serving engine's programs.
* ``aot_kernels`` — the Pallas kernels compiled deviceless for TPU v5e/v6e/v5p and the H200.
* ``load`` — host memory of loading a checkpoint onto a mesh.
* ``long_run`` — memory and compile counts over a long generation and many calls.
* ``serve_load`` — ``python -m jspec serve`` under concurrent mixed load: correctness,
  RSS, tok/s against the in-process engine, TTFT.
* ``kernels`` — tree attention at Llama-3-8B attention shapes (a device script).
* ``phases`` — kernel time per phase of the compiled speculative loop (profiler).
* ``device`` — the prepared one-accelerator script (sections in ``device_sections``, sizes
  and helpers in ``device_setup``).

The runtime (``jspec``) never imports this package.
"""

JSPEC_BENCHMARKS = True        # what jspec.bench.registry looks for before listing commands
