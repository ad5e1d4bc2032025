"""``metrics.png``: training and validation loss, and peak memory, against the step (matplotlib, no display)."""

from __future__ import annotations

import json
import os


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_path: str, out_path: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only: works on a headless machine
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [r for r in recs if "loss" in r]
    val = [r for r in recs if r.get("val_loss") is not None]
    fig, (ax_loss, ax_mem) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", color="tab:blue")
    if val:  # (no reference line: a fine-tuning curve moves a few percent, and a fixed line would squash it)
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss",
                     color="tab:orange")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if title:
        ax_loss.set_title(title)
    mem = [r for r in recs if "mem_gib" in r]
    ax_mem.plot([r["step"] for r in mem], [r["mem_gib"] for r in mem], color="tab:green")
    # absolute scale from 0 (a few MB of drift should look like a few MB), with headroom so that a flat line
    # does not sit on the frame
    ax_mem.set_ylim(0, max((r["mem_gib"] for r in mem), default=1.0) * 1.2 or 1.0)
    ax_mem.set_ylabel("peak memory (GiB,\nmax over ranks)")
    ax_mem.set_xlabel("step")
    ax_mem.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
