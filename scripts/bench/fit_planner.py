#!/usr/bin/env python3
"""Fit memory=auto's cost model (ds_ulysses_ext/memory/planner.py) to the measured rows of
ds_ulysses_ext/memory/planner_calibration.json, write the coefficients back, print predicted vs measured.

    python scripts/bench/fit_planner.py            # fit, write, print the markdown table (docs/memory.md has it)
    python scripts/bench/fit_planner.py --check    # print the table with the stored coefficients, write nothing

Both parts are least squares on relative errors (each row divided by its measurement) with non-negative
coefficients; both models are linear in their coefficients.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import numpy as np  # noqa: E402

from ds_ulysses_ext.memory.planner import (CALIBRATION_FILE, TIME_TERMS, memory_features, predict,  # noqa: E402
                                           time_features)
from engine.run.auto_memory import calibration_case  # noqa: E402

MEMORY_TERMS = ("state_scale", "act_scale", "transient_scale", "const_gib")


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """min ||a x - b|| with x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= 1e-12).all():
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit(rows) -> dict:
    cases = [calibration_case(r) for r in rows]
    mem = [memory_features(*c) for c in cases]
    peak = np.array([r["peak_alloc_gib"] for r in rows])
    a = np.array([[m["states"], m["kept"], m["transient"], 1.0] for m in mem])
    x = nnls(a / peak[:, None], np.ones(len(rows)))
    coef = dict(zip(MEMORY_TERMS, map(float, x)))
    step = np.array([r["step_s"] for r in rows])
    feats = [time_features(*c) for c in cases]
    a = np.array([[f[k] for k in TIME_TERMS] for f in feats])
    used = a.any(axis=0)
    y = np.zeros(len(TIME_TERMS))
    y[used] = nnls(a[:, used] / step[:, None], np.ones(len(rows)))
    coef.update({f"time_{k}": float(v) for k, v in zip(TIME_TERMS, y)})
    return coef


def table(rows, coef) -> str:
    out = ["| model | S | cp | preset | settings | peak GiB measured / predicted | error | step s measured / predicted "
           "| error | use |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = predict(*calibration_case(r), coef)
        master = f"master {r['master_weights']}" + ("" if r.get("shared_master", True) else " (own copy)")
        settings = ", ".join(x for x in (master, r["attn_backend"], "fused kernels" if r["kernels"] == "fused" else "",
                                         "moe.recompute=experts" if r["moe_recompute"] == "experts" else "",
                                         *(f"memory.{k}={json.dumps(v)}" for k, v in
                                           r.get("memory_overrides", {}).items())) if x)
        em = p.peak_gib / r["peak_alloc_gib"] - 1
        et = p.step_s / r["step_s"] - 1
        flag = lambda e: f"**{e:+.0%}**" if abs(e) > 0.15 else f"{e:+.0%}"  # noqa: E731
        out.append(f"| {r['model']} | {r['seq_len'] // 1024}k | {r['cp']} | {r['memory']} | {settings} | "
                   f"{r['peak_alloc_gib']:.1f} / {p.peak_gib:.1f} | {flag(em)} | {r['step_s']:.3g} / {p.step_s:.3g} | "
                   f"{flag(et)} | {r['use']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="use the stored coefficients; write nothing")
    args = ap.parse_args()
    data = json.loads(CALIBRATION_FILE.read_text())
    rows = data["rows"]
    if not args.check:
        data["coefficients"] = fit([r for r in rows if r["use"] == "fit"])
        CALIBRATION_FILE.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data["coefficients"], indent=1))
    print(table(rows, data["coefficients"]))


if __name__ == "__main__":
    main()
