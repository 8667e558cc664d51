"""Shared fixtures: a small model registry trained on the shipped telemetry."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pandas as pd
import pytest

# the command line's on-disk answer cache (service.answer_cache) stays off in tests: a test that patches code in memory
# must get a fresh answer; the cache's own tests turn it on in a folder of their own
os.environ["MEMFIT_ANSWER_CACHE"] = "off"
# the fit decision's allocation streams (tracer.stream_source): no test records a full model's stream unless it asks
# for one (tests/test_fit_decision.py builds its recommender with shipped streams)
os.environ["MEMFIT_ALLOCATOR_STREAMS"] = "off"
# the telemetry store of the command line run in-process (service.cli opens the data directory's store, which it
# shares with a service there): a temporary one per worker, never the checkout's data/telemetry.db (one created
# there while test_faults compared the data directory before and after its run failed it). A test that gives a
# process a data directory of its own drops this (its store is that directory's).
# services started by tests start their tracing process with their first trace, not after the warm-up (each would
# import PyTorch in a process most tests never use); tests/test_service.py checks the warm-up's start
os.environ["MEMFIT_START_TRACER"] = "0"
# nor do they warm up (resolve the catalog and import every family's modeling code: 4 s of CPU per service start);
# tests/test_service.py checks the warm-up itself, and the service reports warmed up at once without one
os.environ["MEMFIT_WARM_UP"] = "0"
os.environ.setdefault("MEMFIT_DB_URL", f"sqlite:///{tempfile.mkdtemp(prefix='memfit-tests-')}/telemetry.db")

# one compute thread per pytest-xdist worker (and the processes its tests start): the workers already fill the cores,
# and OpenMP/MKL threads on top of them spin-wait for each other (test_parallel's real-CPU runs: 132 s wall and 70 s of
# CPU with the default 2 threads beside another worker, 55 s and 40 s with one). Set before torch is imported.
# Inductor's compile workers likewise (tests/test_checkpointing.py compiles blocks on a cold cache): with its pool of
# compile processes on top of the workers, a timed command-line test running beside it once took 4.6 s (limit 2 s)
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        os.environ.setdefault(_var, "1")

SHIPPED = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "telemetry.parquet"


@pytest.fixture(scope="session")
def small_registry(tmp_path_factory):
    """A registry with one promoted version, trained on up to 3000 shipped non-gate rows (fast settings)."""
    from model.estimator import PeakMemoryRegressor
    from model.registry import Registry, fingerprint

    df = pd.read_parquet(SHIPPED)
    from model.evaluate import gate_mask

    df = df[~df["oom"].astype(bool)]
    df = df[~gate_mask(df["record_id"])]  # like the retraining job: gate rows stay unseen
    df = df.sample(min(len(df), 3000), random_state=0)
    est = PeakMemoryRegressor(n_estimators=80, num_leaves=31).fit(
        df, df["peak_allocated_bytes"], groups=df["model_name"]
    )
    root = tmp_path_factory.mktemp("registry")
    reg = Registry(root)
    version = reg.register(
        est,
        metrics={"note": "test fixture"},
        data_fingerprint=fingerprint(df),
        extra={
            "telemetry_range": {
                "max_total_params": float(df.total_params.max()),
                "max_seq_len": float(df.seq_len.max()),
                "max_micro_batch_size": float(df.micro_batch_size.max()),
            }
        },
    )
    reg.promote(version)
    return reg
