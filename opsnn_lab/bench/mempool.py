"""``python -m opsnn_lab.bench mempool``: what MemoryPool buys under variable sequence lengths.

Each step draws a sequence length, allocates the workspaces an encoder layer's fused
ops need at that length (B x T x H activations, B x T x 4H MLP buffers, per-head score
tiles), writes them (first touch is where the OS pays for fresh pages) and drops them.
The same length sequence runs with plain ``torch.empty`` and with ``MemoryPool``;
both time ratios and the pool's reuse and fragmentation figures are printed. On CUDA the
pool's private MemPool + expandable segments are compared with the default allocator
by ``1 - allocated/reserved`` at peak.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from opsnn_lab.bench.common import format_table, machine_line, write_json
from opsnn_lab.memory import MemoryPool


def _shapes(batch: int, seq: int, hidden: int, heads: int) -> list[tuple[int, ...]]:
    return [(batch, seq, hidden), (batch, seq, 4 * hidden), (batch, seq, 4 * hidden),
            (batch, heads, seq, seq), (batch, seq, 3 * hidden), (batch, seq, hidden)]


def _workload(alloc, lengths, batch, hidden, heads) -> float:
    t0 = time.perf_counter()
    for seq in lengths:
        bufs = [alloc(s) for s in _shapes(batch, seq, hidden, heads)]
        for b in bufs:
            b.fill_(1.0)
        del bufs
    return time.perf_counter() - t0


def _cuda_fragmentation(lengths, batch, hidden, heads, pooled: bool) -> float:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    alloc = lambda s: torch.empty(s, device="cuda")
    if pooled:
        with MemoryPool("cuda") as pool:
            _workload(alloc, lengths, batch, hidden, heads)
        return pool.stats().fragmentation
    _workload(alloc, lengths, batch, hidden, heads)
    s = torch.cuda.memory_stats()
    return 1 - s["allocated_bytes.all.peak"] / max(s["reserved_bytes.all.peak"], 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsnn_lab.bench mempool", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="CI-sized run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.hidden, args.max_len, args.repeat = 20, 64, 64, 1
    rng = random.Random(0)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.steps)]
    plain_t, pooled_t, pool = [], [], None
    for _ in range(args.repeat):  # interleaved, so machine-load drift hits both alike
        plain_t.append(_workload(lambda s: torch.empty(s), lengths, args.batch, args.hidden, args.heads))
        pool = MemoryPool("cpu")
        with pool:
            pooled_t.append(_workload(pool.empty, lengths, args.batch, args.hidden, args.heads))
    s = pool.stats()
    rows = [{"variant": "torch.empty", "median_s": statistics.median(plain_t), "time_ratio": 1.0},
            {"variant": "MemoryPool", "median_s": statistics.median(pooled_t),
             "time_ratio": statistics.median(pooled_t) / statistics.median(plain_t)}]
    print(machine_line())
    print(format_table(rows))
    print(f"pool: {s.allocations_avoided}/{s.allocations} allocations avoided, "
          f"peak reserved {s.peak_reserved_bytes / 2**20:.1f} MiB, fragmentation at peak {s.fragmentation:.1%}")
    result = {"args": vars(args), "rows": rows, "pool": s.to_dict(),
              "headline": {"cpu time ratio (pool / torch.empty)": round(rows[1]["time_ratio"], 3),
                           "cpu allocations avoided": f"{s.allocations_avoided}/{s.allocations}"}}
    if torch.cuda.is_available():
        base = _cuda_fragmentation(lengths, args.batch, args.hidden, args.heads, pooled=False)
        pooled = _cuda_fragmentation(lengths, args.batch, args.hidden, args.heads, pooled=True)
        print(f"cuda fragmentation at peak: default {base:.1%}, MemoryPool {pooled:.1%}")
        result["cuda"] = {"default_fragmentation": base, "pool_fragmentation": pooled}
        result["headline"]["cuda fragmentation default -> pool"] = f"{base:.1%} -> {pooled:.1%}"
    print(f"wrote {write_json('mempool', result, args.out)}")
    return 0
