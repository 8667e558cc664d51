"""model.allocator: PyTorch's CUDA caching allocator rules one by one, fragmentation, properties, real H200 rows.

Expected values follow ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) and, for the real
rows, the H200 measurements of 2026-11-30 / 2026-12-04 (``max_memory_reserved`` after one warm-up step).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.allocator import (
    GIB,
    MIB,
    AllocationStream,
    AllocatorConfError,
    AllocatorSettings,
    CachingAllocatorModel,
    SimulatedOutOfMemory,
    allocation_size,
    replay,
    smallest_capacity,
)

ROWS = Path(__file__).resolve().parent.parent / "data" / "telemetry" / "gpu_validation" / "h200-2026-11-30"


def _segments(alloc: CachingAllocatorModel) -> list[list]:
    return [seg for seg in alloc.segments() if any(b.mapped for b in seg)]


# -- settings ---------------------------------------------------------------------------------------------


def test_conf_parses_the_documented_keys():
    s = AllocatorSettings.from_conf("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6")
    assert s.expandable_segments and s.max_split_size_bytes == 128 * MIB
    assert s.garbage_collection_threshold == 0.6
    assert s.describe() == "expandable_segments, max_split_size_mb=128, garbage_collection_threshold=0.6"
    assert AllocatorSettings.from_conf(None) == AllocatorSettings.from_conf("") == AllocatorSettings()
    assert AllocatorSettings().describe() == "default"
    divs = AllocatorSettings.from_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions
    # 256 MiB is interval 8 (intervals start at 1 MiB); '>' fills from the last interval named, overwriting it
    assert divs == (1,) * 9 + (2,) + (8,) * 6
    assert AllocatorSettings.from_conf("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ("expandable_segment:True", "unknown option 'expandable_segment'"),
        ("expandable_segments:yes", "expandable_segments must be True or False"),
        ("max_split_size_mb:10", "max_split_size_mb too small, must be >= 20"),
        ("garbage_collection_threshold:1.5", "garbage_collection_threshold must be in (0.0, 1.0)"),
        ("max_split_size_mb", "max_split_size_mb needs ':'"),
        ("backend:magic", "backend must be native or cudaMallocAsync"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions must be a power of 2"),
    ],
)
def test_bad_conf_names_the_key(conf, named):
    with pytest.raises(AllocatorConfError) as err:
        AllocatorSettings.from_conf(conf)
    assert named in str(err.value)


def test_cuda_malloc_async_is_refused_by_the_model():
    with pytest.raises(ValueError, match="cudaMallocAsync is not modelled"):
        CachingAllocatorModel(AllocatorSettings.from_conf("backend:cudaMallocAsync"))


# -- the rules, one by one -------------------------------------------------------------------------------------


def test_round_size_512_bytes_and_power2_divisions():
    a = CachingAllocatorModel()
    assert [a.round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    d = CachingAllocatorModel(AllocatorSettings.from_conf("roundup_power2_divisions:4"))
    assert d.round_size(5 * MIB + 1) == 6 * MIB  # 4 steps between 4 and 8 MiB
    assert d.round_size(1200) == 1536  # below 512 B x divisions: plain 512 B rounding
    assert d.round_size(8 * MIB) == 8 * MIB


def test_segment_sizes_per_pool():
    assert allocation_size(512) == allocation_size(MIB) == 2 * MIB  # small pool: 2 MiB segments
    assert allocation_size(MIB + 512) == allocation_size(10 * MIB - 512) == 20 * MIB  # 1-10 MiB: 20 MiB
    assert allocation_size(10 * MIB) == 10 * MIB  # >= 10 MiB: own segment rounded to 2 MiB
    assert allocation_size(11 * MIB + 512) == 12 * MIB
    a = CachingAllocatorModel()
    big, mid, small = a.malloc(11 * MIB), a.malloc(MIB + 1), a.malloc(MIB)
    assert small.small and not mid.small and not big.small
    assert a.reserved_bytes == (12 + 20 + 2) * MIB
    a.malloc(11 * MIB)  # a cached block holds it: the rest of the 20 MiB segment, no new segment
    assert a.reserved_bytes == (12 + 20 + 2) * MIB


def test_best_fit_takes_the_smallest_cached_block():
    a = CachingAllocatorModel()
    b30, b24 = a.malloc(30 * MIB), a.malloc(24 * MIB)
    at24 = b24.addr
    a.free(b30)
    a.free(b24)
    got = a.malloc(22 * MIB)
    assert got.addr == at24 and a.reserved_bytes == 54 * MIB


def test_split_rules():
    a = CachingAllocatorModel()
    a.free(a.malloc(12 * MIB))
    whole = a.malloc(11 * MIB)  # 1 MiB would remain: a large block is split only when more than 1 MiB remains
    assert whole.size == 12 * MIB and a.allocated_bytes == 12 * MIB
    a.free(whole)
    part = a.malloc(10 * MIB + MIB // 2)  # 1.5 MiB remain: split
    assert part.size == 10 * MIB + MIB // 2 and part.next.size == MIB + MIB // 2
    s = CachingAllocatorModel()
    first = s.malloc(MIB)  # a 2 MiB small segment keeps 1 MiB free (>= 512 B remain)
    assert first.size == MIB and first.next.size == MIB and s.reserved_bytes == 2 * MIB


def test_free_blocks_merge_only_within_a_segment():
    a = CachingAllocatorModel()
    x, y = a.malloc(2 * MIB), a.malloc(3 * MIB)  # both in one 20 MiB segment
    z = a.malloc(16 * MIB)  # more than the 15 MiB left there: its own 16 MiB segment
    a.free(x)
    a.free(y)
    a.free(z)
    sizes = sorted(sum(b.size for b in seg) for seg in _segments(a))
    assert sizes == [16 * MIB, 20 * MIB]
    assert sorted(len(seg) for seg in _segments(a)) == [1, 1]  # x, y and the remainder merged back into one block
    big = a.malloc(20 * MIB + 512)  # 36 MiB of free bytes, but no single block holds it: a new segment
    assert big.size == 20 * MIB + 512 and a.reserved_bytes == 36 * MIB + 22 * MIB


def test_release_cached_and_retry_before_oom():
    a = CachingAllocatorModel(capacity_bytes=40 * MIB)
    a.free(a.malloc(30 * MIB))
    a.malloc(32 * MIB)  # 30 + 32 > 40: the unused 30 MiB segment is released and the allocation retried
    assert a.num_alloc_retries == 1 and a.reserved_bytes == 32 * MIB


def test_oom_reports_the_allocation_size():
    a = CachingAllocatorModel(capacity_bytes=40 * MIB)
    a.malloc(30 * MIB)
    with pytest.raises(SimulatedOutOfMemory) as err:
        a.malloc(2 * MIB)  # a 1-10 MiB request needs a 20 MiB segment: 30 + 20 > 40
    assert err.value.request_bytes == 20 * MIB and err.value.reserved_bytes == 30 * MIB
    assert a.num_ooms == 1


def test_max_split_size_keeps_oversize_blocks_whole():
    conf = AllocatorSettings.from_conf("max_split_size_mb:64")
    a = CachingAllocatorModel(conf)
    a.free(a.malloc(100 * MIB))
    small = a.malloc(30 * MIB)  # below max_split_size: never takes an oversize block
    assert a.reserved_bytes == 130 * MIB and small.size == 30 * MIB
    a.free(small)
    near = a.malloc(90 * MIB)  # at/above it: takes a block at most 20 MiB larger, unsplit
    assert near.size == 100 * MIB and a.reserved_bytes == 130 * MIB
    a.free(near)
    a.malloc(70 * MIB)  # 100 >= 70 + 20: a new segment
    assert a.reserved_bytes == 200 * MIB


def test_max_split_size_releases_oversize_blocks_first():
    conf = AllocatorSettings.from_conf("max_split_size_mb:64")
    a = CachingAllocatorModel(conf, 200 * MIB)
    a.free(a.malloc(150 * MIB))
    a.malloc(30 * MIB)
    a.malloc(130 * MIB)  # 180 + 130 > 200: release_available_cached_blocks frees the 150 MiB block, no retry
    assert a.reserved_bytes == 160 * MIB and a.num_alloc_retries == 0
    b = CachingAllocatorModel(conf, 230 * MIB)
    b.free(b.malloc(100 * MIB))
    b.malloc(30 * MIB)
    b.malloc(120 * MIB)  # the oversize blocks add up to less than 120 MiB: it reports failure, release-all retries
    assert b.reserved_bytes == 150 * MIB and b.num_alloc_retries == 1


def test_garbage_collection_threshold_frees_old_blocks_before_the_cap():
    gc = CachingAllocatorModel(AllocatorSettings.from_conf("garbage_collection_threshold:0.5"), 100 * MIB)
    gc.free(gc.malloc(60 * MIB))
    gc.malloc(70 * MIB)  # reserved 60 > 50: the cached 60 MiB block is collected before cudaMalloc
    assert gc.num_alloc_retries == 0 and gc.reserved_bytes == 70 * MIB
    plain = CachingAllocatorModel(capacity_bytes=100 * MIB)
    plain.free(plain.malloc(60 * MIB))
    plain.malloc(70 * MIB)
    assert plain.num_alloc_retries == 1 and plain.reserved_bytes == 70 * MIB


def test_expandable_segments_map_and_unmap_pages():
    a = CachingAllocatorModel(AllocatorSettings.from_conf("expandable_segments:True"))
    x = a.malloc(30 * MIB)
    assert a.reserved_bytes == 40 * MIB  # two 20 MiB pages
    a.free(x)
    a.malloc(50 * MIB)  # grows in place from the lowest address: one more page, not a new 50 MiB segment
    assert a.reserved_bytes == 60 * MIB
    a.malloc(MIB)  # small pool: its own segment of 2 MiB pages
    assert a.reserved_bytes == 62 * MIB
    a.empty_cache()  # fully free pages only: both segments hold live blocks
    assert a.reserved_bytes == 62 * MIB


def test_expandable_empty_cache_unmaps_fully_free_pages():
    a = CachingAllocatorModel(AllocatorSettings.from_conf("expandable_segments:True"))
    x, y = a.malloc(30 * MIB), a.malloc(30 * MIB)  # [0, 30) and [30, 60): three pages
    a.free(x)
    a.empty_cache()  # page [0, 20) is free; [20, 40) holds part of y
    assert a.reserved_bytes == 40 * MIB
    a.free(y)
    a.empty_cache()
    assert a.reserved_bytes == 0


def test_expandable_cap_is_checked_before_mapping_pages():
    """``alloc_block`` compares reserved + the allocation size with the cap, then maps whole 20 MiB pages."""
    a = CachingAllocatorModel(AllocatorSettings.from_conf("expandable_segments:True"), 110 * MIB)
    a.malloc(100 * MIB)
    a.malloc(10 * MIB)  # 100 + 10 <= 110 passes; one more page is mapped
    assert a.reserved_bytes == 120 * MIB


def test_fragmentation_oom_with_free_bytes_where_expandable_segments_fit():
    """A cached segment split by a live block can't be released: the default allocator runs out of memory with
    160 MiB of the 200 MiB cap unused, while expandable segments unmap the free pages and fit the request."""

    def run(conf: str) -> CachingAllocatorModel:
        a = CachingAllocatorModel(AllocatorSettings.from_conf(conf), 200 * MIB)
        a.free(a.malloc(100 * MIB))
        a.malloc(40 * MIB)  # best fit splits the cached 100 MiB segment
        a.malloc(120 * MIB)
        return a

    with pytest.raises(SimulatedOutOfMemory) as err:
        run("")
    assert err.value.request_bytes == 120 * MIB
    assert err.value.allocated_bytes == 40 * MIB and err.value.reserved_bytes == 100 * MIB
    fits = run("expandable_segments:True")
    assert fits.allocated_bytes == 160 * MIB and fits.reserved_bytes == 160 * MIB and fits.num_alloc_retries == 1


def test_replay_stream_peaks_and_measured_window():
    #        a: 3 MiB, b: 500 B, free a, c: 30 MiB, free b, free c
    s = AllocationStream([1, 2, 1, 3, 2, 3], [3 * MIB, 500, 0, 30 * MIB, 0, 0], phases=[(0, "forward")])
    r = replay(s)
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes) == (30 * MIB + 512, 52 * MIB)
    assert replay(s, "expandable_segments:True").peak_reserved_bytes == 42 * MIB
    late = AllocationStream(s.handles, s.sizes, measured_from=3)
    assert replay(late).peak_allocated_bytes == 30 * MIB + 512
    retried = replay(s, None, 40 * MIB)  # the cached 20 MiB segment is released for c
    assert not retried.oom and retried.num_alloc_retries == 1 and retried.peak_reserved_bytes == 32 * MIB
    oom = replay(s, None, 30 * MIB)
    assert oom.oom and oom.oom_event == 3 and oom.oom_request_bytes == 30 * MIB and oom.oom_phase == "forward"


def test_stream_saves_and_loads(tmp_path):
    s = AllocationStream([1, 1], [4096, 0], 1, [(0, "init"), (1, "forward")], {"model": "x"})
    s.save(tmp_path / "s.npz")
    back = AllocationStream.load(tmp_path / "s.npz")
    assert (back.handles, back.sizes, back.measured_from, back.phases, back.meta) == (
        [1, 1],
        [4096, 0],
        1,
        [(0, "init"), (1, "forward")],
        {"model": "x"},
    )


def test_repeat_measured_step_renames_its_allocations():
    # build: p, and g0 left by the warm-up; the step allocates t, frees g0, allocates g (left for the next step)
    s = AllocationStream([1, 4, 2, 4, 3, 2], [100, 50, 200, 0, 300, 0], measured_from=2)
    r = s.repeat_measured(3)
    assert r.sizes == [100, 50, 200, 0, 300, 0] + [200, 0, 300, 0] * 2
    assert r.handles[6:] == [5, 3, 6, 5, 7, 6, 8, 7]  # each repetition frees the g the previous one left
    assert not replay(r).oom


# -- properties --------------------------------------------------------------------------------------------


_SIZES = st.one_of(
    st.integers(1, MIB),  # small pool
    st.integers(MIB + 1, 10 * MIB),  # 20 MiB segments
    st.integers(10 * MIB, 300 * MIB),  # own segments
)


def _check_tiling(a: CachingAllocatorModel) -> None:
    """Blocks tile their segments with no gap; allocated and reserved bytes add up."""
    allocated = reserved = 0
    for seg in a.segments():
        for b, nxt in itertools.pairwise(seg):
            assert b.addr + b.size == nxt.addr and nxt.prev is b
        allocated += sum(b.size for b in seg if b.allocated)
        reserved += sum(b.size for b in seg if b.mapped)
    assert reserved == a.reserved_bytes


def _check_pages_hold_live_bytes(a: CachingAllocatorModel) -> None:
    """After releasing with expandable segments every mapped page overlaps a live block, so reserved exceeds
    allocated by at most the partial pages at the ends of the free blocks between live ones."""
    for seg in a.segments():
        page = seg[0].seg.page
        base = seg[0].seg.base
        live = [(b.addr, b.addr + b.size) for b in seg if b.allocated]
        for b in seg:
            if not b.mapped:
                continue
            first, last = (b.addr - base) // page, (b.addr + b.size - 1 - base) // page
            for p in range(first, last + 1):
                lo, hi = base + p * page, base + (p + 1) * page
                assert any(s < hi and e > lo for s, e in live), "a fully free page stayed mapped"


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), _SIZES, st.integers(0, 10**6)), min_size=1, max_size=120),
    expandable=st.booleans(),
    cap_mib=st.one_of(st.none(), st.integers(50, 2000)),
)
def test_reserved_never_below_allocated(ops, expandable, cap_mib):
    conf = AllocatorSettings(expandable_segments=expandable)
    a = CachingAllocatorModel(conf, None if cap_mib is None else cap_mib * MIB)
    live = []
    for do_alloc, size, pick in ops:
        if do_alloc or not live:
            try:
                live.append(a.malloc(size))
            except SimulatedOutOfMemory:
                if expandable:
                    _check_pages_hold_live_bytes(a)  # the failed retry released every free page
                continue
        else:
            a.free(live.pop(pick % len(live)))
        assert a.reserved_bytes >= a.allocated_bytes == sum(b.size for b in live)
        assert a.peak_reserved_bytes >= a.peak_allocated_bytes
        if cap_mib is not None:
            # the cap is checked against the allocation size before mapping: 20 MiB pages may overshoot it
            assert a.reserved_bytes <= cap_mib * MIB + (20 * MIB if expandable else 0)
    _check_tiling(a)
    a.empty_cache()
    _check_tiling(a)
    if expandable:
        _check_pages_hold_live_bytes(a)
    else:
        assert all(any(b.allocated for b in seg) for seg in _segments(a))  # unused segments were released


def test_replay_is_fast():
    import random
    import time

    rng = random.Random(0)
    handles, sizes, live, h = [], [], [], 0
    while len(sizes) < 100_000:
        if live and rng.random() < 0.5:
            handles.append(live.pop(rng.randrange(len(live))))
            sizes.append(0)
        else:
            h += 1
            live.append(h)
            handles.append(h)
            sizes.append(
                rng.choice([rng.randint(1, MIB), rng.randint(MIB, 10 * MIB), rng.randint(10 * MIB, 200 * MIB)])
            )
    stream = AllocationStream(handles, sizes)
    t0 = time.perf_counter()
    replay(stream)
    assert time.perf_counter() - t0 < 2.0  # about 0.3 s here


# -- real H200 rows ---------------------------------------------------------------------------------------


def _h200_row(model: str, precision: str, k: int) -> dict:
    for line in (ROWS / "gpu_records.jsonl").read_text().splitlines():
        r = json.loads(line)
        if (r["model"]["model_name"], r["training"]["precision"], len(r["training"]["checkpoint_layers"])) == (
            model,
            precision,
            k,
        ):
            return r
    raise AssertionError((model, precision, k))


@pytest.mark.parametrize(
    ("model", "precision", "k"),
    [("llama-3.2-1b", "bf16_fp32_master", 16), ("qwen2.5-0.5b", "bf16", 24)],
)
def test_replay_of_real_h200_rows(model, precision, k):
    """The traced step replayed with PyTorch's defaults gives the H200's max_memory_reserved: Llama-3.2-1B
    fp32-master k = 16 reserved 42,005,954,560 B with 30,653,160,960 B allocated (an 11 GiB gap of cached
    segments), Qwen2.5-0.5B bf16 k = 24 reserved 19,262,341,120 B."""
    from data import catalog
    from memfit.schema import TrainingConfig
    from tracer.allocation import step_allocations

    row = _h200_row(model, precision, k)
    training = TrainingConfig(**row["training"])
    stream = step_allocations(catalog.get(model)["hf_config"], training, model_name=model)
    measured = row["measurement"]
    r = replay(stream)
    assert not r.oom
    assert abs(r.peak_reserved_bytes - measured["peak_reserved_bytes"]) <= max(
        0.02 * measured["peak_reserved_bytes"], 256 * MIB
    )
    assert abs(r.peak_allocated_bytes - measured["peak_allocated_bytes"]) <= 0.002 * measured["peak_allocated_bytes"]
    # the fake tracker's own peak plus the two 32 MiB cuBLAS workspaces is the stream's live peak
    assert stream.live_bytes_peak(stream.measured_from) == stream.meta["tracker_peak_bytes"] + 64 * MIB
    if k == 16:
        assert r.peak_reserved_bytes - r.peak_allocated_bytes > 10 * GIB
        # under a cap, release-and-retry gets far below the uncapped reserved peak
        assert smallest_capacity(stream) < measured["peak_reserved_bytes"] - 5 * GIB


def test_parameters_unsplit_blocks_gpt2_large_and_where_none():
    """GPT-2-large in fp32: each layer's two 25 MiB MLP weights get 26 MiB blocks left whole (1 MiB would remain:
    not more than kSmallSize), and the 245.4 MiB token table a 246 MiB one; the 18.75 MiB attention weight's
    1.25 MiB remainder is split off. Expandable segments split every remainder; sharded parameters are not modelled."""
    from data import catalog
    from memfit.schema import TrainingConfig
    from model.allocator import AllocatorSettings, unsplit_block_bytes
    from model.recommend import parameter_block_bytes

    mib = 1 << 20
    assert unsplit_block_bytes([25 * mib] * 3) == 3 * mib
    assert unsplit_block_bytes([int(18.75 * mib)]) == 0  # 1.25 MiB remains: split, and cached
    assert unsplit_block_bytes([5 * mib, 13 * mib]) == 0  # the second splits the first's 20 MiB segment
    assert unsplit_block_bytes([5 * mib, 14 * mib]) == mib  # ... and takes its 15 MiB rest whole
    assert unsplit_block_bytes([25 * mib], AllocatorSettings.from_conf("expandable_segments:True")) == 0
    spec, hf = catalog.spec("gpt2-large"), catalog.get("gpt2-large")["hf_config"]
    amp = TrainingConfig(micro_batch_size=4, seq_len=1024, precision="amp_bf16")
    table = 50257 * 1280 * 4
    assert parameter_block_bytes(spec, amp, hf) == 36 * 2 * mib + (-(-table // (2 * mib)) * 2 * mib - table)
    expandable = AllocatorSettings.from_conf("expandable_segments:True")
    assert parameter_block_bytes(spec, amp, hf, expandable) == 0
    zero3 = amp.model_copy(update={"sharding": "zero3", "data_parallel_size": 8})
    assert parameter_block_bytes(spec, zero3, hf) == 0
