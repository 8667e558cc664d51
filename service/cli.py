"""``memfit`` terminal command: the /recommend answer as a table, from a server or locally.

    memfit recommend --model llama-3-8b --gpu H100-80GB --gpus 8 --zero 3 --micro-batch 2 --seq-len 8192
    memfit recommend ... --url http://127.0.0.1:8000      # ask a running service instead
    memfit recommend ... --json                           # the raw JSON answer

Exit codes: 0 fits, 3 infeasible (alternatives printed), 2 bad input, 1 service unreachable / no model.
"""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from memfit.api import Recommendation, RecommendRequest

GIB = 1 << 30
ZERO = {0: "none", 1: "zero1", 2: "zero2", 3: "zero3"}


def _request(a: argparse.Namespace) -> RecommendRequest:
    cluster: dict = {"gpu_count": a.gpus}
    if a.gpu_memory_gib is not None:
        cluster["gpu_memory_gib"] = a.gpu_memory_gib
    else:
        cluster["gpu"] = a.gpu
    training = {"micro_batch_size": a.micro_batch, "seq_len": a.seq_len, "precision": a.precision,
                "optimizer": a.optimizer, "sharding": a.sharding or ZERO[a.zero], "attention": a.attention,
                "finetune": "lora" if a.lora_rank else "full"}
    if a.lora_rank:
        training["lora_rank"] = a.lora_rank
    if a.data_parallel is not None:
        training["data_parallel_size"] = a.data_parallel
    return RecommendRequest.model_validate({"model": a.model, "training": training, "cluster": cluster,
                                            "headroom_fraction": a.headroom, "layout": a.layout})


def _local(req: RecommendRequest, registry: str | None) -> Recommendation:
    from model.registry import Registry
    from service.models import ModelHolder

    holder = ModelHolder(Registry(registry))
    holder.refresh()
    if holder.recommender is None:
        raise RuntimeError(f"no model registered ({holder.last_error or 'run: python -m training.retrain'})")
    return holder.recommender.recommend(req)


def _remote(req: RecommendRequest, url: str, timeout_s: float) -> Recommendation:
    import httpx

    r = httpx.post(url.rstrip("/") + "/recommend", json=req.model_dump(mode="json"), timeout=timeout_s)
    if r.status_code >= 400:
        detail = r.json().get("detail", r.text) if r.headers.get("content-type", "").endswith("json") else r.text
        raise ValueError(f"service answered {r.status_code}: {detail}")
    return Recommendation.model_validate(r.json())


def render(rec: Recommendation) -> None:
    """Print the answer as tables (rich)."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    head = Table(title=f"memfit recommendation — {rec.model_name or 'model'} (model {rec.model_version})")
    head.add_column("")
    head.add_column("value", justify="right")
    verdict = f"checkpoint {rec.k} of {rec.num_layers} layers" if rec.fits else "does not fit at any k"
    head.add_row("answer", verdict)
    if rec.fits:
        head.add_row("layers", ", ".join(map(str, rec.layers)) or "none")
        head.add_row("recompute overhead", f"{rec.recompute_overhead_fraction:.1%} of step compute")
    head.add_row("predicted peak (allocated)", f"{rec.predicted_peak_bytes / GIB:.2f} GiB")
    head.add_row("upper bound + overhead", f"{rec.total_upper_bytes / GIB:.2f} GiB")
    head.add_row("usable / capacity", f"{rec.usable_bytes / GIB:.2f} / {rec.capacity_bytes / GIB:.2f} GiB")
    if not rec.fits:
        head.add_row("shortfall", f"{rec.shortfall_bytes / GIB:.2f} GiB")
    con.print(head)
    parts = Table(title="breakdown at k")
    parts.add_column("part")
    parts.add_column("GiB", justify="right")
    for k, v in {**rec.breakdown, "overhead_bytes": rec.overhead["total_bytes"]}.items():
        parts.add_row(k.removesuffix("_bytes"), f"{v / GIB:.2f}")
    con.print(parts)
    curve = Table(title="memory over k (GiB)")
    for col in ("k", "predicted", "bound+overhead", "fits"):
        curve.add_column(col, justify="right")
    step = max(1, len(rec.curve) // 12)
    for c in rec.curve[::step] + ([rec.curve[-1]] if (len(rec.curve) - 1) % step else []):
        curve.add_row(str(c.k), f"{c.predicted_bytes / GIB:.2f}", f"{c.total_upper_bytes / GIB:.2f}",
                      "yes" if c.total_upper_bytes <= rec.usable_bytes else "no")
    con.print(curve)
    if rec.alternatives:
        alt = Table(title="alternatives")
        for col in ("change", "fits", "k", "bound+overhead GiB"):
            alt.add_column(col)
        for a in rec.alternatives:
            alt.add_row(a.description, "yes" if a.fits else "no", str(a.k), f"{a.total_upper_bytes / GIB:.2f}")
        con.print(alt)
    for w in rec.warnings:
        con.print(f"[yellow]warning:[/yellow] {w}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memfit", description="Fit LLM training into GPU memory.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("recommend", help="how many layers to checkpoint")
    r.add_argument("--model", required=True, help="catalog name, e.g. llama-3-8b")
    r.add_argument("--gpu", default="H100-80GB", help="known GPU name (default H100-80GB)")
    r.add_argument("--gpu-memory-gib", type=float, help="device memory instead of --gpu")
    r.add_argument("--gpus", type=int, default=1, help="GPU count")
    r.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0, help="ZeRO stage")
    r.add_argument("--sharding", help="explicit sharding (fsdp_full_shard, ...) instead of --zero")
    r.add_argument("--data-parallel", type=int, help="data-parallel size (default: all GPUs)")
    r.add_argument("--micro-batch", type=int, required=True)
    r.add_argument("--seq-len", type=int, required=True)
    r.add_argument("--precision", default="amp_bf16")
    r.add_argument("--optimizer", default="adamw_foreach")
    r.add_argument("--attention", default="sdpa")
    r.add_argument("--lora-rank", type=int)
    r.add_argument("--headroom", type=float, default=0.05)
    r.add_argument("--layout", default="block", choices=["block", "even"])
    r.add_argument("--url", help="ask this memfit service instead of the local registry")
    r.add_argument("--registry", help="local model registry (default data/models)")
    r.add_argument("--timeout-s", type=float, default=10.0)
    r.add_argument("--json", action="store_true", help="print the JSON answer")
    a = p.parse_args(argv)
    try:
        req = _request(a)
        rec = _remote(req, a.url, a.timeout_s) if a.url else _local(req, a.registry)
    except (ValidationError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # unreachable service, missing model: say so plainly
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(rec.model_dump(mode="json"), indent=1))
    else:
        render(rec)
    return 0 if rec.fits else 3


if __name__ == "__main__":
    sys.exit(main())
