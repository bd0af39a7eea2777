"""A model of PyTorch's CUDA caching allocator, replayed over a training step's allocations.

The caching allocator (c10/cuda/CUDACachingAllocator.cpp) never gives memory back during a run:
what it reserved at its peak is what the device holds. It can reserve more than the tensors
need because of how it reuses freed memory, and that depends on the *order and sizes* of the
allocations. So the reserve is not a factor: :func:`replay` runs the rules over the event list
the memory estimate generates (capture.trial.memory) and reports the peak reserved beside the
peak allocated. The rules, as in PyTorch 2.x with the default settings:

- sizes are rounded up to 512 bytes;
- requests of at most 1 MiB come from a *small* pool of 2 MiB segments, larger ones from a
  *large* pool; a new large segment is 20 MiB for requests under 10 MiB, else the request
  rounded up to 2 MiB;
- a request takes the smallest cached free block that fits (best fit, then lowest address);
- the rest of a block is split off and stays cached when it is at least 512 bytes (small pool)
  or more than 1 MiB (large pool); freed blocks merge with free neighbours of the same segment;
- ``empty_cache`` releases segments that are entirely free.

With ``expandable_segments:True`` a pool is one segment that grows by 2 MiB pages
(:class:`ExpandableAllocator`): a request that fits no free block inside it goes at its end,
joining a free block there, so holes between live blocks still cost memory, but a larger
request no longer needs a segment of its own.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterable

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * ((n + MIN_BLOCK - 1) // MIN_BLOCK)


def allocation_size(n: int) -> int:
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((n + ROUND_LARGE - 1) // ROUND_LARGE)


@dataclass
class _Block:
    seg: int
    offset: int
    size: int
    free: bool = True


@dataclass
class _Pool:
    small: bool
    free: list[tuple[int, int, int]] = field(default_factory=list)  # (size, seg, offset), sorted
    reserved: int = 0


class CachingAllocator:
    """Best-fit block caching over segments, as PyTorch's CUDA allocator does it."""

    def __init__(self) -> None:
        self.pools = (_Pool(True), _Pool(False))
        self.blocks: dict[tuple[int, int], _Block] = {}   # (seg, offset) -> block
        self.segments: dict[int, list[int]] = {}          # seg -> sorted offsets of its blocks
        self.seg_pool: dict[int, _Pool] = {}
        self.seg_size: dict[int, int] = {}
        self.next_seg = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0

    def _pool(self, size: int) -> _Pool:
        return self.pools[0] if size <= SMALL_SIZE else self.pools[1]

    def malloc(self, nbytes: int) -> tuple[int, int]:
        size = round_size(nbytes)
        pool = self._pool(size)
        i = bisect.bisect_left(pool.free, (size, -1, -1))
        if i < len(pool.free):
            bsize, seg, off = pool.free.pop(i)
            block = self.blocks[(seg, off)]
        else:
            alloc = allocation_size(size)
            seg, off = self.next_seg, 0
            self.next_seg += 1
            block = _Block(seg, 0, alloc)
            self.blocks[(seg, 0)] = block
            self.segments[seg] = [0]
            self.seg_pool[seg] = pool
            self.seg_size[seg] = alloc
            pool.reserved += alloc
            self.reserved += alloc
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if pool.small else remaining > SMALL_SIZE:
            rest = _Block(block.seg, block.offset + size, remaining)
            block.size = size
            self.blocks[(rest.seg, rest.offset)] = rest
            bisect.insort(self.segments[rest.seg], rest.offset)
            bisect.insort(pool.free, (rest.size, rest.seg, rest.offset))
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.seg, block.offset

    def free(self, handle: tuple[int, int]) -> None:
        block = self.blocks[handle]
        pool = self.seg_pool[block.seg]
        self.allocated -= block.size
        block.free = True
        offsets = self.segments[block.seg]
        k = bisect.bisect_left(offsets, block.offset)
        if k + 1 < len(offsets):  # merge the next block
            nxt = self.blocks[(block.seg, offsets[k + 1])]
            if nxt.free:
                pool.free.remove((nxt.size, nxt.seg, nxt.offset))
                block.size += nxt.size
                del self.blocks[(nxt.seg, nxt.offset)]
                offsets.pop(k + 1)
        if k > 0:  # merge into the previous block
            prev = self.blocks[(block.seg, offsets[k - 1])]
            if prev.free:
                pool.free.remove((prev.size, prev.seg, prev.offset))
                prev.size += block.size
                del self.blocks[(block.seg, block.offset)]
                offsets.pop(k)
                block = prev
        bisect.insort(pool.free, (block.size, block.seg, block.offset))

    def empty_cache(self) -> None:
        for seg, offsets in list(self.segments.items()):
            if len(offsets) == 1 and self.blocks[(seg, 0)].free:
                pool = self.seg_pool[seg]
                pool.free.remove((self.blocks[(seg, 0)].size, seg, 0))
                del self.blocks[(seg, 0)]
                del self.segments[seg]
                pool.reserved -= self.seg_size[seg]
                self.reserved -= self.seg_size.pop(seg)
                del self.seg_pool[seg]

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


class ExpandableAllocator(CachingAllocator):
    """``expandable_segments:True``: each pool is one segment that grows at its end by 2 MiB
    pages; a request takes the best-fitting free block inside it, else goes at the end
    (joining a free block there). What it reserves is how far the segment was mapped."""

    def __init__(self) -> None:
        super().__init__()
        self.tail: dict[bool, int] = {True: 0, False: 0}   # mapped extent per pool (small?)
        self.end_free: dict[bool, int] = {True: 0, False: 0}

    def malloc(self, nbytes: int) -> tuple[int, int]:
        size = round_size(nbytes)
        pool = self._pool(size)
        i = bisect.bisect_left(pool.free, (size, -1, -1))
        seg = 0 if pool.small else 1
        if seg not in self.segments:
            self.segments[seg] = []
            self.seg_pool[seg] = pool
            self.seg_size[seg] = 0
        if i < len(pool.free):
            _, _, off = pool.free.pop(i)
            block = self.blocks[(seg, off)]
            rest = block.size - size
            if rest >= MIN_BLOCK:
                r = _Block(seg, off + size, rest)
                self.blocks[(seg, r.offset)] = r
                bisect.insort(self.segments[seg], r.offset)
                bisect.insort(pool.free, (r.size, seg, r.offset))
                block.size = size
        else:
            offsets = self.segments[seg]
            start = self.seg_size[seg]
            if offsets and self.blocks[(seg, offsets[-1])].free:  # grow from the free block at the end
                last = self.blocks[(seg, offsets[-1])]
                pool.free.remove((last.size, seg, last.offset))
                start = last.offset
                del self.blocks[(seg, last.offset)]
                offsets.pop()
            block = _Block(seg, start, size)
            self.blocks[(seg, start)] = block
            bisect.insort(offsets, start)
            grown = max(self.seg_size[seg], ROUND_LARGE * ((start + size + ROUND_LARGE - 1) // ROUND_LARGE))
            if grown > self.seg_size[seg]:
                self.reserved += grown - self.seg_size[seg]
                pool.reserved += grown - self.seg_size[seg]
                self.seg_size[seg] = grown
                self.peak_reserved = max(self.peak_reserved, self.reserved)
            end = start + size
            if self.seg_size[seg] > end:  # the mapped rest of the last page
                tail = _Block(seg, end, self.seg_size[seg] - end)
                self.blocks[(seg, end)] = tail
                bisect.insort(offsets, end)
                bisect.insort(pool.free, (tail.size, seg, end))
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.seg, block.offset

    def empty_cache(self) -> None:
        for seg, offsets in self.segments.items():  # unmap the free pages at the end
            if offsets and self.blocks[(seg, offsets[-1])].free:
                last = self.blocks[(seg, offsets[-1])]
                keep = ROUND_LARGE * ((last.offset + ROUND_LARGE - 1) // ROUND_LARGE)
                drop = self.seg_size[seg] - keep
                if drop > 0:
                    pool = self.seg_pool[seg]
                    pool.free.remove((last.size, seg, last.offset))
                    self.reserved -= drop
                    pool.reserved -= drop
                    self.seg_size[seg] = keep
                    if keep > last.offset:
                        last.size = keep - last.offset
                        bisect.insort(pool.free, (last.size, seg, last.offset))
                    else:
                        del self.blocks[(seg, last.offset)]
                        offsets.pop()


@dataclass(frozen=True)
class Replay:
    """What the allocator model saw over an event list."""

    peak_allocated: int
    peak_reserved: int
    peak_reserved_expandable: int
    peak_tags: dict[str, int]
    """Bytes live at the allocated peak, by tag (the terms of the estimate)."""
    peak_phase: str


class _NoAllocator:
    """Stands in for the expandable model when its figure is not wanted."""

    peak_reserved = 0

    def malloc(self, nbytes: int) -> None:
        return None

    def free(self, handle: object) -> None:
        pass

    empty_cache = reset_peaks = lambda self: None


CPU_ALIGNMENT = 64
"""torch's CPU allocator (c10::alloc_cpu) aligns every allocation to 64 bytes and caches nothing."""


def replay(events: Iterable[tuple], measure_from: int = 0, device_type: str = "cuda",
           expandable: bool = True) -> Replay:
    """Run ``events``: ``("alloc", id, nbytes, tag)``, ``("free", id)``, ``("retag", id, tag)``, ``("phase", name)``,
    ``("empty_cache",)``, ``("reset_peaks",)``. Peaks count from the last ``reset_peaks``. On a CPU
    there is no caching allocator: sizes are 64-byte aligned and reserved is allocated.
    ``expandable=False`` skips the ``expandable_segments`` model (its figure is then the default's)."""
    if device_type != "cuda":
        return _replay_cpu(events)
    alloc = CachingAllocator()
    exp = ExpandableAllocator() if expandable else _NoAllocator()
    exp_live: dict[int, Any] = {}  # exp's handles: tuples, or None from _NoAllocator
    live: dict[int, tuple[tuple[int, int], int, str]] = {}
    by_tag: dict[str, int] = {}
    best_tags: dict[str, int] = {}
    phase = best_phase = ""
    peak_alloc = 0
    for ev in events:
        kind = ev[0]
        if kind == "alloc":
            _, tid, nbytes, tag = ev
            handle = alloc.malloc(nbytes)
            exp_live[tid] = exp.malloc(nbytes)
            size = round_size(nbytes)
            live[tid] = (handle, size, tag)
            by_tag[tag] = by_tag.get(tag, 0) + size
            if alloc.allocated > peak_alloc:
                peak_alloc, best_tags, best_phase = alloc.allocated, dict(by_tag), phase
        elif kind == "free":
            handle, size, tag = live.pop(ev[1])
            alloc.free(handle)
            exp.free(exp_live.pop(ev[1]))
            by_tag[tag] -= size
        elif kind == "retag":
            _, tid, tag = ev
            handle, size, old = live[tid]
            if old != tag:
                live[tid] = (handle, size, tag)
                by_tag[old] -= size
                by_tag[tag] = by_tag.get(tag, 0) + size
        elif kind == "phase":
            phase = ev[1]
        elif kind == "empty_cache":
            alloc.empty_cache()
            exp.empty_cache()
        elif kind == "reset_peaks":
            alloc.reset_peaks()
            exp.reset_peaks()
            peak_alloc, best_tags, best_phase = alloc.allocated, dict(by_tag), phase
    return Replay(peak_allocated=alloc.peak_allocated, peak_reserved=alloc.peak_reserved,
                  peak_reserved_expandable=max(exp.peak_reserved, alloc.peak_allocated) if expandable else alloc.peak_reserved,
                  peak_tags={k: v for k, v in best_tags.items() if v}, peak_phase=best_phase)


def _replay_cpu(events: Iterable[tuple]) -> Replay:
    live: dict[int, tuple[int, str]] = {}
    by_tag: dict[str, int] = {}
    best_tags: dict[str, int] = {}
    phase = best_phase = ""
    allocated = peak = 0
    for ev in events:
        kind = ev[0]
        if kind == "alloc":
            size = -(-ev[2] // CPU_ALIGNMENT) * CPU_ALIGNMENT
            live[ev[1]] = (size, ev[3])
            by_tag[ev[3]] = by_tag.get(ev[3], 0) + size
            allocated += size
            if allocated > peak:
                peak, best_tags, best_phase = allocated, dict(by_tag), phase
        elif kind == "free":
            size, tag = live.pop(ev[1])
            by_tag[tag] -= size
            allocated -= size
        elif kind == "retag":
            size, old = live[ev[1]]
            live[ev[1]] = (size, ev[2])
            by_tag[old] -= size
            by_tag[ev[2]] = by_tag.get(ev[2], 0) + size
        elif kind == "phase":
            phase = ev[1]
        elif kind == "reset_peaks":
            peak, best_tags, best_phase = allocated, dict(by_tag), phase
    return Replay(peak_allocated=peak, peak_reserved=peak, peak_reserved_expandable=peak,
                  peak_tags={k: v for k, v in best_tags.items() if v}, peak_phase=best_phase)
