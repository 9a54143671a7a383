#!/usr/bin/env python3
"""Pictures of the demo (examples/demo.cpp) from the CSV files it writes (Python 3, matplotlib, numpy).

    python3 tools/plot_demo.py DIR

DIR is the folder the demo printed; the PNG files go into the same folder:
  position_scores.png  position-only score S(i, j) (query i, key j < 64) per encoding, heads 0, 3, 7
  rope_decay.png       RoPE's long-range decay R(t)1 . R(0)1 / d: default, dynamic NTK, YaRN, Llama-3
  alibi_slopes.png     ALiBi slopes per head for 8, 12, 16, 32 heads
  buckets.png          T5 (encoder, decoder) and DeBERTa bucket of each relative distance
"""
import csv
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def position_scores(d):
    rows = read(os.path.join(d, "position_scores.csv"))
    maps = defaultdict(dict)
    order = []
    for r in rows:
        enc, h = r["encoding"], int(r["head"])
        if enc not in order:
            order.append(enc)
        maps[enc].setdefault(h, []).append((int(r["i"]), int(r["j"]), float(r["score"])))
    heads = sorted({h for m in maps.values() for h in m})
    per_row = 2  # encodings per figure row
    nrows = (len(order) + per_row - 1) // per_row
    fig, axes = plt.subplots(nrows, per_row * len(heads), figsize=(2.3 * per_row * len(heads), 2.3 * nrows),
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for n, enc in enumerate(order):
        for k, h in enumerate(heads):
            pts = maps[enc][h]
            size = max(max(i, j) for i, j, _ in pts) + 1
            m = np.zeros((size, size))
            for i, j, s in pts:
                m[i, j] = s
            lim = np.nanmax(abs(m)) or 1.0  # none: all zero
            ax = axes[n // per_row][(n % per_row) * len(heads) + k]
            ax.axis("on")
            cmap = plt.get_cmap("RdBu_r").copy()
            cmap.set_bad("lightgray")  # pairs a causal query does not see
            ax.imshow(np.ma.masked_invalid(m), cmap=cmap, vmin=-lim, vmax=lim, interpolation="nearest")
            ax.set_title(f"{enc} h{h}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle("position-only score S(i, j): rows = query i, columns = key j (0..63); red > 0 > blue;"
                 " gray: not visible (causal)")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    return fig


def finish(fig, ax, xlabel, ylabel, title):
    """Labels, grid and legend of a one-panel figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def rope_decay(d):
    rows = read(os.path.join(d, "rope_decay.csv"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = []
    for r in rows:
        if r["scaling"] not in names:
            names.append(r["scaling"])
    for name in names:
        pts = [(int(r["distance"]), float(r["score"])) for r in rows if r["scaling"] == name]
        x, y = np.array(pts).T
        ax.plot(x, y, label=name, linewidth=1.2)
    ax.set_xscale("log")
    return finish(fig, ax, "relative distance t", "R(t)1 · R(0)1 / d",
                  "RoPE long-range decay (d = 128, frequencies of a 131072-token context)")


def alibi_slopes(d):
    rows = read(os.path.join(d, "alibi_slopes.csv"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for H in sorted({int(r["heads"]) for r in rows}):
        pts = [(int(r["head"]), float(r["slope"])) for r in rows if int(r["heads"]) == H]
        x, y = np.array(pts).T
        ax.plot(x, y, marker="o", markersize=3, label=f"{H} heads")
    ax.set_yscale("log", base=2)
    return finish(fig, ax, "head", "slope m_h", "ALiBi slopes (max_bias 8)")


def buckets(d):
    rows = read(os.path.join(d, "buckets.csv"))
    r = np.array([int(x["relative"]) for x in rows])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].plot(r, [int(x["t5_encoder"]) for x in rows], label="encoder (bidirectional)")
    axes[0].plot(r, [int(x["t5_decoder"]) for x in rows], label="decoder (unidirectional)")
    axes[0].set_title("T5 bucket (num_buckets 32, max_distance 128)")
    axes[1].plot(r, [int(x["deberta"]) for x in rows], color="tab:green")
    axes[0].set_xlim(-300, 300)
    axes[1].set_title("DeBERTa log bucket (buckets 256, max_relative 512)")
    for ax in axes:
        ax.set_xlabel("relative position r = key - query")
        ax.set_ylabel("bucket")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    return fig


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    d = os.path.abspath(sys.argv[1])
    for name, draw in (("position_scores", position_scores), ("rope_decay", rope_decay),
                       ("alibi_slopes", alibi_slopes), ("buckets", buckets)):
        fig = draw(d)
        path = os.path.join(d, name + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        print(f"wrote {path}")
    print(f"pictures in: {d}")


if __name__ == "__main__":
    main()
