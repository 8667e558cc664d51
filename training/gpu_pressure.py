"""How much memory a training step really needs on a GPU: the smallest allocator cap it runs under.

The peak *reserved* bytes of an unconstrained run are no OOM threshold: the caching allocator keeps
freed blocks while memory is plentiful, and when a ``cudaMalloc`` fails it releases its cached blocks
and retries (``num_alloc_retries``). What decides "fits" is the smallest cap under which the step still
runs, which lies between the peak allocated bytes and the unconstrained peak reserved bytes. This
script measures it: for each configuration it runs one warm-up step, measures the peak allocated
bytes ``P`` and reserved bytes ``R``, then bisects the cap ``C`` in ``[P, R + 256 MiB]`` with
``torch.cuda.set_per_process_memory_fraction`` (the caching allocator's limit on reserved memory,
PyTorch docs, ``torch.cuda.set_per_process_memory_fraction``). Each trial empties the cache and runs two
steps, as a job runs step after step. ``needed_over_allocated = C_min / P`` is the fragmentation a
prediction of allocated bytes must leave room for.

Run on a machine with one CUDA GPU (one call, a few minutes)::

    python -m training.gpu_pressure --out "$OUT" --budget-s 200
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m training.gpu_pressure --out "$OUT" --tag expandable

Writes ``gpu_pressure_<tag>.json`` in ``--out``: per configuration ``P``, ``R``, ``C_min`` (bytes,
resolution ``--resolution-mib``) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20


def _step(run, opt, ids) -> None:
    from tracer.collect import _run_steps

    _run_steps(run.model, opt, ids, 1, None, run.use_autocast, run.on, run.amp_dtype, run.live)


def _fits(run, opt, ids, cap_bytes: int, total_bytes: int, steps: int = 2) -> bool:
    """Whether ``steps`` training steps run with the allocator limited to ``cap_bytes`` reserved."""
    import torch

    opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total_bytes))
    try:
        for _ in range(steps):
            _step(run, opt, ids)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        opt.zero_grad(set_to_none=True)
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def measure(fam, k: int, resolution_bytes: int) -> dict[str, Any]:
    """Peak allocated, unconstrained peak reserved and the smallest cap that runs, for one (family, k)."""
    import torch

    from data import catalog
    from memfit.checkpointing import apply_activation_checkpointing
    from tracer.collect import prepared_model

    cfg = catalog.get(fam.model)["hf_config"]
    total = torch.cuda.get_device_properties(0).total_memory
    with prepared_model(cfg, fam.training(), model_name=fam.model, device="cuda") as run:
        apply_activation_checkpointing(run.model, list(range(k)), layers=run.layers)
        ids = run.input_ids(fam.micro_batch_size, fam.seq_len)
        opt = run.make_optimizer()
        _step(run, opt, ids)  # warm-up: optimizer states exist from here on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _step(run, opt, ids)
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        lo, hi = allocated, reserved + 256 * MIB  # lo never runs below the allocated peak; hi is checked
        trials = 0
        if not _fits(run, opt, ids, hi, total):
            return {"allocated_bytes": allocated, "reserved_bytes": reserved, "error": "does not run at R + 256 MiB"}
        while hi - lo > resolution_bytes:
            mid = (lo + hi) // 2
            trials += 1
            if _fits(run, opt, ids, mid, total):
                hi = mid
            else:
                lo = mid
        del opt
    torch.cuda.empty_cache()
    return {
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "min_cap_bytes": hi,
        "trials": trials,
        "needed_over_allocated": hi / allocated,
        "reserved_over_allocated": reserved / allocated,
        "needed_minus_allocated_bytes": hi - allocated,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.gpu_pressure", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tag", default="default", help="names the output file (e.g. the allocator setting)")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new configurations after this")
    p.add_argument("--resolution-mib", type=int, default=32)
    a = p.parse_args(argv)
    import torch

    from training.gpu_validate import _pairs

    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    t0, rows = time.perf_counter(), []
    for fam, k in _pairs(None):
        if time.perf_counter() - t0 > a.budget_s:
            break
        try:
            row = measure(fam, k, a.resolution_mib * MIB)
        except Exception as err:  # noqa: BLE001 - one failed configuration must not cost the call
            row = {"error": f"{type(err).__name__}: {err}"[:300]}
        row = {"family": fam.__dict__, "k": k, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "tag": a.tag,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "resolution_mib": a.resolution_mib,
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
    (a.out / f"gpu_pressure_{a.tag}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
