"""Service benchmark and bounded load test (loopback only).

Starts the real service (uvicorn, one process) on 127.0.0.1 with the given registry, then:

0. the first request with a HF config after start-up (warm-up finished): a catalog architecture's
   config, and a never-seen one (the predictor's provisional answer);
1. ``/recommend`` with the full curve for an 80-layer model (Llama-3-70B on 64 × H100-80GB, ZeRO-3):
   p50 / p99 latency and requests per second at each given concurrency (default 1 and 16);
2. the trivial endpoint ``/v2/health/live`` on the same server, same load: the ratio of the two RPS;
   (repeated configurations come from the service's curve cache; a last run with 60 distinct
   configurations measures the uncached cost);
3. a fake-tensor traced measurement of the same configuration (one k), to show the speed-up;
4. a mixed load: good and bad /recommend requests and /telemetry posts, counting 5xx and checking
   that every posted telemetry row landed (store count before/after);
5. a locked store: another connection holds the SQLite file exclusively while 8 writers post 200
   telemetry rows; each post's 503 latency, and sequential /recommend p99 quiet vs during the storm
   (reads are served from their own pool, so the ratio should stay near 1).

    python -m benchmarks.service_latency --requests 400 --concurrency 1 16

Prints one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

BODY = {
    "model": "llama-3-70b",
    "training": {"micro_batch_size": 1, "seq_len": 4096, "sharding": "zero3"},
    "cluster": {"gpu": "H100-80GB", "gpu_count": 64},
}
BAD = [
    {**BODY, "model": "no-such-model"},
    {**BODY, "training": {"micro_batch_size": 0, "seq_len": 4096}},
    {**BODY, "cluster": {"gpu": "H100-80GB", "gpu_memory_gib": 80}},
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _load(base: str, make, n: int, concurrency: int) -> tuple[list[float], list[int], float]:
    """Send ``n`` requests (``make(i)`` -> (method, path, kwargs)) with bounded concurrency."""
    lat: list[float] = []
    codes: list[int] = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=httpx.Limits(max_connections=concurrency)) as c:

        async def one(i: int) -> None:
            method, path, kw = make(i)
            async with sem:
                t0 = time.perf_counter()
                r = await c.request(method, path, **kw)
                lat.append(time.perf_counter() - t0)
                codes.append(r.status_code)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return lat, codes, wall


def _stats(lat: list[float], wall: float) -> dict:
    q = statistics.quantiles(lat, n=100)
    return {"p50_ms": round(q[49] * 1000, 2), "p99_ms": round(q[98] * 1000, 2), "rps": round(len(lat) / wall, 1)}


def _locked_store(base: str, db_path: Path) -> dict:
    """Step 5: /recommend latency quiet vs during a telemetry write storm against a locked SQLite file."""
    import sqlite3
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers import record

    def reads(n: int, until=None) -> list[float]:
        lat = []
        with httpx.Client(base_url=base, timeout=30) as c:
            while len(lat) < n or (until is not None and until()):
                t0 = time.perf_counter()
                c.post("/recommend", json=BODY).raise_for_status()
                lat.append(time.perf_counter() - t0)
        return lat

    def writer(t: int) -> list[tuple[int, float]]:
        got = []
        with httpx.Client(base_url=base, timeout=30) as c:
            for i in range(25):
                body = [record(record_id=f"storm-{t}-{i:04d}-{uuid.uuid4().hex[:8]}").model_dump(mode="json")]
                t0 = time.perf_counter()
                r = c.post("/telemetry", json=body)
                got.append((r.status_code, time.perf_counter() - t0))
        return got

    quiet = reads(150)
    locker = sqlite3.connect(db_path, timeout=0)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(writer, t) for t in range(8)]
            during = reads(150, until=lambda: not all(f.done() for f in futures))
            posts = [x for f in futures for x in f.result()]
    finally:
        locker.rollback()
        locker.close()
    p99 = lambda lat: statistics.quantiles(lat, n=100)[98]
    return {
        "posts": len(posts),
        "posts_503": sum(c == 503 for c, _ in posts),
        "post_max_ms": round(max(s for _, s in posts) * 1000, 1),
        "recommend_p99_quiet_ms": round(p99(quiet) * 1000, 2),
        "recommend_p99_during_ms": round(p99(during) * 1000, 2),
        "p99_ratio_during_vs_quiet": round(p99(during) / p99(quiet), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.service_latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--registry", help="model registry (default data/models)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--skip-trace", action="store_true", help="skip the fake-tensor trace comparison")
    p.add_argument(
        "--wait-traced-s",
        type=float,
        default=300,
        help="wait this long for the server's background trace of the benchmark configuration",
    )
    a = p.parse_args(argv)

    from data.store import TelemetryStore
    from tests.helpers import record

    tmp = Path(tempfile.mkdtemp(prefix="memfit-bench-"))
    db = f"sqlite:///{tmp / 'bench.db'}"
    port = _port()
    env = {**os.environ, "MEMFIT_PORT": str(port), "MEMFIT_DB_URL": db, "MEMFIT_HOST": "127.0.0.1"}
    if a.registry:
        env["MEMFIT_REGISTRY_DIR"] = a.registry
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(base + "/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        for _ in range(600):  # start-up work (imports, catalog configs) done in the background first
            if httpx.get(base + "/v2/health/ready", timeout=5).json().get("details", {}).get("warmed_up"):
                break
            time.sleep(0.2)
        out: dict = {"requests": a.requests}
        from data import catalog

        def first(cfg: dict) -> dict:
            body = {**BODY, "model": cfg, "cluster": {"gpu": "H100-80GB", "gpu_count": 8}}
            t0 = time.perf_counter()
            r = httpx.post(base + "/recommend", json=body, timeout=60)
            return {
                "ms": round((time.perf_counter() - t0) * 1000, 1),
                "status": r.status_code,
                "path": r.json().get("path"),
            }

        known = catalog.get("qwen2.5-7b")["hf_config"]
        out["first_hf_config_catalog_architecture"] = first(known)
        out["first_hf_config_never_seen"] = first({**known, "vocab_size": 151_000, "num_hidden_layers": 30})
        # steady state: the background traces of BODY and of the two configurations above finished (a trace
        # still running during the load would measure the tracing process, not the service)
        deadline = time.time() + a.wait_traced_s
        bodies = [BODY] + [
            {**BODY, "model": cfg, "cluster": {"gpu": "H100-80GB", "gpu_count": 8}}
            for cfg in (known, {**known, "vocab_size": 151_000, "num_hidden_layers": 30})
        ]
        while time.time() < deadline and any(
            httpx.post(base + "/recommend", json=b, timeout=60).json().get("path") != "traced" for b in bodies
        ):
            time.sleep(1)
        for c in a.concurrency:
            lat, codes, wall = asyncio.run(_load(base, lambda i: ("POST", "/recommend", {"json": BODY}), a.requests, c))
            rec = {**_stats(lat, wall), "non_200": sum(x != 200 for x in codes)}
            lat, codes, wall = asyncio.run(_load(base, lambda i: ("GET", "/v2/health/live", {}), a.requests, c))
            trivial = _stats(lat, wall)
            out[f"concurrency_{c}"] = {
                "recommend_80_layers": rec,
                "trivial_endpoint": trivial,
                "rps_ratio_recommend_vs_trivial": round(rec["rps"] / trivial["rps"], 3),
            }
        out["recommend_path"] = httpx.post(base + "/recommend", json=BODY).json()["path"]

        store = TelemetryStore(db)
        before = store.count()
        posted: list[str] = []

        def mixed(i: int):
            if i % 4 == 0:
                rid = f"load-{uuid.uuid4().hex[:20]}"
                posted.append(rid)
                return "POST", "/telemetry", {"json": [record(record_id=rid).model_dump(mode="json")]}
            if i % 4 == 1:
                return "POST", "/recommend", {"json": BAD[i % len(BAD)]}
            if i % 4 == 2:
                return "POST", "/recommend", {"content": b"{broken", "headers": {"content-type": "application/json"}}
            return "POST", "/recommend", {"json": BODY}

        lat, codes, wall = asyncio.run(_load(base, mixed, a.requests, max(a.concurrency)))
        after = store.count()
        out["mixed_load"] = {
            **_stats(lat, wall),
            "5xx": sum(c >= 500 for c in codes),
            "4xx": sum(400 <= c < 500 for c in codes),
            "telemetry_posted": len(posted),
            "telemetry_rows_added": after - before,
            "lost_rows": len(posted) - (after - before),
        }
        # every request a configuration not seen before: no curve cache hit (last: it queues background traces)
        lat, codes, wall = asyncio.run(
            _load(
                base,
                lambda i: (
                    "POST",
                    "/recommend",
                    {"json": {**BODY, "training": {**BODY["training"], "seq_len": 4096 + 8 * (i + 1)}}},
                ),
                60,
                1,
            )
        )
        out["recommend_80_layers_distinct_configs_c1"] = {**_stats(lat, wall), "non_200": sum(x != 200 for x in codes)}
        out["locked_store"] = _locked_store(base, tmp / "bench.db")
        out["server_alive_after"] = httpx.get(base + "/v2/health/live").status_code == 200
        if not a.skip_trace:
            from data import catalog
            from memfit.schema import TrainingConfig
            from tracer.collect import measure

            t0 = time.perf_counter()
            measure(
                catalog.get("llama-3-70b")["hf_config"],
                TrainingConfig(micro_batch_size=1, seq_len=4096, sharding="zero3", data_parallel_size=64),
                steps=1,
            )
            trace_s = time.perf_counter() - t0
            out["fake_tensor_trace_one_k_s"] = round(trace_s, 2)
            p50 = out[f"concurrency_{a.concurrency[0]}"]["recommend_80_layers"]["p50_ms"] / 1000
            out["speedup_vs_trace_one_k"] = round(trace_s / p50)
            out["speedup_vs_trace_full_curve"] = round(81 * trace_s / p50)
        print(json.dumps(out, indent=1))
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
