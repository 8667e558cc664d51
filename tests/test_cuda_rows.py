"""The traced answer of ``POST /predict`` against every shipped real-CUDA row (H200; data only, no GPU needed).

With the row's GPU as the cluster (the product's path, issue 26), the terms traced with sm90's CUDA semantics answer
where CUDA and CPU differ, and every row meets the acceptance: within 1 % of ``max_memory_allocated``, none under it
by more than 0.5 %, at least 95 % within 0.5 %. Without a cluster (CPU-semantics terms, as before issue 26) the
rows where CUDA's kernel or autocast choices differ are pinned at their error, so that the shipped CPU terms stay
as they were.
"""

from __future__ import annotations

import statistics

import pytest

from benchmarks import cuda_rows as cr

#: (model, precision, attention, micro-batch, seq, k) -> (predicted - measured) / measured on the H200 rows
PINNED_GAPS = {
    ("falcon-7b", "bf16", "sdpa", 2, 2048, 16): -0.2955,
    ("falcon-7b", "bf16", "sdpa", 2, 2048, 32): -0.0015,
    ("gpt2", "amp_bf16", "sdpa", 4, 1024, 0): -0.1203,
    ("gpt2", "amp_bf16", "sdpa", 4, 1024, 6): -0.0833,
    ("gpt2", "amp_bf16", "sdpa", 4, 1024, 12): -0.0161,
    ("gpt2-medium", "amp_fp16", "sdpa", 4, 1024, 0): -0.1403,
    ("gpt2-medium", "amp_fp16", "sdpa", 4, 1024, 24): -0.0077,
    ("gpt2-large", "amp_bf16", "sdpa", 4, 1024, 0): -0.1449,
    ("gpt2-large", "amp_bf16", "sdpa", 4, 1024, 18): -0.1028,
    ("gpt2-large", "amp_bf16", "sdpa", 4, 1024, 36): -0.0093,
    ("gpt2", "amp_bf16", "eager", 8, 1024, 0): -0.0240,
    ("gpt2", "amp_bf16", "eager", 8, 1024, 12): -0.0080,
    ("gpt2-large", "amp_bf16", "eager", 4, 1024, 0): -0.0255,
    ("gpt2-large", "amp_bf16", "eager", 4, 1024, 18): -0.0227,
    ("gpt2-large", "amp_bf16", "eager", 4, 1024, 36): -0.0093,
    ("opt-1.3b", "amp_bf16", "sdpa", 4, 2048, 0): 0.0196,
    ("opt-1.3b", "amp_bf16", "sdpa", 4, 2048, 12): 0.0108,
    ("opt-1.3b", "amp_bf16", "sdpa", 4, 2048, 24): -0.0026,
    ("phi-3-mini-4k", "amp_bf16", "sdpa", 2, 4096, 0): 0.0667,
    ("phi-3-mini-4k", "amp_bf16", "sdpa", 2, 4096, 16): 0.0420,
    ("phi-3-mini-4k", "amp_bf16", "sdpa", 2, 4096, 32): -0.0009,
    ("gemma-3-1b", "amp_bf16", "sdpa", 4, 4096, 0): 0.0343,
    ("gemma-3-1b", "amp_bf16", "sdpa", 4, 4096, 13): 0.0197,
    ("gemma-3-1b", "amp_bf16", "sdpa", 4, 4096, 26): -0.0011,
}


@pytest.fixture(scope="module")
def scored() -> list[cr.Scored]:
    """Without a cluster: CPU-semantics terms, no workspaces (as before issue 26)."""
    out = cr.score(gpu=False)
    print("\n" + cr.table(out))
    return out


@pytest.fixture(scope="module")
def on_gpu() -> list[cr.Scored]:
    """With the row's GPU (H200) as the cluster: sm90 terms where they differ, plus the cuBLAS workspaces."""
    out = cr.score()
    print("\n" + cr.table(out))
    return out


def test_every_shipped_cuda_row_meets_the_acceptance_on_its_gpu(on_gpu):
    assert len(on_gpu) == 26 + 28 + 58 and all(s.path == "traced" for s in on_gpu)
    errors = [s.error for s in on_gpu]
    assert max(abs(e) for e in errors) <= 0.01, cr.table(on_gpu)
    # none under by more than 0.5 %: gpt2-large amp_bf16 k = 36/36 was -0.501 % (sdpa) and -0.505 % (eager), 75 MiB
    # under, until the parameters' unsplit blocks (model.recommend.parameter_block_bytes: 72.6 MiB) were counted
    assert min(errors) >= -0.005, cr.table(on_gpu)
    assert sum(abs(e) <= 0.005 for e in errors) == len(errors)
    large36 = [s for s in on_gpu if s.model == "gpt2-large" and s.k == 36]
    assert len(large36) == 2 and all(abs(s.error) < 0.001 for s in large36), cr.table(large36)
    # issue 26's rows: Falcon-7B k = 16 was -29.6 %, GPT-2-large amp -14.5 %, Phi-3-mini +6.7 %, Gemma-3-1B +3.4 %
    worst = {}
    for s in on_gpu:
        worst[s.gap] = max(worst.get(s.gap, 0.0), abs(s.error))
    assert worst["falcon"] <= 0.001 and worst["phi-3"] <= 0.001 and worst["gemma-3"] <= 0.003
    assert worst["gpt2-sdpa-amp"] <= 0.004 and worst["gpt2-eager-amp"] <= 0.002 and worst[None] <= 0.002


def test_answers_name_the_cuda_backend_where_it_changes_the_answer(on_gpu):
    gpt2 = next(s for s in on_gpu if s.model == "gpt2" and s.attention == "sdpa")
    assert any("attention dropout: math fallback on CPU, flash on sm90" in n for n in gpt2.notes)
    falcon = next(s for s in on_gpu if s.model == "falcon-7b")
    assert any("math backend on sm90" in n for n in falcon.notes)
    llama = next(s for s in on_gpu if s.model == "llama-3.2-1b")
    assert not any("CUDA semantics" in n for n in llama.notes)  # CPU and CUDA agree: the shipped terms answer


def _row_key(s: cr.Scored) -> tuple:
    return (s.model, s.precision, s.attention, s.micro_batch_size, s.seq_len, s.k)


def test_every_shipped_cuda_row_is_scored_from_traced_terms(scored):
    # 26 rows of 2026-11-30, 28 + 58 (60 less the two out-of-memory k = 0 rows) of 2026-12-04
    assert len(scored) == 26 + 28 + 58
    assert {s.source.split("/")[0] for s in scored} == {"h200-2026-11-30", "h200-2026-12-04"}
    assert all(s.path == "traced" for s in scored)


def test_same_kernel_rows_are_within_their_bound(scored):
    same = [s for s in scored if s.gap is None]
    assert len(same) == 83
    errors = [s.error for s in same]
    # the trace is a little under CUDA everywhere (cuBLAS workspace, ~66 MiB), never by more than 0.51 %
    assert max(abs(e) for e in errors) <= 0.0051, cr.table(same)
    assert statistics.median(abs(e) for e in errors) <= 0.0025
    assert sum(s.measured_bytes <= s.upper_bytes for s in same) >= len(same) - 1


def test_known_gaps_stay_where_they_are(scored):
    gaps = {_row_key(s): s.error for s in scored if s.gap is not None}
    assert set(gaps) == set(PINNED_GAPS)
    moved = {k: (round(v, 4), PINNED_GAPS[k]) for k, v in gaps.items() if abs(v - PINNED_GAPS[k]) > 0.0006}
    assert not moved, f"known CUDA gaps moved (now, pinned): {moved}"
