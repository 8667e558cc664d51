"""A model of PyTorch's CUDA caching allocator: reserved bytes and out-of-memory from an allocation stream.

PyTorch turns every tensor allocation into a block of a cached device segment. How much device memory it
*reserves* (``torch.cuda.max_memory_reserved``), and whether a step runs out of memory under a cap, follow
deterministically from the order and sizes of the allocations and frees. :class:`CachingAllocatorModel`
replays them with the rules of ``DeviceCachingAllocator`` in PyTorch's
``c10/cuda/CUDACachingAllocator.cpp`` (names below are that file's functions), one device, one stream:

* ``round_size``: sizes round up to 512 B (``kMinBlockSize``), or to a power-of-two division with
  ``roundup_power2_divisions``;
* ``get_pool``: requests <= 1 MiB (``kSmallSize``) use the small pool, larger ones the large pool;
* ``get_allocation_size``: a new small segment is 2 MiB (``kSmallBuffer``), a request below 10 MiB
  (``kMinLargeAlloc``) gets a 20 MiB segment (``kLargeBuffer``), a larger one its size rounded up to 2 MiB
  (``kRoundLarge``);
* ``get_free_block``: best fit (the smallest cached block that holds the request, lowest address on ties);
  with ``max_split_size_mb`` a request below it never takes a block at or above it, and a request at or
  above it takes a block at most ``max_non_split_rounding_mb`` (default 20 MiB) larger;
* ``should_split``: a small-pool block is split when >= 512 B remain; a large one only when the request is
  below ``max_split_size`` and more than 1 MiB remains (with expandable segments: >= 512 B);
* ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours of the same
  segment, never across segments;
* ``malloc``: no cached block -> optional ``garbage_collect_cached_blocks`` -> ``alloc_block``; when that
  fails, ``release_available_cached_blocks`` (oversize blocks, only with ``max_split_size_mb``) and retry,
  then ``release_cached_blocks`` (every cached segment without a live block) and retry
  (``num_alloc_retries``), then out of memory;
* ``alloc_block``: with a cap (``torch.cuda.set_per_process_memory_fraction``) the request fails when
  reserved + ``get_allocation_size`` would exceed it, before any device call;
* expandable segments (``Note [Expandable Segments]``, ``ExpandableSegment``, ``find_expandable_block``,
  ``map_block``, ``try_allocate_expandable_block``, ``unmap_block``, ``release_blocks``): one growing
  segment per pool, mapped in pages of 2 MiB (small pool) or 20 MiB (large pool) at the lowest address
  where the request fits; releasing unmaps every fully free page.

Not modelled: several streams (``recordStream`` events), CUDA graph private pools, IPC, the
``cudaMallocAsync`` backend, and the device driver's own 2 MiB rounding below the cap.

Sizes are bytes throughout. Replaying 1e5 events takes well under a second (pure Python, ``bisect``).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30
MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = MIB  # kSmallSize: largest small-pool request
SMALL_BUFFER_BYTES = 2 * MIB  # kSmallBuffer: small segment, and small expandable page
MIN_LARGE_ALLOC_BYTES = 10 * MIB  # kMinLargeAlloc: requests below it share a 20 MiB segment
LARGE_BUFFER_BYTES = 20 * MIB  # kLargeBuffer: 20 MiB segment, and large expandable page
ROUND_LARGE_BYTES = 2 * MIB  # kRoundLarge
ROUNDUP_POWER2_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB
UNLIMITED = (1 << 64) - 1  # std::numeric_limits<size_t>::max()

_BOOL_KEYS = (
    "expandable_segments",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_use_background_threads",
)
KNOWN_KEYS = (
    "backend",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "pinned_num_register_threads",
    *_BOOL_KEYS,
)


class AllocatorConfError(ValueError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` string PyTorch would refuse; the message names the key and what is allowed."""


@dataclass(frozen=True)
class AllocatorSettings:
    """The caching-allocator settings of a ``PYTORCH_CUDA_ALLOC_CONF`` string that change memory use.

    Attributes:
        expandable_segments: ``expandable_segments:True``.
        max_split_size_bytes: ``max_split_size_mb`` in bytes; :data:`UNLIMITED` when unset.
        max_non_split_rounding_bytes: ``max_non_split_rounding_mb`` in bytes (default 20 MiB).
        garbage_collection_threshold: in (0, 1), or 0 when unset; acts only under a cap.
        roundup_power2_divisions: divisions per power-of-two interval, 16 intervals from 1 MiB to 64 GiB
            (0 = round to 512 B).
        backend: ``native`` or ``cudaMallocAsync`` (the latter is not modelled).
        conf: the string parsed ("" for PyTorch's defaults).
    """

    expandable_segments: bool = False
    max_split_size_bytes: int = UNLIMITED
    max_non_split_rounding_bytes: int = LARGE_BUFFER_BYTES
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_POWER2_INTERVALS
    backend: str = "native"
    conf: str = ""

    @classmethod
    def from_conf(cls, conf: str | None) -> AllocatorSettings:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string as PyTorch does (``AllocatorConfig::parseArgs`` in
        ``c10/core/AllocatorConfig.cpp``): comma-separated ``key:value`` pairs, spaces ignored.

        Raises:
            AllocatorConfError: an unknown key, a missing value, or a value out of its range
                (``max_split_size_mb`` / ``max_non_split_rounding_mb`` >= 20, ``garbage_collection_threshold``
                in (0, 1), booleans ``True``/``False``, divisions a power of two or 0, backend ``native`` or
                ``cudaMallocAsync``).
        """
        if conf is None or not conf.strip():
            return cls()
        tokens = _lex(conf)
        values: dict[str, object] = {}
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key not in KNOWN_KEYS:
                raise AllocatorConfError(
                    f"PYTORCH_CUDA_ALLOC_CONF: unknown option {key!r}; allowed: {', '.join(KNOWN_KEYS)}"
                )
            if i + 1 >= len(tokens) or tokens[i + 1] != ":":
                raise AllocatorConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs ':' and a value")
            i += 2
            if key == "roundup_power2_divisions":
                values[key], i = _parse_divisions(tokens, i)
            else:
                if i >= len(tokens) or tokens[i] in (",", ":", "[", "]"):
                    raise AllocatorConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a value")
                values[key] = _parse_value(key, tokens[i])
                i += 1
            if i < len(tokens):
                if tokens[i] != ",":
                    raise AllocatorConfError(
                        f"PYTORCH_CUDA_ALLOC_CONF: expected ',' after the value of {key}, got {tokens[i]!r}"
                    )
                i += 1
        return cls(
            expandable_segments=bool(values.get("expandable_segments", False)),
            max_split_size_bytes=int(values["max_split_size_mb"]) * MIB if "max_split_size_mb" in values else UNLIMITED,
            max_non_split_rounding_bytes=int(values.get("max_non_split_rounding_mb", 20)) * MIB,
            garbage_collection_threshold=float(values.get("garbage_collection_threshold", 0.0)),
            roundup_power2_divisions=values.get("roundup_power2_divisions", (0,) * ROUNDUP_POWER2_INTERVALS),
            backend=str(values.get("backend", "native")),
            conf=conf.strip(),
        )

    def describe(self) -> str:
        """A short human-readable name: ``default`` or the non-default settings."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments")
        if self.max_split_size_bytes != UNLIMITED:
            parts.append(f"max_split_size_mb={self.max_split_size_bytes // MIB}")
        if self.max_non_split_rounding_bytes != LARGE_BUFFER_BYTES:
            parts.append(f"max_non_split_rounding_mb={self.max_non_split_rounding_bytes // MIB}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold={self.garbage_collection_threshold}")
        if any(self.roundup_power2_divisions):
            parts.append("roundup_power2_divisions")
        if self.backend != "native":
            parts.append(f"backend={self.backend}")
        return ", ".join(parts) or "default"


def _lex(conf: str) -> list[str]:
    """``AllocatorConfig::lexArgs``: split on ``, : [ ]`` (kept as tokens), drop spaces."""
    out, buf = [], []
    for ch in conf:
        if ch in ",:[]":
            if buf:
                out.append("".join(buf))
                buf = []
            out.append(ch)
        elif ch != " ":
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out


def _int(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise AllocatorConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be an integer, got {text!r}") from None


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parse_value(key: str, text: str) -> object:
    if key in _BOOL_KEYS:
        if text not in ("True", "False"):
            raise AllocatorConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be True or False, got {text!r}")
        return text == "True"
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        mb = _int(key, text)
        if mb < LARGE_BUFFER_BYTES // MIB:
            raise AllocatorConfError(
                f"PYTORCH_CUDA_ALLOC_CONF: {key} too small, must be >= {LARGE_BUFFER_BYTES // MIB}; got {mb}"
            )
        return mb
    if key == "garbage_collection_threshold":
        try:
            val = float(text)
        except ValueError:
            raise AllocatorConfError(
                f"PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold must be a number in (0.0, 1.0), got {text!r}"
            ) from None
        if not 0.0 < val < 1.0:
            raise AllocatorConfError(
                f"PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold must be in (0.0, 1.0), got {val}"
            )
        return val
    if key == "backend":
        if text not in ("native", "cudaMallocAsync"):
            raise AllocatorConfError(
                f"PYTORCH_CUDA_ALLOC_CONF: backend must be native or cudaMallocAsync, got {text!r}"
            )
        return text
    if key == "pinned_num_register_threads":
        n = _int(key, text)
        if not _is_pow2(n) or n > 128:
            raise AllocatorConfError(
                f"PYTORCH_CUDA_ALLOC_CONF: pinned_num_register_threads must be a power of 2 up to 128, got {n}"
            )
        return n
    raise AssertionError(key)  # every known key is handled above


def _parse_divisions(tokens: list[str], i: int) -> tuple[tuple[int, ...], int]:
    """``AllocatorConfig::parseRoundUpPower2Divisions``: one value for all sizes, or ``[size_mb:div, ..., >:div]``."""
    key = "roundup_power2_divisions"
    divs = [0] * ROUNDUP_POWER2_INTERVALS
    if i >= len(tokens):
        raise AllocatorConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} needs a value")
    if tokens[i] != "[":
        val = _int(key, tokens[i])
        if not _is_pow2(val):
            raise AllocatorConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} must be a power of 2, got {val}")
        return (val,) * ROUNDUP_POWER2_INTERVALS, i + 1
    i += 1
    first, last_index = True, 0
    while i < len(tokens) and tokens[i] != "]":
        left = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise AllocatorConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} entries are size_mb:divisions")
        val = _int(key, tokens[i + 2])
        if val != 0 and not _is_pow2(val):
            raise AllocatorConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} divisions must be a power of 2 or 0, got {val}")
        if left == ">":
            divs[last_index:] = [val] * (ROUNDUP_POWER2_INTERVALS - last_index)
        else:
            size_mb = _int(key, left)
            if not _is_pow2(size_mb):
                raise AllocatorConfError(
                    f"PYTORCH_CUDA_ALLOC_CONF: {key} interval sizes must be powers of 2 (MiB), got {size_mb}"
                )
            index = min(size_mb.bit_length() - 1, ROUNDUP_POWER2_INTERVALS - 1)
            if first:
                divs[:index] = [val] * index
                first = False
            divs[index] = val
            last_index = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1
    if i >= len(tokens):
        raise AllocatorConfError(f"PYTORCH_CUDA_ALLOC_CONF: {key} list is missing ']'")
    return tuple(divs), i + 1


# -- allocator state ----------------------------------------------------------------------------------


class SimulatedOutOfMemory(Exception):
    """The modelled allocator ran out of memory, as ``torch.OutOfMemoryError`` would be raised.

    Attributes:
        request_bytes: what PyTorch's message says it "tried to allocate" (``get_allocation_size``).
        allocated_bytes / reserved_bytes: the allocator's state after its release-and-retry.
    """

    def __init__(self, request_bytes: int, allocated_bytes: int, reserved_bytes: int) -> None:
        super().__init__(
            f"out of memory: tried to allocate {request_bytes / GIB:.2f} GiB with "
            f"{allocated_bytes / GIB:.2f} GiB allocated and {reserved_bytes / GIB:.2f} GiB reserved"
        )
        self.request_bytes = request_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes


class _Segment:
    """An expandable segment: a reserved address range mapped page by page (``ExpandableSegment``)."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, size: int, page: int) -> None:
        self.base, self.size, self.page = base, size, page


class Block:
    """A block of a segment (``Block``): ``addr``/``size`` in bytes, neighbours in the same segment."""

    __slots__ = ("addr", "allocated", "gc_base", "mapped", "next", "prev", "seg", "size", "small")

    def __init__(self, addr: int, size: int, small: bool, seg: _Segment | None = None) -> None:
        self.addr, self.size, self.small, self.seg = addr, size, small, seg
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.mapped = True
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """``BlockPool``: free mapped blocks ordered by (size, address), unmapped ones by address."""

    __slots__ = ("calls", "free", "small", "unmapped")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: list[tuple] = []  # (size, addr, block)
        self.unmapped: list[tuple] = []  # (addr, block)
        self.calls = 0  # get_free_blocks_call_count

    def insert(self, b: Block) -> None:
        b.gc_base = self.calls
        bisect.insort(self.free, (b.size, b.addr, b))

    def erase(self, b: Block) -> None:
        i = bisect.bisect_left(self.free, (b.size, b.addr))
        del self.free[i]

    def insert_unmapped(self, b: Block) -> None:
        bisect.insort(self.unmapped, (b.addr, b))

    def erase_unmapped(self, b: Block) -> None:
        i = bisect.bisect_left(self.unmapped, (b.addr,))
        del self.unmapped[i]


class CachingAllocatorModel:
    """One device's caching allocator (``DeviceCachingAllocator``) on one stream.

    Args:
        settings: the allocator settings (:meth:`AllocatorSettings.from_conf`).
        capacity_bytes: the most the allocator may reserve, or None for no limit. With
            ``cap="fraction"`` (``torch.cuda.set_per_process_memory_fraction``, PyTorch's ``allowed_memory_maximum``)
            a new segment is refused when reserved + its allocation size exceeds it; with ``cap="device"``
            (the device's free memory) cudaMalloc fails the same way, and an expandable segment maps as many
            pages as fit.
        cap: ``fraction`` or ``device``.
        device_total_bytes: the device's memory, sizing an expandable segment's address space (1 1/8 of it).

    Raises:
        ValueError: ``backend:cudaMallocAsync`` (not modelled), a negative capacity or an unknown ``cap``.

    Attributes (bytes): ``allocated_bytes``, ``reserved_bytes``, their peaks since construction or
    :meth:`reset_peak`, ``num_alloc_retries``, ``num_ooms``.
    """

    def __init__(
        self,
        settings: AllocatorSettings | None = None,
        capacity_bytes: int | None = None,
        *,
        cap: str = "fraction",
        device_total_bytes: int | None = None,
    ) -> None:
        self.settings = settings = settings or AllocatorSettings()
        if settings.backend != "native":
            raise ValueError(f"backend={settings.backend} is not modelled: only the native caching allocator")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if cap not in ("fraction", "device"):
            raise ValueError(f"cap must be 'fraction' or 'device', got {cap!r}")
        self.capacity_bytes = capacity_bytes
        self._cap_kind = cap
        self.fraction = cap == "fraction" and capacity_bytes is not None
        total = device_total_bytes or capacity_bytes or (1 << 47)
        self._address_space = total + total // 8
        self.small_pool, self.large_pool = _Pool(True), _Pool(False)
        self.allocated_bytes = self.reserved_bytes = 0
        self.peak_allocated_bytes = self.peak_reserved_bytes = 0
        self.num_alloc_retries = self.num_ooms = 0
        self.last_oom: SimulatedOutOfMemory | None = None
        self.active: set[Block] = set()  # active_blocks
        self._next_addr = 1 << 40
        self._max_split = settings.max_split_size_bytes
        self._expandable = settings.expandable_segments
        self._gc = self.fraction and settings.garbage_collection_threshold > 0.0

    # -- public --------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        """Allocate ``nbytes`` (> 0) and return its block (``DeviceCachingAllocator::malloc``).

        Raises:
            SimulatedOutOfMemory: no cached block fits and no new memory can be reserved, after releasing
                cached segments and retrying.
        """
        size = self.round_size(nbytes)
        pool = self.small_pool if size <= SMALL_SIZE_BYTES else self.large_pool
        alloc_size = allocation_size(size)
        block = self._get_free_block(pool, size)
        if block is None:
            if self._gc:
                self._garbage_collect()
            block = self._alloc_block(pool, size, alloc_size) or (
                self._release_available_cached_blocks(pool, size) and self._alloc_block(pool, size, alloc_size)
            )
            if not block:
                self._release_cached_blocks()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, size, alloc_size)
            if not block:
                self.num_ooms += 1
                self.last_oom = SimulatedOutOfMemory(alloc_size, self.allocated_bytes, self.reserved_bytes)
                raise self.last_oom
        remaining = block.size - size
        if pool.small or self._expandable:
            split = remaining >= MIN_BLOCK_BYTES
        else:
            split = size < self._max_split and remaining > SMALL_SIZE_BYTES
        if split:  # alloc_found_block: the front becomes the allocation, the rest stays cached
            rest = block
            block = Block(rest.addr, size, rest.small, rest.seg)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size -= size
            pool.insert(rest)
        block.allocated = True
        self.active.add(block)
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block

    def free(self, block: Block) -> None:
        """Return a block to its pool, merging it with free neighbours (``free`` / ``free_block``)."""
        block.allocated = False
        self.active.discard(block)
        self.allocated_bytes -= block.size
        pool = self.small_pool if block.small else self.large_pool
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached segment without a live block."""
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``."""
        self.peak_allocated_bytes = self.allocated_bytes
        self.peak_reserved_bytes = self.reserved_bytes

    def set_capacity(self, capacity_bytes: int | None) -> None:
        """Change the cap between steps (``set_per_process_memory_fraction``; None lifts it)."""
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.fraction = self._cap_kind == "fraction" and capacity_bytes is not None
        self._gc = self.fraction and self.settings.garbage_collection_threshold > 0.0

    def round_size(self, nbytes: int) -> int:
        """``round_size``: 512 B blocks, or the next power-of-two division with ``roundup_power2_divisions``."""
        if nbytes < MIN_BLOCK_BYTES:
            return MIN_BLOCK_BYTES
        divs = self.settings.roundup_power2_divisions
        if divs[0] or any(divs):
            index = min(max(0, nbytes.bit_length() - 1 - 20), ROUNDUP_POWER2_INTERVALS - 1)
            d = divs[index]
            if d > 1 and nbytes > MIN_BLOCK_BYTES * d:
                return _roundup_power2_next_division(nbytes, d)
        return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES

    def segments(self) -> list[list[Block]]:
        """Every segment's blocks in address order (mapped and unmapped), for inspection and tests."""
        heads, seen = list(self.active), set()
        for pool in (self.small_pool, self.large_pool):
            for entry in pool.free:
                heads.append(entry[2])
            for _addr, b in pool.unmapped:
                heads.append(b)
        out = []
        for b in heads:
            while b.prev is not None:
                b = b.prev
            if id(b) in seen:
                continue
            seen.add(id(b))
            seg = []
            while b is not None:
                seg.append(b)
                b = b.next
            out.append(seg)
        return out

    # -- internals -----------------------------------------------------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> Block | None:
        """``get_free_block``: best fit, with the expandable and ``max_split_size`` rules."""
        if self._gc:
            pool.calls += 1
        free = pool.free
        i = bisect.bisect_left(free, (size,))
        if i == len(free):
            return None
        b = free[i][2]
        if b.seg is not None and self._expandable:
            # best fit by the size a block can grow to (its free size plus the unmapped space after it)
            def grow(x: Block) -> int:
                nxt = x.next
                return x.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

            while b.seg is not None and i + 1 < len(free) and grow(free[i + 1][2]) < grow(b):
                i += 1
                b = free[i][2]
        if size < self._max_split and b.size >= self._max_split:
            return None
        if size >= self._max_split and b.size >= size + self.settings.max_non_split_rounding_bytes:
            return None
        del free[i]
        return b

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> Block | None:
        """``alloc_block``: a new segment (cudaMalloc), or more pages of the expandable segment."""
        cap = self.capacity_bytes
        if self.fraction and self.reserved_bytes + alloc_size > cap:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        if cap is not None and self.reserved_bytes + alloc_size > cap:
            return None
        block = Block(self._next_addr, alloc_size, pool.small)
        self._next_addr += alloc_size + ROUND_LARGE_BYTES
        self._reserve(alloc_size)
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def _merge(self, dst: Block, src: Block | None, pool: _Pool) -> int:
        """``try_merge_blocks``: absorb a free neighbour of the same mapping state; returns its size or 0."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        dst.size += src.size
        return src.size

    def _release_block(self, pool: _Pool, b: Block) -> None:
        """``release_block``: cudaFree a whole unsplit cached segment."""
        pool.erase(b)
        self.reserved_bytes -= b.size

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size_mb``, free oversize cached blocks."""
        if self._max_split == UNLIMITED:
            return False
        key = max(size, self._max_split)
        free = pool.free
        i = bisect.bisect_left(free, (key,))
        if i < len(free) and free[i][2].seg is None:
            self._release_block(pool, free[i][2])
            return True
        released = 0
        i -= 1
        while i >= 0 and released < key and free[i][0] >= self._max_split:
            b = free[i][2]
            if b.seg is None:
                self._release_block(pool, b)
                released += b.size
            i -= 1
        return released >= key

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks`` / ``release_blocks``: free unsplit segments, unmap free expandable pages."""
        for pool in (self.large_pool, self.small_pool):
            to_unmap = []
            for _size, _addr, b in list(pool.free):
                if b.seg is not None:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_block(pool, b)
            for b in to_unmap:
                self._unmap_block(pool, b)
                if b.prev is None and b.next is None and not b.mapped:  # release_expandable_segment
                    pool.erase_unmapped(b)

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: free the oldest unsplit large cached blocks above the threshold."""
        threshold = int(self.settings.garbage_collection_threshold * self.capacity_bytes)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        pool = self.large_pool
        freeable = [b for _s, _a, b in pool.free if not b.is_split()]
        if not freeable:
            return
        total_age = sum(pool.calls - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed, freed_one = 0, True
        while reclaimed < target and freed_one and count > 0:
            threshold_age = total_age / count
            freed_one = False
            for _s, _a, b in list(pool.free):
                if not b.is_split() and b.seg is None and pool.calls - b.gc_base >= threshold_age:
                    freed_one = True
                    reclaimed += b.size
                    total_age -= pool.calls - b.gc_base
                    count -= 1
                    self._release_block(pool, b)

    # -- expandable segments -------------------------------------------------------------------------
    def _find_expandable_block(self, pool: _Pool, size: int) -> Block:
        """``find_expandable_block``: the lowest-address free run that can hold ``size`` after mapping,
        or a new segment's unmapped range."""
        for _addr, c in pool.unmapped:
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = SMALL_BUFFER_BYTES if pool.small else LARGE_BUFFER_BYTES
        space = -(-self._address_space // page) * page
        seg = _Segment(self._next_addr, space, page)
        self._next_addr += space + page
        c = Block(seg.base, space, pool.small, seg)
        c.mapped = False
        pool.insert_unmapped(c)
        return c

    def _map_block(self, pool: _Pool, to_map: Block, size: int) -> bool:
        """``map_block``: map the pages covering the first ``size`` bytes of an unmapped block."""
        seg = to_map.seg
        begin = (to_map.addr - seg.base) // seg.page
        end = -(-(to_map.addr + size - seg.base) // seg.page)
        mapped = (end - begin) * seg.page
        if not self.fraction and self.capacity_bytes is not None:
            fit = (self.capacity_bytes - self.reserved_bytes) // seg.page * seg.page  # cuMemCreate page by page
            if fit < mapped:
                return False
        pool.erase_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.addr + mapped, to_map.size - mapped, pool.small, seg)
            rest.mapped = False
            rest.prev, rest.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._merge(to_map, to_map.prev, pool)
        self._merge(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._reserve(mapped)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> Block | None:
        """``try_allocate_expandable_block``: grow the segment at the lowest address that fits ``size``."""
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(pool, c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            if not self._map_block(pool, nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.erase(c)
        return c

    def _unmap_block(self, pool: _Pool, b: Block) -> None:
        """``unmap_block``: unmap the fully free pages inside a free block; partial pages stay mapped."""
        seg = b.seg
        begin = -(-(b.addr - seg.base) // seg.page)
        end = (b.addr + b.size - seg.base) // seg.page
        if begin >= end:
            return
        pool.erase(b)
        lo, hi = seg.base + begin * seg.page, seg.base + end * seg.page
        if lo > b.addr:
            before = Block(b.addr, lo - b.addr, pool.small, seg)
            before.prev, before.next = b.prev, b
            if b.prev is not None:
                b.prev.next = before
            b.prev = before
            pool.insert(before)
        if b.addr + b.size > hi:
            after = Block(hi, b.addr + b.size - hi, pool.small, seg)
            after.prev, after.next = b, b.next
            if b.next is not None:
                b.next.prev = after
            b.next = after
            pool.insert(after)
        b.addr, b.size, b.mapped = lo, hi - lo, False
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.insert_unmapped(b)
        self.reserved_bytes -= hi - lo


def unsplit_block_bytes(request_bytes: Iterable[int], settings: AllocatorSettings | None = None) -> int:
    """Bytes the caching allocator counts as allocated beyond the rounded requests when ``request_bytes`` are
    allocated in order on an empty allocator and none is freed (a model's parameters as its constructor makes them).

    A request over 10 MiB gets a new segment rounded up to 2 MiB (``get_allocation_size``) and the block is not
    split when at most 1 MiB would remain (``should_split``: ``remaining > kSmallSize`` in the large pool), so
    ``memory_allocated`` counts the whole block (PyTorch ``c10/cuda/CUDACachingAllocator.cpp``). Replayed through
    :class:`CachingAllocatorModel` with ``settings``: expandable segments split every remainder (0 here).
    """
    alloc = CachingAllocatorModel(settings)
    requested = 0
    for n in request_bytes:
        if n > 0:
            alloc.malloc(n)
            requested += alloc.round_size(n)
    return alloc.allocated_bytes - requested


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a request of ``size`` rounded bytes would get from cudaMalloc."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round up to the next of ``divisions`` steps between powers of 2."""
    if _is_pow2(size):
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


# -- allocation streams --------------------------------------------------------------------------------


@dataclass
class AllocationStream:
    """The allocations and frees of a traced training step, in order.

    Attributes:
        handles: one per event, naming the allocation (an allocation's handle is new; a free repeats it).
        sizes: per event, the storage bytes requested (> 0), or 0 for a free.
        measured_from: index of the first event after ``torch.cuda.reset_peak_memory_stats()`` (the measured
            step); 0 when the whole stream is measured.
        phases: ``(event index, phase name)`` marks, in order (build, forward, backward, optimizer ...).
        meta: JSON-able facts about what was traced (model, training configuration, torch version).
        layer_labels: per event, the decoder layer it belongs to, -1 for none, or None when not recorded
            (``tracer.allocation.RecordingTracker.attach_layers``). In the forward and backward, the layer
            running (from its forward pre-hook, and from the gradient hook of its output until the next layer's
            starts; a free outside any layer takes its allocation's label); in the build and the optimizer
            step, the layer of the parameter the tensor belongs to. :mod:`model.stream_compose` builds a
            deeper model's stream from these.
    """

    handles: list[int]
    sizes: list[int]
    measured_from: int = 0
    phases: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    meta: dict = dataclasses.field(default_factory=dict)
    layer_labels: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.handles) != len(self.sizes):
            raise ValueError(f"handles and sizes differ in length: {len(self.handles)} != {len(self.sizes)}")
        if not 0 <= self.measured_from <= len(self.sizes):
            raise ValueError(f"measured_from must be in 0..{len(self.sizes)}, got {self.measured_from}")
        if self.layer_labels is not None and len(self.layer_labels) != len(self.sizes):
            raise ValueError(f"layer_labels has {len(self.layer_labels)} entries for {len(self.sizes)} events")

    def __len__(self) -> int:
        return len(self.sizes)

    def live_bytes_peak(self, start: int = 0) -> int:
        """Peak of live bytes rounded to 512 B (the fake tracker's figure) from event ``start`` on."""
        live, sizes_by_handle = 0, {}
        peak = None
        for i, (h, n) in enumerate(zip(self.handles, self.sizes)):
            if n:
                r = -(-n // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES
                sizes_by_handle[h] = r
                live += r
            else:
                live -= sizes_by_handle.pop(h, 0)
            if i >= start and (peak is None or live > peak):
                peak = live
        return peak if peak is not None else live

    def phase_at(self, index: int) -> str | None:
        """The phase an event belongs to."""
        names = [name for at, name in self.phases if at <= index]
        return names[-1] if names else None

    def repeat_measured(self, times: int) -> AllocationStream:
        """This stream with its measured step run ``times`` times in all (a job's next steps).

        Allocations of a repeated step get new handles; a free in the step of an allocation made before it
        frees, in each repetition, the oldest allocation the previous repetition left live.

        Raises:
            ValueError: ``times`` < 1.
        """
        if times < 1:
            raise ValueError(f"times must be >= 1, got {times}")
        handles, sizes = list(self.handles), list(self.sizes)
        step_h, step_s = self.handles[self.measured_from :], self.sizes[self.measured_from :]
        inside = {h for h, n in zip(step_h, step_s) if n}
        next_handle = max(self.handles, default=0) + 1
        prev_map: dict[int, int] = {h: h for h in inside}
        left = [h for h in _live_after(step_h, step_s) if h in inside]  # allocations a step leaves live
        phases = list(self.phases)
        step_phases = [(at - self.measured_from, name) for at, name in self.phases if at >= self.measured_from]
        for _ in range(times - 1):
            carried = [prev_map[h] for h in left]
            cur: dict[int, int] = {}
            offset = len(sizes)
            for h, n in zip(step_h, step_s):
                if n:
                    cur[h] = next_handle
                    handles.append(next_handle)
                    next_handle += 1
                    sizes.append(n)
                elif h in cur:
                    handles.append(cur[h])
                    sizes.append(0)
                elif carried:
                    handles.append(carried.pop(0))
                    sizes.append(0)
            phases += [(offset + at, name) for at, name in step_phases]
            prev_map = cur
        return AllocationStream(handles, sizes, self.measured_from, phases, dict(self.meta))

    def save(self, path) -> None:
        """Write the stream as a ``.npz`` file (numpy arrays and a JSON string; no pickle)."""
        import json

        import numpy as np

        np.savez_compressed(
            path,
            handles=np.asarray(self.handles, dtype=np.int64),
            sizes=np.asarray(self.sizes, dtype=np.int64),
            measured_from=np.int64(self.measured_from),
            phase_at=np.asarray([at for at, _ in self.phases], dtype=np.int64),
            phase_names=np.asarray(json.dumps([n for _, n in self.phases])),
            meta=np.asarray(json.dumps(self.meta, sort_keys=True)),
            **({} if self.layer_labels is None else {"layer_labels": np.asarray(self.layer_labels, dtype=np.int32)}),
        )

    @classmethod
    def load(cls, path) -> AllocationStream:
        """Read a stream written by :meth:`save`."""
        import json

        import numpy as np

        with np.load(path, allow_pickle=False) as z:
            names = json.loads(str(z["phase_names"]))
            return cls(
                z["handles"].tolist(),
                z["sizes"].tolist(),
                int(z["measured_from"]),
                list(zip(z["phase_at"].tolist(), names)),
                json.loads(str(z["meta"])),
                z["layer_labels"].tolist() if "layer_labels" in z.files else None,
            )


def stream_from_cuda_trace(entries: Iterable[Sequence], meta: dict | None = None) -> AllocationStream:
    """An :class:`AllocationStream` from a real run's allocator trace (``torch.cuda.memory._snapshot()``
    ``["device_traces"][0]`` after ``torch.cuda.memory._record_memory_history()``), one stream.

    Args:
        entries: ``(action, addr, size)`` triples in trace order. ``alloc`` (size = the requested bytes)
            and ``free_requested`` make the events; the first ``snapshot`` marks ``measured_from`` (call
            ``_snapshot()`` right after ``reset_peak_memory_stats()``); the first ``oom`` (size = the rounded
            request) becomes an allocation at ``meta["oom_event"]``, so a replay meets the request the GPU could
            not serve; segment actions are counted in ``meta`` and otherwise ignored.

    Raises:
        ValueError: a free of an address the trace never allocated (the trace lost its beginning).
    """
    handles: list[int] = []
    sizes: list[int] = []
    live: dict[int, int] = {}
    measured_from = None
    info = dict(meta or {})
    counts: dict[str, int] = {}
    for action, addr, size in entries:
        counts[action] = counts.get(action, 0) + 1
        if action == "alloc":
            h = len(handles) + 1
            live[int(addr)] = h
            handles.append(h)
            sizes.append(int(size))
        elif action == "free_requested":
            h = live.pop(int(addr), None)
            if h is None:
                raise ValueError(f"the trace frees address {addr:#x}, which it never allocated")
            handles.append(h)
            sizes.append(0)
        elif action == "snapshot" and measured_from is None:
            measured_from = len(sizes)
        elif action == "oom" and "oom_event" not in info:
            info["oom_event"] = len(sizes)  # the failed request, kept as the stream's next allocation
            info["oom_request_bytes"] = int(size)
            handles.append(len(handles) + 1)
            sizes.append(int(size))
    info["actions"] = counts
    return AllocationStream(handles, sizes, measured_from or 0, [], info)


def _live_after(handles: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """Handles allocated in the events and still live after them, in allocation order."""
    live: dict[int, None] = {}
    for h, n in zip(handles, sizes):
        if n:
            live[h] = None
        else:
            live.pop(h, None)
    return list(live)


@dataclass(frozen=True)
class ReplayResult:
    """What a stream does to the modelled allocator.

    Attributes (bytes):
        peak_allocated_bytes / peak_reserved_bytes: peaks of the measured window (from ``measured_from``),
            as ``max_memory_allocated`` / ``max_memory_reserved`` after ``reset_peak_memory_stats``.
        oom: the stream ran out of memory (anywhere, build and warm-up included).
        oom_request_bytes: what the failing allocation "tried to allocate"; None without OOM.
        oom_event / oom_phase: where it failed.
        allocated_at_oom_bytes / reserved_at_oom_bytes: the state at the failure.
        num_alloc_retries: release-and-retry rounds over the whole stream.
        settings: the settings description (:meth:`AllocatorSettings.describe`).
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    oom: bool
    oom_request_bytes: int | None
    oom_event: int | None
    oom_phase: str | None
    allocated_at_oom_bytes: int | None
    reserved_at_oom_bytes: int | None
    num_alloc_retries: int
    settings: str


def _run_events(
    alloc: CachingAllocatorModel,
    blocks: dict[int, Block],
    stream: AllocationStream,
    lo: int,
    hi: int,
    reset_at: int | None = None,
) -> int | None:
    """Apply events ``lo..hi-1``; return the index of the one that ran out of memory, or None."""
    malloc, free, handles, sizes = alloc.malloc, alloc.free, stream.handles, stream.sizes
    for i in range(lo, hi):
        if i == reset_at:
            alloc.reset_peak()
        n = sizes[i]
        if n:
            try:
                blocks[handles[i]] = malloc(n)
            except SimulatedOutOfMemory:
                return i
        else:
            b = blocks.pop(handles[i], None)
            if b is None:
                raise ValueError(f"event {i} frees handle {handles[i]}, which is not allocated")
            free(b)
    return None


def _result(
    alloc: CachingAllocatorModel, stream: AllocationStream, failed: int | None, oom: SimulatedOutOfMemory | None
) -> ReplayResult:
    if failed is None:
        return ReplayResult(
            alloc.peak_allocated_bytes,
            alloc.peak_reserved_bytes,
            False,
            None,
            None,
            None,
            None,
            None,
            alloc.num_alloc_retries,
            alloc.settings.describe(),
        )
    return ReplayResult(
        alloc.peak_allocated_bytes,
        alloc.peak_reserved_bytes,
        True,
        oom.request_bytes,
        failed,
        stream.phase_at(failed),
        oom.allocated_bytes,
        oom.reserved_bytes,
        alloc.num_alloc_retries,
        alloc.settings.describe(),
    )


def _settings(settings: AllocatorSettings | str | None) -> AllocatorSettings:
    return settings if isinstance(settings, AllocatorSettings) else AllocatorSettings.from_conf(settings)


def replay(
    stream: AllocationStream,
    settings: AllocatorSettings | str | None = None,
    capacity_bytes: int | None = None,
    *,
    cap: str = "fraction",
) -> ReplayResult:
    """Run a stream through a fresh :class:`CachingAllocatorModel`.

    Args:
        stream: the events.
        settings: :class:`AllocatorSettings` or a ``PYTORCH_CUDA_ALLOC_CONF`` string (None: PyTorch's defaults).
        capacity_bytes: the cap on reserved bytes (see :class:`CachingAllocatorModel`), None for none.
        cap: ``fraction`` (``set_per_process_memory_fraction``) or ``device``.

    Raises:
        AllocatorConfError: a bad settings string.
        ValueError: a free of an allocation the stream never made.
    """
    alloc = CachingAllocatorModel(_settings(settings), capacity_bytes, cap=cap)
    blocks: dict[int, Block] = {}
    start = stream.measured_from
    failed = _run_events(alloc, blocks, stream, 0, len(stream), reset_at=start)
    if failed is None and start == len(stream):
        alloc.reset_peak()
    return _result(alloc, stream, failed, alloc.last_oom)


def smallest_capacity(
    stream: AllocationStream,
    settings: AllocatorSettings | str | None = None,
    *,
    resolution_bytes: int = 32 * MIB,
    capped_steps: int = 2,
) -> int:
    """The smallest cap (``set_per_process_memory_fraction``) under which the measured step runs, as
    ``training/gpu_pressure.py`` measures it: the stream runs uncapped, then the cache is emptied, the cap
    set, and the measured step runs ``capped_steps`` more times. Bisection between the step's allocated
    peak and its uncapped reserved peak + 256 MiB, to ``resolution_bytes``; returns the upper end (bytes).

    Raises:
        ValueError: the step does not run even at the upper end.
    """
    settings = _settings(settings)
    steps = stream.repeat_measured(1 + capped_steps)
    cut = len(stream)

    def fits(capacity: int) -> bool:
        alloc = CachingAllocatorModel(settings)
        blocks: dict[int, Block] = {}
        _run_events(alloc, blocks, steps, 0, cut)
        alloc.empty_cache()
        alloc.set_capacity(capacity)
        return _run_events(alloc, blocks, steps, cut, len(steps)) is None

    base = replay(stream, settings)
    lo, hi = base.peak_allocated_bytes, base.peak_reserved_bytes + 256 * MIB
    if not fits(hi):
        raise ValueError("the step does not run even with 256 MiB above its uncapped reserved peak")
    while hi - lo > resolution_bytes:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi
