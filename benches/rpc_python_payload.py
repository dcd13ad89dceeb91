#!/usr/bin/env python3
"""rdzv.rpc payloads from Python: echo of numpy arrays and bytes, GB/s.

For each transport pair as benches/rpc_python.py configures them (tcp: the `uv`
transport with the `basic` channel, so every byte travels inline in the pipe's frames;
shm: the `shm` transport with the `cma` channel), two processes on this host init
rdzv.rpc, and worker 0 echoes (`rpc_sync` returning its argument) a numpy `uint8` array
and a `bytes` object of 1 KiB, 1 MiB and 64 MiB, checking the first echo of each byte for
byte. It prints, per pair, kind and size, the median over the iterations of one echo's
GB/s, both directions counted (2 * size / time), and the median time.

Usage: benches/rpc_python_payload.py [--pairs tcp,shm] [--iters 200] [--big-iters 10]
       [--json results.jsonl]
`--iters` echoes per size below 64 MiB, `--big-iters` of 64 MiB. Needs numpy and the rdzv
package (`maturin develop --release` for figures worth quoting); no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The same transport pairs and port choice as the rdzv-against-torch bench.
from rpc_python import PAIRS, free_port  # noqa: E402
SIZES = [("1KiB", 1 << 10), ("1MiB", 1 << 20), ("64MiB", 64 << 20)]


def echo(x: Any) -> Any:
    return x


def _payload(kind: str, size: int) -> Any:
    import numpy

    array = numpy.arange(size, dtype=numpy.uint32).astype(numpy.uint8)
    return array if kind == "numpy" else array.tobytes()


def _same(kind: str, sent: Any, back: Any) -> bool:
    import numpy

    if kind == "numpy":
        return isinstance(back, numpy.ndarray) and numpy.array_equal(sent, back)
    return type(back) is bytes and back == sent


def measure(rpc: Any, iters: int, big_iters: int) -> List[Dict[str, Any]]:
    peer = "w1"
    for _ in range(50):
        rpc.rpc_sync(peer, echo, args=(b"x",))
    rows = []
    for kind in ("numpy", "bytes"):
        for label, size in SIZES:
            value = _payload(kind, size)
            back = rpc.rpc_sync(peer, echo, args=(value,))
            if not _same(kind, value, back):
                raise AssertionError(f"the {label} {kind} echo came back different")
            del back
            n = big_iters if size >= 64 << 20 else iters
            times = []
            for _ in range(n):
                t = time.perf_counter()
                rpc.rpc_sync(peer, echo, args=(value,))
                times.append(time.perf_counter() - t)
            median = statistics.median(times)
            rows.append({
                "kind": kind,
                "size": label,
                "iters": n,
                "median_ms": median * 1e3,
                "GBps": 2 * size / median / 1e9,
            })
    return rows


def worker(rank: int, port: int, pair: str, iters: int, big_iters: int) -> None:
    import rdzv.rpc as rpc

    transports, channels = PAIRS[pair]
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        num_worker_threads=16,
        rpc_timeout=300,
        _transports=transports,
        _channels=channels,
    )
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        for row in measure(rpc, iters, big_iters):
            print("RESULT " + json.dumps(row), flush=True)
    rpc.shutdown()


def run_pair(pair: str, iters: int, big_iters: int) -> List[Dict[str, Any]]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "worker", "--pair-one", pair,
           "--port", str(port), "--iters", str(iters), "--big-iters", str(big_iters)]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
             for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=1800)
        procs[1].wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    rows = [{"pair": pair, **json.loads(line[7:])}
            for line in out.splitlines() if line.startswith("RESULT ")]
    if not rows:
        raise RuntimeError(f"{pair}: no result (exit {procs[0].returncode}); output:\n{out}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="tcp,shm")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--big-iters", type=int, default=10)
    parser.add_argument("--json", help="append one JSON object per row to this file")
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--pair-one", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "worker":
        worker(args.rank, args.port, args.pair_one, args.iters, args.big_iters)
        return 0
    print(f"{'pair':<5} {'kind':<6} {'size':>6} {'iters':>6} {'median ms':>10} {'GB/s':>8}")
    for pair in args.pairs.split(","):
        for row in run_pair(pair, args.iters, args.big_iters):
            print(f"{row['pair']:<5} {row['kind']:<6} {row['size']:>6} {row['iters']:>6} "
                  f"{row['median_ms']:>10.3f} {row['GBps']:>8.3f}", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
