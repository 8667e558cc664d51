"""Shared bits of the examples: command line and getting a plan (from a service, or --k)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os


def cpu_frameworks() -> None:
    """Without CUDA, tell DeepSpeed (imported by transformers/accelerate when installed) to use its CPU
    accelerator instead of logging a warning that it guessed so."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--url", help="memfit service URL; without it the plan is the first --k layers")
    p.add_argument("--token", help="bearer token for telemetry")
    p.add_argument("--k", type=int, default=2, help="checkpointed layers when no --url is given (default 2)")
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="device memory to plan for with --url (GiB); default: the smallest capacity at which the service "
        "answers about half the layers checkpointed",
    )
    p.add_argument("--steps", type=int, default=2, help="training steps (default 2: the peak is in the first two)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")


def plan_source(args, describe_request, num_layers: int):
    """The recommendation from the service (``--url``), or the first ``--k`` layers.

    ``describe_request(gpu_memory_bytes)`` builds the request (``memfit.describe``). Without
    ``--gpu-memory-gib`` the capacity is the smallest whole MiB at which the service answers k <= L // 2, found by
    bisection over the service's own answers (its decision is monotone in the capacity), so that the answer is
    0 < k < L whatever the fit test (allocated bound, simulated caching allocator, the room it keeps free). A tiny
    model needs little more than the fixed per-GPU overhead (CUDA context etc.), so any real GPU fits it at k = 0.
    """
    if args.url:
        import memfit

        try:
            client = memfit.Client(args.url, token=args.token, strict=True)
        except ValueError as err:  # not an http(s) URL
            raise SystemExit(f"--url: {err}") from None
        try:
            return _service_plan(client, args, describe_request, num_layers)
        except (memfit.ServiceError, memfit.RequestRejected) as err:  # unreachable, or the request refused
            raise SystemExit(f"memfit service at {args.url}: {err}") from None
    if not 0 <= args.k <= num_layers:
        raise SystemExit(f"--k={args.k} must be in [0, {num_layers}]")
    return list(range(args.k))


def _service_plan(client, args, describe_request, num_layers: int):
    """:func:`plan_source`'s service answer (raises what :class:`memfit.Client` raises)."""
    if args.gpu_memory_gib:
        rec = client.recommend(describe_request(int(args.gpu_memory_gib * 2**30)))
    else:
        k, rec = num_layers // 2, None
        lo, hi = 1, 1 << 20  # MiB: nothing fits at lo, everything at hi (1 TiB)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            answer = client.recommend(describe_request(mid << 20))
            if answer.fits and answer.k <= k:
                hi, rec = mid, answer
            else:
                lo = mid
        rec = rec or client.recommend(describe_request(hi << 20))
        print(f"capacity found with the service: {hi} MiB (forces k={rec.k}, asked for k <= {k})")
    print(
        f"service answer: k={rec.k} of {rec.num_layers}, model_version={rec.model_version}, "
        f"predicted peak {rec.predicted_peak_bytes / 2**20:.1f} MiB"
    )
    return rec


def print_plan(plan, verified: bool) -> None:
    print(
        f"applied plan: k={plan.k}, layers={plan.layer_indices}, mechanism={plan.mechanism}, "
        f"recomputed={sorted(plan.recomputed)}, verified={verified}"
    )


@contextlib.contextmanager
def peak_meter(model):
    """Measure the peak allocated bytes of what runs inside (``meter["bytes"]`` afterwards; on CPU
    ``meter["peak_fn"]()`` is the peak so far, for a telemetry reporter).

    On a GPU: CUDA's allocator statistics. On CPU: the live-storage tracker memfit's telemetry is
    collected with (``tracer.tracker.LiveStorageTracker``: tensor storages, 512-byte blocks), with
    the model's parameters counted from the start.
    """
    import torch

    meter: dict = {"peak_fn": None}  # CPU: the peak so far (a reporter's peak_fn); CUDA: the reporter measures it
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        yield meter
        meter.update(bytes=torch.cuda.max_memory_allocated(), method="cuda")
        return
    from tracer.tracker import LiveStorageTracker

    tracker = LiveStorageTracker()
    meter["peak_fn"] = lambda: tracker.peak_bytes
    with tracker:
        tracker.track_tensors(list(model.parameters()))
        yield meter
    meter.update(bytes=tracker.peak_bytes, method="cpu tracker")


def predicted_peak(rec, describe_request, k: int):
    """(predicted peak bytes at ``k``, source) from the service's curve (``--url``), else from the local
    model registry (needs memfit[service]); (None, why) when neither answers."""
    if rec is not None and hasattr(rec, "curve") and rec.curve:
        return rec.curve[k].predicted_bytes, f"service, predictor {rec.model_version}"
    try:
        from service.cli import recommend_local

        local = recommend_local(describe_request(80 << 30), None)
    except Exception as err:  # noqa: BLE001 - no registry / service extra: say so instead of failing the example
        return None, f"no local predictor ({type(err).__name__}: {err})"
    return local.curve[k].predicted_bytes, f"local registry, predictor {local.model_version}"


def print_measured_vs_predicted(meter: dict, predicted: tuple, k: int) -> None:
    measured = meter.get("bytes")
    value, source = predicted
    line = f"peak at k={k}: measured {measured / 2**20:.2f} MiB ({meter.get('method')})"
    if value is None:
        print(f"{line}; predicted: n/a ({source})")
    else:
        print(f"{line}; predicted {value / 2**20:.2f} MiB ({source}); measured/predicted {measured / value:.2f}")
