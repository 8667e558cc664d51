"""Where a job really runs out of memory on a capped GPU, with each allocator setting: issue 27's experiment.

Each job is run as a user would run it on a smaller card, on whatever CUDA GPU is at hand: the caching
allocator is capped with ``torch.cuda.set_per_process_memory_fraction`` at the card's PyTorch-visible total
(:data:`memfit.api.GPUS`) less the CUDA context this process already holds; the model is built, the first k
decoder layers are checkpointed with :func:`memfit.checkpointing.checkpoint_layers` (memfit's ``block``
plan), and one warm-up step and one measured step run. Starting at memfit's k, k goes down by one until the
first out-of-memory error. Each allocator setting runs in its own process (``PYTORCH_CUDA_ALLOC_CONF`` must
be set before CUDA starts), each k on its own model build after ``torch.cuda.empty_cache()``.

    python -m training.gpu_fit_check --out "$OUT"          # on a GPU: the issue's two jobs, both settings
    python -m training.gpu_fit_check --simulate             # on the CPU: the same jobs through model.allocator

Outputs: ``--out``/``gpu_fit_check.jsonl`` (one row per job, setting and k: allocated and reserved peaks,
out-of-memory and the size it tried to allocate, step time), a summary per job and setting (the smallest
k that ran), and the allocator's own trace (``torch.cuda.memory._record_memory_history``) of the first k that
ran out of memory and of the k before it, ``trace_<job>_<setting>_k<k>.json.gz``;
``python -m training.gpu_fit_check --replay-traces FILE...`` replays those through :mod:`model.allocator` on
the CPU, which separates errors of the allocator model from differences between the traced and the real
allocation stream. ``--simulate`` traces each k's step on fake tensors (:mod:`tracer.allocation`, cached), replays
it through :mod:`model.allocator` with the same cap and settings, and writes
``benchmarks/results/gpu_fit_check_simulated.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
SIMULATED = ROOT / "benchmarks" / "results" / "gpu_fit_check_simulated.jsonl"
SETTINGS = {"default": "", "expandable_segments": "expandable_segments:True"}


@dataclasses.dataclass(frozen=True)
class Job:
    """One row of issue 27's table.

    Attributes:
        name: short label.
        model: catalog name.
        card: the card capped to (a key of :data:`memfit.api.GPUS`).
        start_k: memfit's k for the job (issue 27's table), where the search starts.
        training: :class:`memfit.schema.TrainingConfig` fields (without ``checkpoint_layers``).
        issue_cap_gib: the cap the issue's run used (card total less the 0.51-0.76 GiB its process held), for
            ``--simulate``.
        measured: the issue's smallest k that ran per setting (None: none ran).
    """

    name: str
    model: str
    card: str
    start_k: int
    training: dict[str, Any]
    issue_cap_gib: float
    measured: dict[str, int | None]

    def training_config(self, k: int):
        from memfit.schema import TrainingConfig

        return TrainingConfig(**self.training, checkpoint_layers=list(range(k)))


JOBS: tuple[Job, ...] = (
    Job(
        "llama-3-8b-bf16",
        "llama-3-8b",
        "H100-80GB",
        26,
        {"micro_batch_size": 2, "seq_len": 4096, "precision": "bf16", "optimizer": "adamw_fused", "attention": "sdpa"},
        78.59,
        {"default": 22, "expandable_segments": 19},
    ),
    Job(
        "llama-3.2-3b-lora",
        "llama-3.2-3b",
        "RTX-4090",
        28,
        {
            "micro_batch_size": 2,
            "seq_len": 4096,
            "precision": "bf16",
            "optimizer": "adamw_fused",
            "attention": "sdpa",
            "finetune": "lora",
            "lora_rank": 16,
            "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        },
        22.90,
        {"default": None, "expandable_segments": 25},
    ),
)


def _tried(message: str) -> float | None:
    m = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB)", message)
    if not m:
        return None
    return float(m.group(1)) * (1 if m.group(2) == "GiB" else 1 / 1024)


# -- on a GPU ---------------------------------------------------------------------------------------------


def _history(torch, on: bool) -> bool:
    """Start (after clearing) or stop the allocator's trace (``torch.cuda.memory._record_memory_history``)."""
    try:
        torch.cuda.memory._record_memory_history(enabled=None)  # stops recording and clears the trace
        if on:
            torch.cuda.memory._record_memory_history(
                enabled="all", context=None, stacks="python", max_entries=20_000_000
            )
        return True
    except (RuntimeError, TypeError, AttributeError) as err:  # an older torch: run without the trace
        print(f"memory history unavailable: {err}", file=sys.stderr)
        return False


def _trace_entries(torch) -> list[list]:
    """``(action, addr, size)`` of the allocator trace recorded so far (device 0)."""
    traces = torch.cuda.memory._snapshot().get("device_traces") or [[]]
    return [[e["action"], int(e["addr"]), int(e["size"])] for e in traces[0]]


def _run_k(job: Job, k: int, trace: list | None = None) -> dict[str, Any]:
    """Build, checkpoint the first k layers, one warm-up and one measured step under the process's cap.

    With ``trace`` (a list), the allocator's trace of the whole run is recorded and appended to it:
    ``(action, addr, size)`` triples, a ``snapshot`` entry where the measured step starts.
    """
    import torch

    from data import catalog
    from memfit.checkpointing import checkpoint_layers
    from tracer.collect import _run_steps, prepared_model

    training = job.training_config(k)
    row: dict[str, Any] = {"job": job.name, "k": k, "oom": False}
    gc.collect()  # the previous k's model and optimizer, cycles included
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    recording = trace is not None and _history(torch, True)
    t0 = time.perf_counter()
    try:
        with prepared_model(catalog.get(job.model)["hf_config"], training, model_name=job.model, device="cuda") as run:
            plan = checkpoint_layers(run.model, list(range(k)), layers=run.layers)
            ids = run.input_ids(training.micro_batch_size, training.seq_len)
            opt = run.make_optimizer()
            _run_steps(run.model, opt, ids, 1, None, run.use_autocast, run.on, run.amp_dtype, run.live)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if recording:
                torch.cuda.memory._snapshot()  # leaves a 'snapshot' entry: the measured step starts here
            _, times = _run_steps(run.model, opt, ids, 1, None, run.use_autocast, run.on, run.amp_dtype, run.live)
            row.update(
                allocated_bytes=torch.cuda.max_memory_allocated(),
                reserved_bytes=torch.cuda.max_memory_reserved(),
                step_time_s=min(times),
                recomputed_layers=len(plan.recomputed),
            )
            del opt
    except torch.OutOfMemoryError as err:
        row.update(oom=True, tried_gib=_tried(str(err)), message=str(err)[:300])
    if recording:
        trace.extend(_trace_entries(torch))
        _history(torch, False)
    stats = torch.cuda.memory_stats()
    row.update(
        num_alloc_retries=stats.get("num_alloc_retries"),
        peak_allocated_any_bytes=torch.cuda.max_memory_allocated(),
        peak_reserved_any_bytes=torch.cuda.max_memory_reserved(),
        seconds=round(time.perf_counter() - t0, 1),
    )
    torch.cuda.empty_cache()
    return row


def run_setting(setting: str, jobs: list[Job], budget_s: float, out: Path | None = None) -> list[dict[str, Any]]:
    """In this process (its ``PYTORCH_CUDA_ALLOC_CONF`` already set): every job from memfit's k down to the
    first out-of-memory error. Each row is appended to ``out`` as soon as it is measured."""
    import torch

    from memfit.api import GPUS

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context exists from here on
    free, total = torch.cuda.mem_get_info()
    held = total - free - torch.cuda.memory_reserved()  # the CUDA context, not PyTorch's own 2 MiB segment
    t_start = time.perf_counter()
    rows = []
    for job in jobs:
        cap = GPUS[job.card] - held
        torch.cuda.set_per_process_memory_fraction(cap / total)
        ran: tuple[dict, list] | None = None
        for k in range(job.start_k, -1, -1):
            if time.perf_counter() - t_start > budget_s:
                rows.append({"job": job.name, "setting": setting, "k": k, "skipped": "time budget"})
                break
            trace: list = []
            row = {
                "setting": setting,
                "cap_bytes": cap,
                "context_bytes": held,
                "device": torch.cuda.get_device_name(0),
                "torch": torch.__version__,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                **_run_k(job, k, trace),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out is not None:
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            if row["oom"]:
                if out is not None:  # the allocator traces at the boundary: the first OOM and the k before it
                    _write_trace(out.parent, row, trace)
                    if ran is not None:
                        _write_trace(out.parent, *ran)
                break
            ran = (row, trace)
        torch.cuda.set_per_process_memory_fraction(1.0)
    return rows


def _write_trace(folder: Path, row: dict[str, Any], entries: list) -> None:
    import gzip

    if not entries:
        return
    path = folder / f"trace_{row['job']}_{row['setting']}_k{row['k']}.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"row": row, "entries": entries}, f)


def replay_traces(paths: list[Path]) -> list[dict[str, Any]]:
    """Replay recorded allocator traces (``trace_*.json.gz`` of a GPU run) through :mod:`model.allocator` at
    the run's cap and settings: does the model fail where the GPU failed, given the GPU's own allocations?"""
    import gzip

    from model.allocator import replay, stream_from_cuda_trace

    out = []
    for path in paths:
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
        row = doc["row"]
        stream = stream_from_cuda_trace(doc["entries"])
        r = replay(stream, SETTINGS[row["setting"]], row["cap_bytes"])
        res = {
            "trace": path.name,
            "job": row["job"],
            "setting": row["setting"],
            "k": row["k"],
            "gpu_oom": row["oom"],
            "model_oom": r.oom,
            "gpu_reserved_bytes": row.get("reserved_bytes"),
            "model_reserved_bytes": r.peak_reserved_bytes,
            "gpu_oom_event": stream.meta.get("oom_event"),
            "model_oom_event": r.oom_event,
            "events": len(stream),
            "actions": stream.meta.get("actions"),
        }
        out.append(res)
        print(json.dumps(res), flush=True)
    return out


def smallest_k_that_ran(rows: list[dict[str, Any]], job: str, setting: str) -> int | None:
    """The last k before the first out-of-memory error (None: the first k already failed)."""
    ran = [r["k"] for r in rows if r.get("job") == job and r.get("setting") == setting and r.get("oom") is False]
    return min(ran) if ran else None


def _gpu(out: Path, jobs: list[Job], budget_s: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget_s
    for i, (setting, conf) in enumerate(SETTINGS.items()):
        share = (deadline - time.monotonic()) / (len(SETTINGS) - i)  # what is left, split over the settings left
        env = dict(os.environ)
        env.pop("PYTORCH_ALLOC_CONF", None)
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        part = out / f"gpu_fit_check_{setting}.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "training.gpu_fit_check",
            "--child",
            setting,
            "--child-out",
            str(part),
            "--budget-s",
            str(max(0.0, share)),
            "--jobs",
            ",".join(j.name for j in jobs),
        ]
        subprocess.run(cmd, env=env, cwd=ROOT, check=False)
        if part.exists():
            rows += [json.loads(line) for line in part.read_text().splitlines() if line.strip()]
    (out / "gpu_fit_check.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = _summary(rows, jobs)
    (out / "gpu_fit_check_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if rows else 1


def _summary(rows: list[dict[str, Any]], jobs: list[Job]) -> list[dict[str, Any]]:
    out = []
    for job in jobs:
        for setting in SETTINGS:
            sel = [r for r in rows if r.get("job") == job.name and r.get("setting") == setting]
            ran = [r for r in sel if r.get("oom") is False]
            oom = next((r for r in sel if r.get("oom")), None)
            low = min(ran, key=lambda r: r["k"]) if ran else None
            out.append(
                {
                    "job": job.name,
                    "setting": setting,
                    "start_k": job.start_k,
                    "smallest_k_that_ran": smallest_k_that_ran(rows, job.name, setting),
                    "issue_measured": job.measured[setting],
                    "allocated_gib_at_smallest": round(low["allocated_bytes"] / GIB, 3) if low else None,
                    "reserved_gib_at_smallest": round(low["reserved_bytes"] / GIB, 3) if low else None,
                    "first_oom_k": oom["k"] if oom else None,
                    "tried_gib": oom.get("tried_gib") if oom else None,
                }
            )
    return out


# -- simulated ----------------------------------------------------------------------------------------------


def simulate(jobs: list[Job], out: Path = SIMULATED) -> list[dict[str, Any]]:
    """The same search through :mod:`model.allocator`: per job and setting, from memfit's k down to the first
    simulated out-of-memory error, at the issue's cap. Writes one row per (job, setting, k) and a summary row
    per (job, setting) to ``out``."""
    from data import catalog
    from model.allocator import GIB as _GIB
    from model.allocator import replay
    from tracer.allocation import cached_step_allocations, cuda_trace_policy

    policy, factory = cuda_trace_policy()
    rows: list[dict[str, Any]] = []
    for job in jobs:
        cap = int(job.issue_cap_gib * _GIB)
        cfg = catalog.get(job.model)["hf_config"]
        for setting, conf in SETTINGS.items():
            for k in range(job.start_k, -1, -1):
                t0 = time.perf_counter()
                stream = cached_step_allocations(
                    cfg, job.training_config(k), model_name=job.model, step_context=factory, context_name=policy
                )
                r = replay(stream, conf, cap)
                row = {
                    "job": job.name,
                    "setting": setting,
                    "k": k,
                    "cap_bytes": cap,
                    "oom": r.oom,
                    "allocated_bytes": r.peak_allocated_bytes,
                    "reserved_bytes": r.peak_reserved_bytes,
                    "tried_gib": round(r.oom_request_bytes / _GIB, 2) if r.oom else None,
                    "oom_phase": r.oom_phase,
                    "num_alloc_retries": r.num_alloc_retries,
                    "uncapped_reserved_bytes": replay(stream, conf).peak_reserved_bytes,
                    "events": len(stream),
                    "trace_policy": policy or None,
                    "seconds": round(time.perf_counter() - t0, 2),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                if r.oom:
                    break
    summary = [{"summary": True, **s} for s in _summary(rows, jobs)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows + summary))
    return rows + summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.gpu_fit_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="folder for the GPU rows")
    p.add_argument("--simulate", action="store_true", help="run the jobs through model.allocator on the CPU")
    p.add_argument("--sim-out", type=Path, default=SIMULATED, help="--simulate output file")
    p.add_argument("--jobs", default=",".join(j.name for j in JOBS), help="comma-separated job names")
    p.add_argument("--budget-s", type=float, default=270.0, help="stop starting new k after this long (GPU)")
    p.add_argument("--replay-traces", type=Path, nargs="+", help="replay trace_*.json.gz of a GPU run (CPU)")
    p.add_argument("--child", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    names = [n for n in a.jobs.split(",") if n]
    by_name = {j.name: j for j in JOBS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        p.error(f"--jobs: unknown {unknown}; allowed: {sorted(by_name)}")
    jobs = [by_name[n] for n in names]
    if a.replay_traces:
        replay_traces(a.replay_traces)
        return 0
    if a.simulate:
        rows = simulate(jobs, a.sim_out)
        for s in (r for r in rows if r.get("summary")):
            print(
                f"{s['job']:20s} {s['setting']:20s} smallest k that ran: simulated {s['smallest_k_that_ran']}, "
                f"issue's H200 run {s['issue_measured']}"
            )
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device; use --simulate for the CPU model", file=sys.stderr)
        return 2
    if a.child:
        a.child_out.write_text("")
        run_setting(a.child, jobs, a.budget_s, a.child_out)
        return 0
    if a.out is None:
        p.error("--out is required on a GPU")
    return _gpu(a.out, jobs, a.budget_s)


if __name__ == "__main__":
    sys.exit(main())
