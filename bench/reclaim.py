"""Reclaim microbenchmark: a 65,536-page pool with 90% of its pages pinned; how long does taking
one page from the reclaim queue take, and how much memory does the manager's metadata retain?

Compares the page manager with a scan-based reclaimer (least recently used found by a linear
scan) in the same run. Writes JSON and a PNG to bench/out/.

    .venv/bin/python -m bench.reclaim
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from pathlib import Path

from bench.common import machine, save
from shardline.router.core.page_manager import PageManager


def filled_manager(pages: int, pinned_share: float, policy: str) -> tuple[PageManager, int]:
    """Every page indexed; `pinned_share` of them referenced, the rest evictable."""
    m = PageManager(pages, 16, policy=policy, protected_ratio=0.5)
    assert m.admit([], pages, 0)
    held = [m.allocate() for _ in range(pages)]
    for i, page in enumerate(held):
        m.publish(page, m.chain(m.root_hash(), [i]), None)
    pinned = int(pages * pinned_share)
    m.release(held[pinned:])
    return m, pages - pinned


def time_reclaims(m: PageManager, samples: int) -> list[float]:
    """Microseconds per one-page reclaim through the public path (admit 1 page, allocate it)."""
    times = []
    for _ in range(samples):
        assert m.admit([], 1, 0)
        t0 = time.perf_counter_ns()
        m.allocate()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


class ScanReclaimer:
    """The baseline: last-use stamps and a linear scan for the oldest evictable page."""

    def __init__(self, pages: int, pinned_share: float):
        self.ref = [1] * pages
        self.last_use = list(range(pages))
        for p in range(int(pages * pinned_share), pages):
            self.ref[p] = 0

    def reclaim(self) -> int:
        best, stamp = -1, None
        for page, (ref, used) in enumerate(zip(self.ref, self.last_use)):
            if ref == 0 and (stamp is None or used < stamp):
                best, stamp = page, used
        self.ref[best] = 1
        return best


def retained_bytes(pages: int, pinned_share: float, policy: str) -> int:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    m, _ = filled_manager(pages, pinned_share, policy)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del m
    return used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=65536)
    ap.add_argument("--pinned", type=float, default=0.9)
    ap.add_argument("--samples", type=int, default=5000)
    ap.add_argument("--scan-samples", type=int, default=50)
    args = ap.parse_args()

    result = {"benchmark": "reclaim", **machine(), "pages": args.pages, "pinned_share": args.pinned}
    for policy in ("lru", "slru"):
        m, evictable = filled_manager(args.pages, args.pinned, policy)
        times = time_reclaims(m, min(args.samples, evictable))
        m.check()
        result[policy] = {
            "reclaim_us_median": statistics.median(times),
            "reclaim_us_p99": sorted(times)[int(len(times) * 0.99)],
            "samples": len(times),
            "retained_mb": retained_bytes(args.pages, args.pinned, policy) / 2**20,
        }
    scan = ScanReclaimer(args.pages, args.pinned)
    scan_times = []
    for _ in range(args.scan_samples):
        t0 = time.perf_counter_ns()
        scan.reclaim()
        scan_times.append((time.perf_counter_ns() - t0) / 1e3)
    result["scan"] = {"reclaim_us_median": statistics.median(scan_times), "samples": len(scan_times)}
    result["speedup_vs_scan"] = result["scan"]["reclaim_us_median"] / result["lru"]["reclaim_us_median"]

    save("reclaim", result, lambda res, png: plot(res, times, scan_times, png))
    for k in ("lru", "slru"):
        r = result[k]
        print(
            f"{k}: median {r['reclaim_us_median']:.2f} us, p99 {r['reclaim_us_p99']:.2f} us per one-page "
            f"reclaim; metadata {r['retained_mb']:.2f} MB"
        )
    print(
        f"scan baseline: median {result['scan']['reclaim_us_median']:.0f} us ({result['speedup_vs_scan']:.0f}x slower)"
    )


def plot(result, times, scan_times, png: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.boxplot([times, scan_times], showfliers=False)
    ax.set_xticks([1, 2], ["page manager (SLRU)", "linear scan"])
    ax.set_yscale("log")
    ax.set_ylabel("µs per one-page reclaim (log)")
    ax.set_title(f"{result['pages']:,} pages, {result['pinned_share']:.0%} pinned")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
