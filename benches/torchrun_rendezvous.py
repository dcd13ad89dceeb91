#!/usr/bin/env python3
"""torchelastic's c10d rendezvous against rdzv's torchrun handler, on one rdzv server.

    python benches/torchrun_rendezvous.py [--nodes 16 64 128] [--rdzv-bin PATH]

Starts one ``rdzv store serve`` on a free port, then for each backend and each N runs N
simulated torchrun agents as threads of this process: each creates the backend's
``RendezvousHandler`` exactly as torchrun does (``--rdzv-backend=c10d`` is torch's
``DynamicRendezvousHandler`` over ``C10dRendezvousBackend``, unchanged;
``--rdzv-backend=rdzv`` is ``rdzv.torchrun.create_handler``) and calls
``next_rendezvous()`` once. It reports the time from the start until every agent has its
round, and the store requests and bytes (in + out) per agent from the server's STATS
query. Threads of one process share one GIL, so times are upper bounds for both.

Needs torch and the rdzv package (``pip install .``); it exits with a message without
them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def totals(stats: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "requests": sum(stats["requests"].values()),
        "bytes": stats["bytes_in"] + stats["bytes_out"],
        "by_op": dict(stats["requests"]),
    }


def per_op(before: Dict[str, Any], after: Dict[str, Any], n: int) -> str:
    """The requests per node by operation, e.g. ``ADD 3.0, WAIT 2.0``."""
    ops = []
    for op, count in sorted(after["by_op"].items()):
        delta = count - before["by_op"].get(op, 0) - (1 if op.upper() == "STATS" else 0)
        if delta > 0:
            ops.append(f"{op} {delta / n:.2f}")
    return ", ".join(ops)


def run_round(n: int, make: Callable[[int], Any]) -> "tuple[float, List[Any]]":
    handlers = [make(i) for i in range(n)]
    errors: List[BaseException] = []
    start = threading.Barrier(n + 1)

    def agent(h: Any) -> None:
        start.wait()
        try:
            h.next_rendezvous()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise RuntimeError(f"{len(errors)} agents failed; first: {errors[0]!r}")
    return elapsed, handlers


def shut_down(handlers: List[Any]) -> None:
    for h in handlers:
        try:
            h.shutdown()
        except Exception:  # noqa: BLE001 - the round is measured already
            pass


def find_rdzv_bin() -> Optional[str]:
    """The rdzv binary: the package's bundled one, else this checkout's
    ``target/release/rdzv``, else ``rdzv`` on ``PATH``; ``None`` when there is none."""
    candidates: List[Path] = []
    try:
        from rdzv import _cli

        candidates.append(_cli.binary())
    except ImportError:
        pass
    candidates.append(Path(__file__).resolve().parent.parent / "target" / "release" / "rdzv")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("rdzv")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--backends", nargs="+", default=["c10d", "rdzv"])
    parser.add_argument("--rdzv-bin", default=None,
                        help="the rdzv binary (default: the package's bundled one, "
                        "else target/release/rdzv, else rdzv on PATH)")
    parser.add_argument("--by-op", action="store_true",
                        help="also print each run's requests per node by operation")
    parser.add_argument("--last-call", type=int, default=1,
                        help="last_call_timeout for both backends, whole seconds (default 1)")
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    except ImportError:
        print("torch is not installed: this benchmark compares torch's own rendezvous "
              "with rdzv's (pip install torch)", file=sys.stderr)
        return 2
    import rdzv
    from rdzv import torchrun

    if not args.rdzv_bin:
        args.rdzv_bin = find_rdzv_bin()
    if not args.rdzv_bin:
        print("no rdzv binary: install the rdzv package, build target/release/rdzv "
              "(cargo build --release) or pass --rdzv-bin", file=sys.stderr)
        return 2
    port = free_port()
    server = subprocess.Popen(
        [args.rdzv_bin, "store", "serve", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    try:
        stats_client = rdzv.Store("127.0.0.1", port, timeout=30)
        print(f"rdzv store serve on 127.0.0.1:{port}; torch {torch.__version__}")
        print()
        print("| backend | N | time to a round (s) | store requests / node | bytes / node |")
        print("|---|---:|---:|---:|---:|")
        breakdown: List[str] = []
        for backend in args.backends:
            for n in args.nodes:
                run_id = f"bench-{backend}-{n}-{uuid.uuid4().hex[:8]}"

                def make(i: int, backend: str = backend, n: int = n, run_id: str = run_id) -> Any:
                    conf: Dict[str, Any] = dict(
                        is_host=False,
                        last_call_timeout=args.last_call,
                        join_timeout=900,
                        read_timeout=120,
                    )
                    if backend == "rdzv":
                        conf["node_id"] = f"agent{i}"
                    params = RendezvousParameters(
                        backend=backend,
                        endpoint=f"127.0.0.1:{port}",
                        run_id=run_id,
                        min_nodes=n,
                        max_nodes=n,
                        local_addr="127.0.0.1",
                        **conf,
                    )
                    if backend == "rdzv":
                        return torchrun.create_handler(params)
                    return get_rendezvous_handler(params)

                before = totals(stats_client.stats())
                elapsed, handlers = run_round(n, make)
                after = totals(stats_client.stats())
                shut_down(handlers)
                requests = (after["requests"] - before["requests"] - 1) / n
                sent = (after["bytes"] - before["bytes"]) / n
                print(f"| {backend} | {n} | {elapsed:.3f} | {requests:.1f} | {sent:,.0f} |",
                      flush=True)
                if args.by_op:
                    breakdown.append(f"{backend} N={n}: {per_op(before, after, n)}")
        if breakdown:
            print()
            print("requests per node by operation (the STATS query itself left out):")
            for line in breakdown:
                print(f"  {line}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
