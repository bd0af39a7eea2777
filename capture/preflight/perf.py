"""What the card does, measured: bf16 GEMM, device copy, pinned host<->device, peer copies.

Each figure is timed over enough repetitions to run well past launch overhead (the GEMM for
about a second in ``--quick``), on the device's own clock (CUDA events), after a warm-up, and
checked for correctness as well as speed: a GEMM that returns wrong numbers fails however fast
it is. On a CPU the same figures are fp32 GEMM and memory copy bandwidth.

Counting conventions (as the H200 reference readings were taken):
- GEMM: 2·N³ floating-point operations per N×N×N product, timed sustained (about a second in
  ``--quick``, six in ``--full``): a dense bf16 GEMM on random data takes an H200 to its 700 W
  limit within tens of milliseconds, and the SM clock then settles near 1,450 of 1,980 MHz, so
  the sustained figure (about 660 TFLOP/s there) is what training sees, while a 10-product burst
  (the reference readings' 776-798 TFLOP/s) is not; the burst is reported alongside;
- device copy: bytes read plus bytes written (2 × the buffer) per copy;
- host<->device and peer copies: the buffer's bytes per copy, one direction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Figure:
    """One measured figure; ``error`` set when it could not be measured or came out wrong."""

    name: str
    value: float | None
    unit: str
    device: int | None = None
    iterations: int = 0
    seconds: float = 0.0
    detail: str = ""
    error: str | None = None
    wrong: bool = False
    """The operation ran but gave wrong results (a failing card, not a missing figure)."""
    burst_value: float | None = None
    """The GEMM's first few products only, before the card reaches its power limit."""


@dataclass(frozen=True)
class Sizes:
    gemm_n: int
    copy_bytes: int
    host_bytes: int
    target_s: float
    """Timed seconds per figure (the GEMM gets ``gemm_s``)."""
    gemm_s: float
    allreduce_bytes: int
    allreduce_iters: int


GPU_SIZES = {
    "quick": Sizes(gemm_n=8192, copy_bytes=2 * 2**30, host_bytes=2**30, target_s=0.25, gemm_s=1.0,
                   allreduce_bytes=256 * 2**20, allreduce_iters=10),
    "full": Sizes(gemm_n=8192, copy_bytes=4 * 2**30, host_bytes=2 * 2**30, target_s=1.5, gemm_s=6.0,
                  allreduce_bytes=2**30, allreduce_iters=30),
}
CPU_SIZES = {
    "quick": Sizes(gemm_n=1024, copy_bytes=128 * 2**20, host_bytes=0, target_s=0.3, gemm_s=0.5,
                   allreduce_bytes=8 * 2**20, allreduce_iters=5),
    "full": Sizes(gemm_n=2048, copy_bytes=512 * 2**20, host_bytes=0, target_s=1.5, gemm_s=3.0,
                  allreduce_bytes=64 * 2**20, allreduce_iters=20),
}


class Timer:
    """Runs ``fn`` repeatedly and returns seconds per call on the device's own clock."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch, self.device = torch, device
        self.gpu = device.type == "cuda"

    def sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize(self.device)

    def burst_s(self, fn: Callable[[], Any], n: int = 10) -> float:
        """Seconds per call over ``n`` calls right after a pause (boost clocks, below the power limit)."""
        fn()
        self.sync()
        time.sleep(0.05)
        if not self.gpu:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n
        return self._events_s(fn, n)

    def _events_s(self, fn: Callable[[], Any], n: int, during: Callable[[float], None] | None = None,
                  expected_s: float = 0.0) -> float:
        """Seconds per call over ``n`` calls, timed by the device's events; ``during`` is called
        while they run, with ``expected_s``, how long they should take."""
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        if during is not None:
            during(expected_s)
        end.synchronize()
        return start.elapsed_time(end) / 1000 / n

    def per_call_s(self, fn: Callable[[], Any], target_s: float, during: Callable[[float], None] | None = None,
                   max_iters: int = 100_000) -> tuple[float, int]:
        for _ in range(2):
            fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        self.sync()
        estimate = max((time.perf_counter() - t0) / 3, 1e-7)
        n = max(5, min(max_iters, math.ceil(target_s / estimate)))
        if self.gpu:
            return self._events_s(fn, n, during, n * estimate), n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n, n


def gemm(torch: Any, device: Any, sizes: Sizes, during: Callable[[float], None] | None = None) -> Figure:
    """bf16 (CPU: fp32) N×N×N matrix product: TFLOP/s, and the product checked against fp32."""
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    n = sizes.gemm_n
    name = "gemm_bf16" if gpu else "gemm_fp32"
    idx = device.index if gpu else None
    try:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        c = torch.empty(n, n, device=device, dtype=dtype)
        timer = Timer(torch, device)
        product = lambda: torch.matmul(a, b, out=c)
        burst = timer.burst_s(product) if gpu else None
        t, iters = timer.per_call_s(product, sizes.gemm_s, during)
        rows = min(128, n)
        ref = a[:rows].float() @ b.float()
        err = (c[:rows].float() - ref).abs().max().item() / max(ref.std().item(), 1e-30)
    except RuntimeError as exc:
        return Figure(name, None, "TFLOP/s", idx, error=_one_line(exc))
    finally:
        a = b = c = None
    flop = 2 * n**3
    detail = f"{'bf16' if gpu else 'fp32'} {n}x{n}x{n} sustained: {iters} products in {t * iters:.2f} s"
    if burst:
        detail += f" (the first 10 alone: {flop / burst / 1e12:.0f} TFLOP/s)"
    wrong = not err < (0.05 if gpu else 1e-3)
    return Figure(name, flop / t / 1e12, "TFLOP/s", idx, iters, t * iters, detail,
                  error=f"the product is wrong: max error {err:.3g} x the result's spread" if wrong else None, wrong=wrong,
                  burst_value=flop / burst / 1e12 if burst else None)


def device_copy(torch: Any, device: Any, sizes: Sizes) -> Figure:
    """Copy one device buffer to another: GB/s counting read and write."""
    gpu = device.type == "cuda"
    name = "copy_d2d" if gpu else "memory_copy"
    idx = device.index if gpu else None
    nbytes = sizes.copy_bytes
    try:
        x = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0x5A)
        x[-1] = 0xA5
        y = torch.empty_like(x)
        t, iters = Timer(torch, device).per_call_s(lambda: y.copy_(x), sizes.target_s)
        ok = bool(torch.equal(y[:2**20], x[:2**20])) and int(y[-1].item()) == 0xA5
    except RuntimeError as exc:
        return Figure(name, None, "GB/s", idx, error=_one_line(exc))
    finally:
        x = y = None
    detail = f"{nbytes / 2**30:.2f} GiB buffer, {iters} copies; read + write counted"
    return Figure(name, 2 * nbytes / t / 1e9, "GB/s", idx, iters, t * iters, detail,
                  error=None if ok else "the copy does not match its source", wrong=not ok)


def host_copies(torch: Any, device: Any, sizes: Sizes) -> list[Figure]:
    """Pinned host -> device and device -> host: GB/s, one direction each."""
    idx = device.index
    nbytes = sizes.host_bytes
    try:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(0x3C)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    except RuntimeError as exc:
        return [Figure(n, None, "GB/s", idx, error=_one_line(exc)) for n in ("h2d_pinned", "d2h_pinned")]
    out = []
    timer = Timer(torch, device)
    try:
        for name, fn in (("h2d_pinned", lambda: dev.copy_(host, non_blocking=True)),
                         ("d2h_pinned", lambda: host.copy_(dev, non_blocking=True))):
            try:
                t, iters = timer.per_call_s(fn, sizes.target_s)
            except RuntimeError as exc:
                out.append(Figure(name, None, "GB/s", idx, error=_one_line(exc)))
                continue
            ok = int(host[12345].item()) == 0x3C and int(dev[12345].item()) == 0x3C
            out.append(Figure(name, nbytes / t / 1e9, "GB/s", idx, iters, t * iters,
                              f"{nbytes / 2**30:.2f} GiB pinned buffer, {iters} copies",
                              error=None if ok else "the copy does not match its source", wrong=not ok))
    finally:
        host = dev = None
    return out


def peer_pairs(count: int, all_pairs: bool = False) -> list[tuple[int, int]]:
    """The ring 0->1->...->n-1->0 (both directions of the one pair when n = 2), or every ordered pair."""
    if count < 2:
        return []
    if all_pairs:
        return [(i, j) for i in range(count) for j in range(count) if i != j]
    return [(0, 1), (1, 0)] if count == 2 else [(i, (i + 1) % count) for i in range(count)]


def peer_copies(torch: Any, count: int, sizes: Sizes, all_pairs: bool = False) -> list[tuple[Figure, bool]]:
    """Device i -> device j copies, GB/s one direction, with whether peer access is possible.

    ``--quick`` measures the ring 0->1->...->n-1->0 (each device sends once); ``--full`` every
    ordered pair.
    """
    out = []
    pairs = peer_pairs(count, all_pairs)
    nbytes = min(sizes.host_bytes, 2**30)
    for i, j in pairs:
        src_dev, dst_dev = torch.device("cuda", i), torch.device("cuda", j)
        peer = bool(torch.cuda.can_device_access_peer(i, j))
        try:
            src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev).fill_(0x69)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
            for _ in range(2):
                dst.copy_(src)
            torch.cuda.synchronize(src_dev)
            torch.cuda.synchronize(dst_dev)
            n = 0
            t0 = time.perf_counter()
            while True:
                for _ in range(5):
                    dst.copy_(src)
                n += 5
                torch.cuda.synchronize(src_dev)
                torch.cuda.synchronize(dst_dev)
                if time.perf_counter() - t0 >= sizes.target_s or n >= 1000:
                    break
            t = (time.perf_counter() - t0) / n
            ok = int(dst[777].item()) == 0x69
            fig = Figure("p2p", nbytes / t / 1e9, "GB/s", i, n, t * n,
                         f"cuda:{i} -> cuda:{j}, {nbytes / 2**30:.2f} GiB, {n} copies" + ("" if peer else ", no peer access (through the host)"),
                         error=None if ok else "the copy does not match its source", wrong=not ok)
        except RuntimeError as exc:
            fig = Figure("p2p", None, "GB/s", i, detail=f"cuda:{i} -> cuda:{j}", error=_one_line(exc))
        finally:
            src = dst = None
        out.append((fig, peer))
    return out


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
