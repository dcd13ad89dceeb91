#!/usr/bin/env python3
"""How long an elastic round takes to form on etcd right after its leader is killed.

Each run starts a fresh three-member etcd cluster on loopback (`.ci/etcd-cluster.sh`),
lets three `rdzv rendezvous` nodes form a round (the warm-up: every connection is open),
SIGKILLs the member that leads, and at once starts three fresh nodes of a new run. The
figure is the time from the kill to the last of the three printing its round, beside
etcd's own failover (the time until a surviving member reports a new leader, polled with
`etcdctl endpoint status`) and the same round without a kill, measured first on the same
cluster, as the floor.

Usage: benches/etcd_failover.py [--rdzv target/release/rdzv] [--runs 3] [--base-port 24790]
Needs etcd and etcdctl on PATH (Debian: apt-get install etcd-server etcd-client).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / ".ci" / "etcd-cluster.sh"


def statuses(endpoints: str) -> list[dict]:
    """`etcdctl endpoint status` of each member, as JSON."""
    out = subprocess.run(
        ["etcdctl", f"--endpoints={endpoints}", "endpoint", "status", "-w", "json"],
        env={**os.environ, "ETCDCTL_API": "3"},
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    ).stdout
    return json.loads(out)


def leader(endpoints: str) -> tuple[str, int]:
    """The client endpoint and member id of the member that leads."""
    for member in statuses(endpoints):
        status = member["Status"]
        if status["header"]["member_id"] == status["leader"]:
            return member["Endpoint"], status["leader"]
    raise RuntimeError(f"no member leads {endpoints}")


def watch_election(survivors: str, old: int, since: float, result: list[float]) -> None:
    """Polls the survivors until one reports a leader other than `old`; appends the
    seconds from `since` (etcd's own time to fail over, for comparison)."""
    while time.monotonic() - since < 60:
        try:
            leaders = {m["Status"]["leader"] for m in statuses(survivors)}
        except (subprocess.SubprocessError, ValueError, KeyError):
            leaders = set()
        if leaders and old not in leaders and 0 not in leaders:
            result.append(time.monotonic() - since)
            return
        time.sleep(0.05)


def round_of(rdzv: str, endpoints: str, run: str, n: int, timeout: float) -> float:
    """Starts `n` nodes of `run`, waits until each printed its first round, and returns
    the monotonic time at which the last one did (before the nodes are stopped)."""
    url = f"etcd://{endpoints}/{run}?nodes={n}&last_call=100ms&read_timeout=30s"
    started = time.monotonic()
    nodes = [
        subprocess.Popen(
            [rdzv, "rendezvous", url, "--node-id", f"{run}-{i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(n)
    ]
    try:
        for node in nodes:
            assert node.stdout is not None
            for line in node.stdout:
                if line.startswith("round "):
                    break
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"no round of {run} in {timeout} s")
            else:
                raise RuntimeError(f"a node of {run} exited before its round (exit {node.wait()})")
        return time.monotonic()
    finally:
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(timeout=35)
            except subprocess.TimeoutExpired:
                node.kill()


def one_run(rdzv: str, base_port: int, index: int) -> tuple[float, float, float]:
    work = Path(tempfile.mkdtemp(prefix="rdzv-etcd-failover-"))
    env = {**os.environ, "ETCD_CLUSTER_BASE_PORT": str(base_port)}
    endpoints = subprocess.run(
        ["bash", str(CLUSTER), "start", str(work)], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        started = time.monotonic()
        quiet = round_of(rdzv, endpoints, f"quiet{index}", 3, 60) - started
        victim, victim_id = leader(endpoints)
        member = endpoints.split(",").index(victim)
        pid = int((work / f"e{member}.pid").read_text())
        survivors = ",".join(e for e in endpoints.split(",") if e != victim)
        elected: list[float] = []
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        poller = threading.Thread(target=watch_election, args=(survivors, victim_id, killed, elected))
        poller.start()
        after = round_of(rdzv, endpoints, f"after{index}", 3, 90) - killed
        poller.join()
        return quiet, after, elected[0] if elected else float("nan")
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(work)], env=env, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rdzv", default=str(ROOT / "target" / "release" / "rdzv"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--base-port", type=int, default=24790)
    args = parser.parse_args()
    for tool in ("etcd", "etcdctl"):
        if shutil.which(tool) is None:
            print(f"{tool} is not on PATH (Debian: apt-get install etcd-server etcd-client)")
            return 2
    if not Path(args.rdzv).exists():
        print(f"no rdzv binary at {args.rdzv}: cargo build --release, or pass --rdzv")
        return 2
    print("run  round of 3, no kill (s)  after a leader kill: new leader (s)  round of 3 (s)")
    for i in range(args.runs):
        quiet, after, elected = one_run(args.rdzv, args.base_port, i)
        print(f"{i:>3}  {quiet:>24.2f}  {elected:>35.2f}  {after:>14.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
