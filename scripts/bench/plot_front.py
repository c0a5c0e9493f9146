#!/usr/bin/env python3
"""The README's plot: ours against the strongest anchors at equal settings, from docs/results/front_page.json.

    python3 scripts/bench/plot_front.py --rows docs/results/front_page.json --out docs/bench_1gpu.png

One column per panel of the rows file, tokens/s per GPU above and peak allocated memory below. Each row's source
names the section of docs/benchmarks.md (or the raw file) that it copies.
"""
import argparse
import json
import textwrap
from pathlib import Path

# a pair shares a colour: each "ours" line against the anchor setting it was compared with
STYLE = {
    "ours, fastest": ("C0", "-"),
    "HF + Liger + FA4, no checkpointing": ("C0", "--"),
    "ours, equal memory": ("C1", "-"),
    "HF + Liger + FA4, checkpointing": ("C1", "--"),
    "ALST + Liger + FA4, checkpointing": ("C2", "--"),
}


def k_label(s):
    return f"{s // 1024}k"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="docs/results/front_page.json")
    ap.add_argument("--out", default="docs/bench_1gpu.png")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    rows = json.loads(Path(args.rows).read_text())
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    fig, axes = plt.subplots(2, len(panels), figsize=(15, 7), squeeze=False)
    for col, panel in enumerate(panels):
        prow = [r for r in rows if r["panel"] == panel]
        top, bottom = axes[0][col], axes[1][col]
        labelled = set()
        for side in dict.fromkeys(r["side"] for r in prow):
            pts = sorted((r for r in prow if r["side"] == side), key=lambda r: r["S"])
            color, ls = STYLE.get(side, ("C3", "-"))
            ours = side.startswith("ours")
            for ax, y in ((top, [r["S"] / r["step_s"] for r in pts]), (bottom, [r["peak_gib"] for r in pts])):
                xs = [r["S"] for r in pts]
                ax.plot(xs, y, color=color, ls=ls, lw=1.4)
                for x, v, r in zip(xs, y, pts):
                    # H100 points sit on the same line as H200 ones: the marker, not the line, tells them apart
                    ax.plot(x, v, "o", ms=6, color=color, mfc="white" if r["gpu"] == "H100" else color)
                    # presets are memory settings, so they label the memory row, below the point: our lines
                    # lie under the anchors' there
                    if ours and ax is bottom:
                        key = (x, r["peak_gib"], r["preset"])
                        if key in labelled:  # the MoE panel's two "ours" lines share points: one label
                            continue
                        labelled.add(key)
                        ax.annotate(r["preset"].replace(" + ", "\n+ "), (x, v), textcoords="offset points",
                                    xytext=(4, -6), fontsize=7.5, color=color, va="top")
        h100 = sorted({r["date"] for r in prow if r["gpu"] == "H100"})
        where = f"H200; hollow: H100, {', '.join(h100)}" if h100 else "one H200"
        top.set_title("\n".join(textwrap.wrap(panel, 56) + [f"({where})"]), fontsize=10.5)
        xs = sorted({r["S"] for r in prow})
        for ax, label in ((top, "tokens/s per GPU"), (bottom, "peak allocated GiB")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [k_label(s) for s in xs])
            ax.minorticks_off()
            ax.set_xlim(xs[0] / 1.25, xs[-1] * 1.9)  # room for the preset labels right of the last point
            ax.set_ylim(bottom=0)  # ratios read off the heights only from zero
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=9)
            if col == 0:
                ax.set_ylabel(label)
        top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:g}k" if v else "0"))
        bottom.set_xlabel("sequence length (tokens)", fontsize=10)
    handles = [Line2D([], [], color=c, ls=ls, marker="o", label=s) for s, (c, ls) in STYLE.items()
               if any(r["side"] == s for r in rows)]
    handles.append(Line2D([], [], ls="", marker="o", color="grey", mfc="white", label="measured on one H100"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9.5, frameon=False)
    fig.suptitle("ds_ulysses_ext against the strongest anchors (bf16, one GPU)", fontsize=13)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
