#!/usr/bin/env python3
"""Pictures of bench_encodings' JSON output (Python 3, matplotlib, numpy; Debian python3-matplotlib).

    bench_encodings --benchmark_format=json > encodings.json
    python3 tools/plot_bench.py encodings.json [more.json ...] [-o DIR] [--table-L 4096]

Reads the rows named encodings/<encoding>/L:<L>/threads:<t> (a row present in several files: the
last one wins) and writes into DIR (default: the current directory):
  encodings_time.png      time per call vs L, log-log, one line per encoding, a panel per thread count
  encodings_overhead.png  over_none (paired time ratio against no encoding) vs L, same layout
With --table-L, also prints a Markdown table of that length (ms, over_none, extra memory per thread count).
"""
import argparse
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROW = re.compile(r"^encodings/(?P<enc>[a-z0-9_]+)/L:(?P<L>\d+)/threads:(?P<t>\d+)$")
ORDER = ["none", "sinusoidal", "learned", "alibi", "t5", "shaw", "transformer_xl", "deberta", "tupe", "rope",
         "rope_linear", "rope_dynamic", "rope_yarn", "rope_llama3", "rope_longrope"]
TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def load(paths):
    rows = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for b in data.get("benchmarks", []):
            if b.get("run_type", "iteration") != "iteration" or "error_occurred" in b:
                continue
            m = ROW.match(b["name"])
            if not m:
                continue
            ms = b["real_time"] * TO_MS[b.get("time_unit", "ns")]
            rows[(m["enc"], int(m["L"]), int(m["t"]))] = {
                "ms": ms, "over_none": b.get("over_none"), "extra_bytes": b.get("extra_bytes", 0),
                "gflops": b.get("GFLOPs"), "causal": b.get("causal")}
    return rows


def encodings_in(rows):
    present = {k[0] for k in rows}
    return [e for e in ORDER if e in present] + sorted(present - set(ORDER))


def style(i):
    return {"color": plt.cm.tab20(i % 20), "linestyle": "-" if i < 10 else "--", "marker": "o", "markersize": 3}


def plot(rows, key, ylabel, title, path, logy):
    threads = sorted({k[2] for k in rows})
    fig, axes = plt.subplots(1, len(threads), figsize=(6.5 * len(threads), 5.5), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], threads):
        for i, enc in enumerate(encodings_in(rows)):
            pts = sorted((L, r[key]) for (e, L, tt), r in rows.items() if e == enc and tt == t and r[key] is not None)
            if not pts:
                continue
            xs, ys = np.array(pts).T
            ax.plot(xs, ys, label=enc, **style(i))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if not logy:  # ratios: log scale too (a few encodings cost several times none at small L)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ticks = [0.8, 1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16]
            ax.set_yticks(ticks)
            ax.set_yticklabels([f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel("sequence length L")
        ax.set_title(f"{title}, {t} thread{'s' if t > 1 else ''}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def human(b):
    b = float(b or 0)
    for unit, f in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= f:
            return f"{b / f:.1f} {unit}"
    return f"{b:.0f} B"


def table(rows, L):
    threads = sorted({k[2] for k in rows if k[1] == L})
    head = "| encoding | mask | " + " | ".join(f"ms ({t} thr) | × none ({t} thr)" for t in threads) + " | extra memory |"
    print(head)
    print("|" + "---|" * (2 + 2 * len(threads) + 1))
    for enc in encodings_in(rows):
        cells = []
        extra = None
        causal = None
        for t in threads:
            r = rows.get((enc, L, t))
            if r is None:
                cells += ["–", "–"]
                continue
            cells += [f"{r['ms']:.1f}", f"{r['over_none']:.2f}"]
            extra = r["extra_bytes"]
            causal = r["causal"]
        mask = "causal" if causal else "bidirectional"
        print(f"| {enc} | {mask} | " + " | ".join(cells) + f" | {human(extra)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="bench_encodings --benchmark_format=json output")
    ap.add_argument("-o", "--out", default=".", help="folder for the PNG files")
    ap.add_argument("--table-L", type=int, help="print a Markdown table of this length")
    a = ap.parse_args()
    rows = load(a.json)
    if not rows:
        sys.exit("plot_bench: no encodings/<encoding>/L:<L>/threads:<t> rows in " + ", ".join(a.json))
    os.makedirs(a.out, exist_ok=True)
    plot(rows, "ms", "ms per call", "attention layer, H = 8, d = 128", os.path.join(a.out, "encodings_time.png"), True)
    plot(rows, "over_none", "time / time without encoding (paired)", "overhead vs none",
         os.path.join(a.out, "encodings_overhead.png"), False)
    if a.table_L:
        table(rows, a.table_L)


if __name__ == "__main__":
    main()
