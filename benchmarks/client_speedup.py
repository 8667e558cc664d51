"""Step-time benchmark of the client's plan: the recommended k vs full checkpointing vs none (CPU).

    python -m benchmarks.client_speedup                         # local predictor fitted on the shipped telemetry
    python -m benchmarks.client_speedup --url http://127.0.0.1:8000
    python -m benchmarks.client_speedup --registry data/models --layers 8 --hidden 256 --seq-len 512

A random Llama (default 8 layers, hidden 256, seq 512) is described with :func:`memfit.describe`.
The served curve at a huge capacity gives the bound of every k; the device capacity is then set
between two points of the curve so that the recommendation is ``--target-k`` (0 < k < L; default
L // 4: memory is a little short of what k = 0 needs). Three identical models are trained with
AdamW: the recommended plan (``memfit.apply``), every layer checkpointed, and none. Steps run
round-robin across the three after one warm-up step each (a busy machine slows all three alike);
each figure is the median of ``--steps`` real steps, in wall seconds and in process CPU seconds (the
latter is robust to other load on a shared machine). Printed: medians and the ratios
full/recommended, recommended/none and full/none (timing only; peaks are not measured here).

Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _recommender(args):
    """A callable request -> Recommendation: a service (--url), a registry (--registry), or a predictor
    fitted here on the shipped telemetry (seconds)."""
    if args.url:
        import memfit

        client = memfit.Client(args.url, timeout_s=60, strict=True)
        return client.recommend, f"service {args.url}"
    from service.models import ModelHolder

    if args.registry:
        from model.registry import Registry

        holder = ModelHolder(Registry(args.registry))
        holder.refresh()
        if holder.recommender is None:
            raise SystemExit(f"no model in registry {args.registry}: {holder.last_error}")
        return holder.recommender.recommend, f"registry {args.registry} version {holder.recommender.version}"
    import pandas as pd

    from model.estimator import PeakMemoryRegressor
    from service.recommender import Recommender

    path = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "telemetry.parquet"
    df = pd.read_parquet(path)
    df = df[~df["oom"].astype(bool)]
    est = PeakMemoryRegressor(n_estimators=80, num_leaves=31, n_jobs=1).fit(
        df, df["peak_allocated_bytes"], groups=df["model_name"]
    )
    return Recommender(est, "bench-local").recommend, f"predictor fitted here on {len(df)} shipped rows"


def _step(model, opt, ids) -> tuple[float, float]:
    """One real training step: (wall seconds, process CPU seconds)."""
    t0, c0 = time.perf_counter(), time.process_time()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.client_speedup", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="memfit service URL")
    p.add_argument("--registry", help="local model registry (instead of a service)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median)")
    p.add_argument("--target-k", type=int, help="k the capacity should force (default layers // 4)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: steadiest figures on a shared machine; 0 = torch's default)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    a = p.parse_args(argv)
    L = a.layers
    target = a.target_k if a.target_k is not None else max(1, L // 4)
    if not 0 < target < L:
        print(f"error: --target-k must be in [1, {L - 1}]", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)

    import memfit
    from memfit.hf import build_causal_lm, quiet_transformers

    cfg = {
        "model_type": "llama",
        "num_hidden_layers": L,
        "hidden_size": a.hidden,
        "intermediate_size": a.ffn,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.heads,
        "vocab_size": a.vocab,
        "max_position_embeddings": a.seq_len,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    with quiet_transformers():
        base = build_causal_lm(cfg)
    recommend, source = _recommender(a)

    def request(capacity: int):
        return memfit.describe(
            base,
            micro_batch_size=a.micro_batch,
            seq_len=a.seq_len,
            gpu_memory_bytes=capacity,
            headroom_fraction=0.0,
            optimizer="adamw_foreach",
        )

    curve = [c.total_upper_bytes for c in recommend(request(1 << 40)).curve]
    below = min(curve[:target])
    if not curve[target] < below:
        print(
            f"error: the predicted bound at k={target} ({curve[target]}) is not below every smaller k's "
            f"({below}); pick another --target-k",
            file=sys.stderr,
        )
        return 2
    capacity = curve[target] + (below - curve[target]) // 2
    rec = recommend(request(capacity))
    if rec.k is None or not 0 < rec.k < L:
        print(f"error: recommendation k={rec.k} is not inside (0, {L})", file=sys.stderr)
        return 2

    models = {"recommended": copy.deepcopy(base), "full": copy.deepcopy(base), "none": copy.deepcopy(base)}
    plans = {
        "recommended": memfit.apply(models["recommended"], rec),
        "full": memfit.apply(models["full"], list(range(L))),
        "none": memfit.apply(models["none"], []),
    }
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for n, m in models.items()}
    ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq_len), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {n: [] for n in models}
    cpu: dict[str, list[float]] = {n: [] for n in models}
    for n, m in models.items():  # warm-up: optimizer states, allocator, thread pools
        _step(m, opts[n], ids)
    for _ in range(a.steps):
        for n, m in models.items():
            wall, used = _step(m, opts[n], ids)
            times[n].append(wall)
            cpu[n].append(used)
    for n, plan in plans.items():
        assert plan.verify(), f"{n}: recomputed {sorted(plan.recomputed)} != planned {plan.layer_indices}"
    med = {n: statistics.median(t) for n, t in times.items()}
    med_cpu = {n: statistics.median(t) for n, t in cpu.items()}
    out = {
        "source": source,
        "model_version": rec.model_version,
        "layers": L,
        "hidden": a.hidden,
        "seq_len": a.seq_len,
        "micro_batch": a.micro_batch,
        "vocab": a.vocab,
        "threads": torch.get_num_threads(),
        "capacity_bytes": capacity,
        "k": rec.k,
        "recommended_layers": rec.layers,
        "predicted_recompute_fraction": rec.recompute_overhead_fraction,
        "median_step_s": {n: round(v, 4) for n, v in med.items()},
        "all_steps_s": {n: [round(x, 4) for x in t] for n, t in times.items()},
        "speedup_vs_full": round(med["full"] / med["recommended"], 3),
        "slowdown_vs_none": round(med["recommended"] / med["none"], 3),
        "full_vs_none": round(med["full"] / med["none"], 3),
        "median_cpu_s": {n: round(v, 4) for n, v in med_cpu.items()},
        "cpu_speedup_vs_full": round(med_cpu["full"] / med_cpu["recommended"], 3),
        "cpu_full_vs_none": round(med_cpu["full"] / med_cpu["none"], 3),
    }
    if a.json:
        print(json.dumps(out))
        return 0
    print(
        f"model: llama {L} layers, hidden {a.hidden}, ffn {a.ffn}, vocab {a.vocab}; micro-batch {a.micro_batch} x "
        f"seq {a.seq_len}; {torch.get_num_threads()} threads; recommendations from {source}"
    )
    print(
        f"capacity {capacity / 2**20:.1f} MiB -> recommended k={rec.k} of {L} (layers {rec.layers}), "
        f"model {rec.model_version}"
    )
    for n in ("none", "recommended", "full"):
        print(
            f"  {n:<12} k={plans[n].k:<3} median step {med[n]:.3f} s wall, {med_cpu[n]:.3f} s CPU   "
            f"wall steps {out['all_steps_s'][n]}"
        )
    print(
        f"speedup of the recommended k over full checkpointing: {out['speedup_vs_full']:.3f}x "
        f"(goal >= 1.25x); cost over no checkpointing: {out['slowdown_vs_none']:.3f}x; "
        f"full over none: {out['full_vs_none']:.3f}x"
    )
    print(
        f"same ratios in process CPU time (robust to other load on the machine): recommended over full "
        f"{out['cpu_speedup_vs_full']:.3f}x, full over none {out['cpu_full_vs_none']:.3f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
