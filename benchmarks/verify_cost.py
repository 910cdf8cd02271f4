"""``python -m jspec.bench verify-cost``: what verifying N draft nodes costs against one plain
step, ``t_V(N) / t_1`` for N = 1..64, at batch 1 and 8, on one or more targets.

Speculation pays when ``accept length / (t_V/t_1 + S c)`` exceeds 1, so this curve is where
it can pay at all. A step of a model whose weights overflow the last-level cache (SmolLM2:
540 MB of fp32 against a 32 MB L3) streams them from DRAM, and a few more tokens ride along
almost free until arithmetic takes over; a model that sits in the cache (the shipped 6.7M
one, 27 MB) pays for every token's arithmetic from the start. Each N is a chain of N nodes
with the tree mask, against a KV prefix of ``--context`` positions (the verify the loop runs;
:func:`jspec.bench.spec_simulate.micro_costs`, every variant timed alternately, medians).
"""

from __future__ import annotations

from jspec.bench.registry import Command, run_module

NODES = (2, 4, 8, 16, 32, 64)


def add_args(s) -> None:
    s.add_argument("--model", action="append", default=None,
                   help="fetchable names or paths (repeatable; default: smollm2 and default)")
    s.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    s.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    s.add_argument("--context", type=int, default=256, help="KV prefix positions")
    s.add_argument("--repeats", type=int, default=10)
    s.add_argument("--modes", nargs="+", default=["fp32"],
                   help="weight modes (benchmarks.quant.MODES: fp32 bf16 bf16w int8 int8/ch "
                        "int8/ch+head w8a8 w8a8/ch w8a8/ch+head fp8; default fp32)")


def curve(target, batches, nodes, context, repeats) -> dict[int, dict]:
    from jspec.bench.spec_simulate import micro_costs
    from jspec.spec_config import SpecConfig
    specs = [SpecConfig.chain(n - 1) for n in nodes]
    out = {}
    for b in batches:
        c = micro_costs(target, context, repeats, specs=specs, batch=b)
        out[b] = {"t_1 ms": c["t_1 ms"],
                  **{n: c["specs"][f"{n - 1},1,{n}"]["t_V/t_1"] for n in nodes}}
    return out


def row_drift(target, context: int, nodes) -> dict[int, float]:
    """Per N: the largest |logit| difference between the first row of a causal N-token verify
    block and the 1-token step of the same token at the same position over the same cache
    (0.0: the verify row computes its step's logits bit for bit)."""
    import jax.numpy as jnp
    import numpy as np
    from jspec.bench import common
    cfg, params = target.config, target.serving_params
    step = common.step_fn(cfg)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, max(nodes))),
                       jnp.int32)
    run = lambda n: np.asarray(step(params, toks[:, :n], context + jnp.arange(n)[None],
                                    common.make_cache(cfg, 1, context, n))[0][0, 0])
    one = run(1)
    return {n: float(np.abs(run(n) - one).max()) for n in nodes}


def main(a) -> None:
    from benchmarks.products import cpu_name
    from benchmarks.quant import check_modes, load_mode
    from jspec.fetch import resolve_model
    from jspec.quant.product import kernel_status
    from jspec.shipped import default_model
    check_modes(a.modes)
    models = a.model or ["smollm2", "default"]
    rows, drift = [], []
    for name in models:
        path = default_model() if name == "default" else resolve_model(name)
        for mode in a.modes:
            target = load_mode(path, mode)[0]
            cfg = target.config
            label = f"{name} {mode} ({cfg.num_layers}L, {cfg.hidden_size})"
            for b, r in curve(target, a.batch, a.nodes, a.context, a.repeats).items():
                rows.append((label, b, r))
            drift.append((label, row_drift(target, a.context, a.nodes)))
            del target
    print(f"t_V(N) / t_1: a verify of N chain nodes against one plain step (context "
          f"{a.context}, medians of {a.repeats}); CPU: {cpu_name()}; products: {kernel_status()}")
    head = f"{'target':<36} {'batch':>5} {'t_1 ms':>7} " + " ".join(f"{'N=' + str(n):>6}"
                                                                   for n in a.nodes)
    print(head)
    for label, b, r in rows:
        print(f"{label:<36} {b:>5} {r['t_1 ms']:>7.2f} " + " ".join(f"{r[n]:>6.2f}"
                                                                   for n in a.nodes))
    print("\nmax |logit| difference, the first row of a causal N-token verify against its "
          "1-token step (batch 1)")
    for label, d in drift:
        print(f"{label:<36} {'':>5} {'':>7} " + " ".join(f"{d[n]:>6.0e}" if d[n] else
                                                        f"{'0':>6}" for n in a.nodes))


COMMAND = Command("verify-cost", "t_V(N)/t_1 for N = 2..64 at batch 1 and 8: where verifying "
                  "stops riding along with the weight stream", add_args, main,
                  description=__doc__)

if __name__ == "__main__":
    run_module(COMMAND)
