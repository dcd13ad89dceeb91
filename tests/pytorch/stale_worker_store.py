#!/usr/bin/env python3
"""Why torchrun's shared worker store breaks `--max-restarts`, without torchrun or rdzv.

    stale_worker_store.py [HOST:PORT]

Since PyTorch 2.4, torchrun's node rank 0 agent creates the workers' TCPStore once and
gives the same one to every attempt (`dynamic_rendezvous.py`, `_shared_tcp_store_server`),
and the workers no longer prefix it by attempt (`rendezvous.py`: "We create a new TCPStore
for every retry so no need to add prefix for each attempt"). This script plays two
attempts of a four-rank gloo job as torchrun's workers would (`env://`,
`TORCHELASTIC_USE_AGENT_STORE=True`):

- attempt 0: ranks 0, 1 and 2 enter `init_process_group` (each sets its gloo address
  under `/default_pg/0//cpu//0/RANK`); rank 3 never comes; they are killed;
- attempt 1: ranks 2 and 3 enter `init_process_group` first, ranks 0 and 1 after them.

once on the same store for both attempts (torchrun's default), and once on a new store
per attempt (what `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives: worker rank 0 hosts a
new one every round). With the same store, ranks 2 and 3 read attempt 0's addresses of
ranks 0 and 1 and gloo fails ("Connection refused"); with a new store all four finish.
The stores are PyTorch's own TCPStore unless HOST:PORT names a server to use for the
shared case (e.g. `rdzv store serve`), which behaves the same. Investigation tooling
for `torchrun.sh`'s restart mode: nothing in CI runs it. Exit status 0 when both
outcomes are as described.
"""
import os
import subprocess
import sys
import time

TIMEOUT_S = 30


def worker():
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    print("init", flush=True)
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        print(f"ok sum={t.item()}", flush=True)
        dist.destroy_process_group()
    except Exception as e:  # report the error on one line for the parent
        print(f"error {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        sys.exit(1)


def spawn(rank, host, port):
    env = dict(os.environ, MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE="4", TORCHELASTIC_USE_AGENT_STORE="True", GLOO_LOG_LEVEL="")
    return subprocess.Popen([sys.executable, __file__, "--worker"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def wait_line(proc, want):
    """Read the worker's lines until one starts with `want`; the last line read."""
    line = ""
    for line in proc.stdout:
        if line.startswith(want):
            break
    return line.strip()


def attempt(store, host, port, ranks_first, ranks_then):
    """Start `ranks_first`, wait until they are in init, start `ranks_then`."""
    procs = {r: spawn(r, host, port) for r in ranks_first}
    for r in ranks_first:
        wait_line(procs[r], "init")
    procs.update({r: spawn(r, host, port) for r in ranks_then})
    return procs


def wait_for_keys(store, ranks):
    deadline = time.monotonic() + 60
    # The TCPStore client adds the leading "/" seen on the wire.
    keys = [f"default_pg/0//cpu//0/{r}" for r in ranks]
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise SystemExit(f"attempt 0: ranks {ranks} set no gloo address within 60 s")
        time.sleep(0.1)


def run(case, store0, addr0, store1, addr1):
    # Attempt 0: ranks 0..2 publish their addresses, then die (rank 3 never came).
    procs = attempt(store0, *addr0, [0, 1, 2], [])
    wait_for_keys(store0, [0, 1, 2])
    for p in procs.values():
        p.kill()
        p.wait()
    # Attempt 1: ranks 2 and 3 are in init before ranks 0 and 1 start.
    procs = attempt(store1, *addr1, [2, 3], [0, 1])
    results = {}
    deadline = time.monotonic() + TIMEOUT_S + 30
    for r in sorted(procs):
        try:
            out, _ = procs[r].communicate(timeout=max(0, deadline - time.monotonic()))
            results[r] = (out.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            procs[r].kill()
            results[r] = "hung"
    ok = all(v.startswith("ok") for v in results.values())
    print(f"{case}: attempt 1 {'finished' if ok else 'failed'}")
    for r, v in sorted(results.items()):
        print(f"   rank {r}: {v}")
    return ok


def main():
    if sys.argv[1:] == ["--worker"]:
        return worker()
    import torch.distributed as dist

    def new_store():
        s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return s, ("127.0.0.1", s.port)

    if len(sys.argv) > 1:
        host, port = sys.argv[1].rsplit(":", 1)
        shared = dist.TCPStore(host, int(port), is_master=False)
        shared_addr = (host, int(port))
    else:
        shared, shared_addr = new_store()
    same = run("one store for both attempts (torchrun's default)", shared, shared_addr,
               shared, shared_addr)
    first, first_addr = new_store()
    second, second_addr = new_store()
    fresh = run("a new store per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)", first,
                first_addr, second, second_addr)
    sys.exit(0 if fresh and not same else 1)


if __name__ == "__main__":
    main()
