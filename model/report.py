"""Evaluation report: ``report.json``, ``report.md`` and PNG figures (matplotlib, Agg backend).

Input is the results dict of :mod:`training.retrain` (or :mod:`benchmarks.accuracy`): one
:func:`model.evaluate.cross_evaluate` summary per split under the split's name, plus optional
``data``, ``gate`` and ``promotion`` sections. Memory is shown in GiB (2**30 bytes), errors in percent.

Targets (marked met / not met / n/a when the figure is missing):

* MAPE <= 3 % leave-architecture-out, <= 5 % small-to-large;
* upper-bound coverage >= 95 %; OOM rate of the k recommendation = 0; exact-k rate >= 90 % (each split).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from memfit.schema import GIB

#: (label, split, section, key, comparison, threshold, scale for display)
TARGETS: list[tuple[str, str, str, str, str, float, float]] = [
    ("MAPE leave-architecture-out", "leave_architecture_out", "metrics", "mape_pct", "<=", 3.0, 1),
    ("MAPE small-to-large", "small_to_large", "metrics", "mape_pct", "<=", 5.0, 1),
    ("Bound coverage leave-architecture-out", "leave_architecture_out", "metrics", "coverage", ">=", 0.95, 100),
    ("Bound coverage small-to-large", "small_to_large", "metrics", "coverage", ">=", 0.95, 100),
    ("OOM rate leave-architecture-out", "leave_architecture_out", "oracle", "oom_rate", "<=", 0.0, 100),
    ("OOM rate small-to-large", "small_to_large", "oracle", "oom_rate", "<=", 0.0, 100),
    ("Exact-k rate leave-architecture-out", "leave_architecture_out", "oracle", "exact_k_rate", ">=", 0.90, 100),
    ("Exact-k rate small-to-large", "small_to_large", "oracle", "exact_k_rate", ">=", 0.90, 100),
]
SPLIT_TITLES = {
    "leave_architecture_out": "Leave-architecture-out (GroupKFold by model_name)",
    "small_to_large": "Small-to-large (train <= 13.5B parameters, test bigger)",
}


def target_status(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its value (display units: % for rates) and ``met`` / ``not met`` / ``n/a``."""
    out = []
    for label, split, section, key, op, thr, scale in TARGETS:
        v = results.get(split, {}).get(section, {}).get(key)
        ok = _finite(v)
        status = "n/a" if not ok else ("met" if (v <= thr if op == "<=" else v >= thr) else "not met")
        out.append(
            {
                "target": label,
                "value": v * scale if ok else None,
                "goal": f"{op} {thr * scale:g}",
                "unit": "%",
                "status": status,
            }
        )
    return out


def write_report(
    out_dir: str | Path, results: dict[str, Any], df: pd.DataFrame, oof_pred, oof_upper=None
) -> dict[str, Path]:
    """Write the report files into ``out_dir`` (created).

    Args:
        results: see the module docstring.
        df: the evaluated rows (flat telemetry columns).
        oof_pred: leave-architecture-out predictions aligned to ``df`` (bytes, NaN = not predicted).
        oof_upper: the matching upper bounds (bytes), optional.

    Returns:
        ``{"json", "md", "pred_vs_measured", "error_by_architecture", "memory_vs_k"}`` -> paths
        (a figure with nothing to draw is skipped and left out).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pred = np.asarray(oof_pred, dtype="float64")
    upper = None if oof_upper is None else np.asarray(oof_upper, dtype="float64")
    targets = target_status(results)
    paths: dict[str, Path] = {}
    paths.update(_figures(out, df, pred, upper))
    payload = {"targets": targets, **results, "figures": {k: p.name for k, p in paths.items()}}
    paths["json"] = out / "report.json"
    paths["json"].write_text(json.dumps(json_safe(payload), indent=1, default=str))
    paths["md"] = out / "report.md"
    paths["md"].write_text(_markdown(results, targets, paths))
    return paths


# -- markdown ---------------------------------------------------------------------------------------
def _markdown(results: dict[str, Any], targets: list[dict[str, Any]], paths: dict[str, Path]) -> str:
    lines = ["# memfit predictor evaluation", ""]
    if "data" in results:
        lines += ["## Data", "", *_kv_table(results["data"]), ""]
    lines += ["## Targets", "", "| target | value | goal | status |", "|---|---|---|---|"]
    for t in targets:
        v = "—" if t["value"] is None else f"{t['value']:.2f} %"
        lines.append(f"| {t['target']} | {v} | {t['goal']} % | **{t['status']}** |")
    lines.append("")
    for split, title in SPLIT_TITLES.items():
        s = results.get(split)
        if not s:
            continue
        lines += [f"## {title}", ""]
        if s.get("skipped"):
            lines += [f"Skipped: {s['skipped']}", ""]
            continue
        lines += [
            (
                f"{s.get('n_test', 0)} test rows, {s.get('n_folds', 0)} fold(s); test architectures: "
                f"{', '.join(s.get('test_architectures', []))}"
            ),
            "",
            "### Error",
            "",
            *_metrics_table({"memfit": s["metrics"]}),
            "",
        ]
        lines += [
            "### Baselines on the same rows",
            "",
            "| estimator | MAPE % | p95 rel. err % | MAPE / memfit MAPE |",
            "|---|---|---|---|",
            (f"| memfit | {_f(s['metrics']['mape_pct'])} | {_f(s['metrics']['p95_rel_err_pct'])} | 1.00 |"),
        ]
        for name, b in s.get("baselines", {}).items():
            lines.append(f"| {name} | {_f(b['mape_pct'])} | {_f(b['p95_rel_err_pct'])} | {_f(b['ratio_to_memfit'])} |")
        lines += [
            "",
            "### k recommendation vs measured oracle",
            "",
            (
                "| capacity GiB | cases | exact-k % | OOM % | over % | false infeasible % | mean extra layers "
                "| both infeasible |"
            ),
            "|---|---|---|---|---|---|---|---|",
        ]
        o = s.get("oracle", {})
        for cap, row in [("all", o), *o.get("per_capacity", {}).items()]:
            if not row:
                continue
            lines.append(
                f"| {cap} | {row['n_cases']} | {_pct(row['exact_k_rate'])} | {_pct(row['oom_rate'])} | "
                f"{_pct(row['over_rate'])} | {_pct(row['false_infeasible_rate'])} | "
                f"{_f(row['mean_extra_layers'])} | {row['n_both_infeasible']} |"
            )
        lines += ["", "### Per architecture", "", *_metrics_table(s.get("per_architecture", {})), ""]
    for section in ("gate", "promotion", "training"):
        if section in results:
            lines += [f"## {section.capitalize()}", "", *_kv_table(results[section]), ""]
    figs = [p for k, p in paths.items() if p.suffix == ".png"]
    if figs:
        lines += ["## Figures", ""] + [f"![{p.stem}]({p.name})" for p in figs] + [""]
    return "\n".join(lines)


def _metrics_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    out = [
        "| | n | MAPE % | p95 rel. err % | max rel. err % | coverage % | mean bound excess % |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in rows.items():
        out.append(
            f"| {name} | {m['n']} | {_f(m['mape_pct'])} | {_f(m['p95_rel_err_pct'])} | "
            f"{_f(m['max_rel_err_pct'])} | {_pct(m['coverage'])} | {_f(m['mean_upper_excess_pct'])} |"
        )
    return out


def _kv_table(d: dict[str, Any]) -> list[str]:
    out = ["| | |", "|---|---|"]
    for k, v in d.items():
        if isinstance(v, float):
            v = _f(v, 4)
        elif isinstance(v, (dict, list)):
            v = json.dumps(json_safe(v), default=str)
            v = v if len(v) <= 300 else v[:297] + "..."
        out.append(f"| {k} | {str(v).replace('|', '/')} |")
    return out


def _f(v: Any, digits: int = 2) -> str:
    return f"{v:.{digits}f}" if _finite(v) else "—"


def _pct(v: Any) -> str:
    return f"{100 * v:.1f}" if _finite(v) else "—"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def json_safe(o: Any) -> Any:
    """JSON-safe copy: NaN/inf -> null, numpy scalars/arrays -> Python."""
    if isinstance(o, dict):
        return {str(k): json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    if isinstance(o, np.ndarray):
        return json_safe(o.tolist())
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o


# -- figures ----------------------------------------------------------------------------------------
def _figures(out: Path, df: pd.DataFrame, pred: np.ndarray, upper: np.ndarray | None) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from model.evaluate import FAMILY_COLUMNS, group_labels

    paths: dict[str, Path] = {}
    ok = np.isfinite(pred)
    if not ok.any():
        return paths
    y = df["peak_allocated_bytes"].to_numpy(dtype="float64")
    arch = group_labels(df)

    fig, ax = plt.subplots(figsize=(6, 6))
    names = sorted(set(arch[ok]))
    cmap = plt.get_cmap("tab20", max(len(names), 1))
    for i, name in enumerate(names):
        sel = ok & (arch == name)
        ax.scatter(y[sel] / GIB, pred[sel] / GIB, s=10, color=cmap(i), label=name if len(names) <= 20 else None)
    lo, hi = np.nanmin([y[ok].min(), pred[ok].min()]) / GIB, np.nanmax([y[ok].max(), pred[ok].max()]) / GIB
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, "k-", lw=0.8, label="y = x")
    ax.plot(xs, xs * 1.03, "k:", lw=0.6, label="±3 %")
    ax.plot(xs, xs * 0.97, "k:", lw=0.6)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="measured peak (GiB)",
        ylabel="predicted peak (GiB)",
        title="Leave-architecture-out predictions",
    )
    ax.legend(fontsize=6, loc="upper left")
    paths["pred_vs_measured"] = _save(fig, out / "pred_vs_measured.png")

    err = 100 * (pred - y) / y
    fig, ax = plt.subplots(figsize=(7, max(3, 0.3 * len(names) + 1)))
    ax.boxplot([err[ok & (arch == n)] for n in names], vert=False, showfliers=True)
    ax.set_yticks(range(1, len(names) + 1), names, fontsize=7)
    ax.axvline(0, color="k", lw=0.8)
    for v in (-3, 3):
        ax.axvline(v, color="k", ls=":", lw=0.6)
    ax.set(xlabel="relative error (predicted - measured) / measured, %", title="Error by held-out architecture")
    paths["error_by_architecture"] = _save(fig, out / "error_by_architecture.png")

    fig = _curves(df, pred, upper, ok, arch, [c for c in FAMILY_COLUMNS if c in df.columns])
    if fig is not None:
        paths["memory_vs_k"] = _save(fig, out / "memory_vs_k.png")
    return paths


def _curves(
    df: pd.DataFrame, pred: np.ndarray, upper: np.ndarray | None, ok: np.ndarray, arch: np.ndarray, cols: list[str]
):
    """One panel per held-out architecture: measured and predicted peak (and bound) over k, side by side."""
    import matplotlib.pyplot as plt

    fams = _pick_families(df[ok], arch[ok], cols, 10_000)
    if not fams:
        return None
    y = df["peak_allocated_bytes"].to_numpy(dtype="float64")
    ncol = min(6, len(fams))
    nrow = -(-len(fams) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.6 * nrow), squeeze=False)
    for ax in axes.ravel()[len(fams) :]:
        ax.axis("off")
    for ax, (name, idx) in zip(axes.ravel(), fams):
        rows = df.loc[np.asarray(idx)]
        k = rows["num_checkpointed_layers"].to_numpy()
        order = np.argsort(k)
        pos = df.index.get_indexer(np.asarray(idx))[order]
        ax.plot(k[order], y[pos] / GIB, "o-", ms=3, label="measured")
        ax.plot(k[order], pred[pos] / GIB, "s--", ms=3, label="predicted")
        if upper is not None:
            ax.plot(k[order], upper[pos] / GIB, ":", lw=0.8, label="bound")
        r = rows.iloc[0]
        ax.set_title(
            f"{name}\nmb={r['micro_batch_size']} s={r['seq_len']} {r['precision']} {r['sharding']}", fontsize=7
        )
        ax.tick_params(labelsize=6)
        ax.set_xlabel("checkpointed layers k", fontsize=6)
        ax.set_ylabel("peak GiB", fontsize=6)
    axes.ravel()[0].legend(fontsize=6)
    return fig


def curves_figure(out_dir: str | Path, df: pd.DataFrame, pred, upper=None) -> Path:
    """Write ``memory_vs_k.png``: per held-out architecture, predicted vs measured curves over k."""
    import matplotlib

    matplotlib.use("Agg")
    from model.evaluate import FAMILY_COLUMNS, group_labels

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pred = np.asarray(pred, dtype="float64")
    fig = _curves(
        df,
        pred,
        None if upper is None else np.asarray(upper, dtype="float64"),
        np.isfinite(pred),
        group_labels(df),
        [c for c in FAMILY_COLUMNS if c in df.columns],
    )
    return _save(fig, out / "memory_vs_k.png")


def _pick_families(df: pd.DataFrame, arch: np.ndarray, cols: list[str], n: int) -> list[tuple[str, list]]:
    """Up to ``n`` families of distinct architectures with the most k points (largest models first)."""
    if not cols or df.empty:
        return []
    d = df.assign(_arch=arch)
    best: dict[str, tuple[int, float, list]] = {}
    for _key, g in d.groupby(cols, dropna=False, sort=False):
        a = g["_arch"].iloc[0]
        score = (g["num_checkpointed_layers"].nunique(), float(g["total_params"].iloc[0]))
        if a not in best or score > best[a][:2]:
            best[a] = (*score, list(g.index))
    ranked = sorted(best.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))
    return [(a, v[2]) for a, v in ranked[:n] if v[0] >= 2]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
