"""The picture a training run leaves: loss and per-step top-1 agreement with the target by
step (from :func:`jspec.train.trainer.read_metrics`), plus held-out acceptance where the
metrics carry it (``accept`` records)."""

from __future__ import annotations

from pathlib import Path


def plot_training(metrics_path, png_path) -> Path | None:
    """Write the PNG; None (and nothing written) without matplotlib or metrics."""
    try:
        import matplotlib
    except ImportError:                 # an optional dependency (the test extra has it)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jspec.train.trainer import read_metrics
    if not Path(metrics_path).exists():
        return None
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    logged = [r for r in rows if "loss" in r]          # training steps (not eval-only records)
    steps = [r["step"] for r in logged]
    accs = sorted({k for r in rows for k in r if k.startswith("acc") and k[3:].isdigit()},
                  key=lambda k: int(k[3:]))
    accept = [(r["step"], r["accept"]) for r in rows if "accept" in r]
    fig, axes = plt.subplots(1, 3 if accept else 2, figsize=(13 if accept else 9, 3.6))
    axes[0].plot(steps, [r["loss"] for r in logged])
    axes[0].set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    for k in accs:
        axes[1].plot(steps, [r.get(k, float("nan")) for r in logged], label=k)
    axes[1].set(xlabel="step", ylabel="top-1 agreement", title="agreement by draft step")
    axes[1].legend(fontsize=7)
    if accept:
        axes[2].plot(*zip(*accept), marker="o")
        axes[2].set(xlabel="step", ylabel="tokens / target pass", title="held-out acceptance")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)
