#!/usr/bin/env python3
"""rdzv.rpc against torch.distributed.rpc (TensorPipe), Python to Python, in one run.

For each implementation and each comparable transport pair (tcp: torch's `uv` with the
`basic` channel; shm: the `shm` transport with the `cma` channel), two processes on this
host init RPC with the same program, and worker 0 measures:
- a noop `rpc_sync`: p50 and p99;
- a 64 MiB CPU torch tensor echo (`rpc_sync` returning its argument), after four
  untimed ones: GB/s, both directions counted;
- `remote` + `to_here`: p50;
- `rpc_async` with 64 calls in flight: calls per second;
- the voluntary context switches of both processes (every thread, from
  `/proc/<pid>/task/*/status`) per noop `rpc_sync`: each is a thread that went to sleep
  and had to be woken, a count that repeats from run to run where times move with the load
  (preemptions, which do move with it, are left out).

Usage: benches/rpc_python.py [--impls rdzv,torch] [--pairs tcp,shm] [--iters 2000]
       [--json results.jsonl]
Needs torch (the tensors are torch tensors for both) and the rdzv package (`pip install .`).
The implementations and pairs run interleaved, one pair of processes each, so that their
ratios come from one run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List

PAIRS = {"tcp": (["uv"], ["basic"]), "shm": (["shm"], ["cma"])}
BIG = 64 << 20


def noop() -> None:
    return None


def echo(x: Any) -> Any:
    return x


def _rpc(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.rpc as rpc
    else:
        import rdzv.rpc as rpc  # type: ignore[no-redef]
    return rpc


def _percentile(samples: List[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def context_switches(pid: int) -> int:
    """Voluntary context switches (sleeps) of every thread of process ``pid``."""
    total = 0
    for status in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            with open(status) as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        total += int(line.split()[1])
        except OSError:  # a thread that ended meanwhile
            pass
    return total


def measure(rpc: Any, iters: int) -> Dict[str, float]:
    import torch

    peer = "w1"
    peer_pid = rpc.rpc_sync(peer, os.getpid)
    for _ in range(100):
        rpc.rpc_sync(peer, noop)
    lat = []
    before = context_switches(os.getpid()) + context_switches(peer_pid)
    for _ in range(iters):
        t = time.perf_counter()
        rpc.rpc_sync(peer, noop)
        lat.append(time.perf_counter() - t)
    switches = context_switches(os.getpid()) + context_switches(peer_pid) - before
    out = {
        "noop_p50_us": _percentile(lat, 0.5) * 1e6,
        "noop_p99_us": _percentile(lat, 0.99) * 1e6,
        "noop_sleeps": switches / iters,
    }

    tensor = torch.ones(BIG, dtype=torch.uint8)
    back = rpc.rpc_sync(peer, echo, args=(tensor,))
    if not torch.equal(back, tensor):
        raise AssertionError("the 64 MiB echo came back different")
    # Steady state, for both implementations: the checked echo is let go, and three more
    # untimed echoes map the memory both sides receive into (rdzv keeps large receive
    # buffers for the next receive; fresh 64 MiB costs 16,384 page faults).
    del back
    for _ in range(3):
        rpc.rpc_sync(peer, echo, args=(tensor,))
    big_iters = 20
    t = time.perf_counter()
    for _ in range(big_iters):
        rpc.rpc_sync(peer, echo, args=(tensor,))
    elapsed = time.perf_counter() - t
    out["echo_64MiB_GBps"] = 2 * BIG * big_iters / elapsed / 1e9

    remote_lat = []
    for _ in range(max(50, iters // 4)):
        t = time.perf_counter()
        rpc.remote(peer, noop).to_here()
        remote_lat.append(time.perf_counter() - t)
    out["remote_to_here_p50_us"] = _percentile(remote_lat, 0.5) * 1e6

    calls = 0
    t = time.perf_counter()
    while time.perf_counter() - t < 2.0:
        futures = [rpc.rpc_async(peer, noop) for _ in range(64)]
        for f in futures:
            f.wait()
        calls += 64
    out["async64_calls_per_s"] = calls / (time.perf_counter() - t)
    return out


def worker(impl: str, rank: int, port: int, pair: str, iters: int) -> None:
    rpc = _rpc(impl)
    transports, channels = PAIRS[pair]
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}",
        num_worker_threads=16,
        rpc_timeout=120,
        _transports=transports,
        _channels=channels,
    )
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        result = measure(rpc, iters)
        print("RESULT " + json.dumps(result), flush=True)
    rpc.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(impl: str, pair: str, iters: int) -> Dict[str, Any]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "worker", "--impl-one", impl,
           "--pair-one", pair, "--port", str(port), "--iters", str(iters)]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
             for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=600)
        procs[1].wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return {"impl": impl, "pair": pair, **json.loads(line[7:])}
    raise RuntimeError(f"{impl}/{pair}: no result (exit {procs[0].returncode}); output:\n{out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="rdzv,torch")
    parser.add_argument("--pairs", default="tcp,shm")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--json", help="append one JSON object per row to this file")
    parser.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    parser.add_argument("--impl-one", help=argparse.SUPPRESS)
    parser.add_argument("--pair-one", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "worker":
        worker(args.impl_one, args.rank, args.port, args.pair_one, args.iters)
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        print("benches/rpc_python.py needs torch (pip install torch numpy): not installed here")
        return 2
    rows = []
    for pair in args.pairs.split(","):
        for impl in args.impls.split(","):
            row = run_pair(impl, pair, args.iters)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    keys = ["noop_p50_us", "noop_p99_us", "noop_sleeps", "echo_64MiB_GBps",
            "remote_to_here_p50_us", "async64_calls_per_s"]
    print("\n| pair | impl | " + " | ".join(keys) + " |")
    print("|---|---|" + "---:|" * len(keys))
    for row in rows:
        print(f"| {row['pair']} | {row['impl']} | " + " | ".join(f"{row[k]:,.1f}" for k in keys) + " |")
    by = {(r["pair"], r["impl"]): r for r in rows}
    for pair in args.pairs.split(","):
        a, b = by.get((pair, "rdzv")), by.get((pair, "torch"))
        if a and b:
            print(f"| {pair} | rdzv/torch | " + " | ".join(
                f"{a[k] / b[k]:.2f}×" if b[k] else "-" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
