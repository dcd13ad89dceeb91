"""torchrun --rdzv-backend=rdzv, end to end (local only: these need torch, and skip
with the reason when it is missing; CI does not install torch).

Each node is a torchrun process on this host; the first hosts the rdzv server (the
endpoint is local), the others are its clients. Workers run a gloo all_reduce and write
one JSON record each.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: the torchrun tests need it (pip install torch)"
)

WORKER = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
# FAIL_ONCE names a file the test creates: the round that sees it fails (rank 1 dies and
# deletes it; the others fail in their next collective, as a real job's would).
mark = os.environ.get("FAIL_ONCE", "")
failing = bool(mark) and os.path.exists(mark)
t = torch.ones(1)
dist.all_reduce(t)
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
record = dict(rank=rank, world=world, sum=int(t.item()), restart=restart,
              group_rank=int(os.environ["GROUP_RANK"]), node=os.environ["NODE_NAME"],
              local_rank=int(os.environ["LOCAL_RANK"]), failing=failing)
if os.environ.get("CHECK_AGENT_STORE"):
    # MASTER_ADDR/PORT must be rank 0's agent's store: the agents' round keys are there.
    import rdzv
    keys = rdzv.Store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      timeout=30).list_keys()
    record["agent_store"] = any(k.startswith("torch.rendezvous.") for k in keys)
    record["use_agent_store"] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    record["master"] = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
out = os.environ["OUT_DIR"]
with open(os.path.join(out, f"{record['node']}-{restart}-{rank}-{time.time_ns()}.json"), "w") as f:
    json.dump(record, f)
if failing:
    if rank == 1:
        os.remove(mark)
        sys.exit(3)
    dist.all_reduce(t)
target = int(os.environ.get("TARGET_WORLD", "0"))
if target and world != target:
    time.sleep(300)
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    def __init__(self, tmp: Path, nnodes: str, endpoint: str = "", **env: str) -> None:
        self.port = free_port()
        # An rdzv store server on this host (the first node hosts it), or etcd://...
        self.endpoint = endpoint or f"127.0.0.1:{self.port}"
        self.run_id = f"pytest-job-{os.getpid()}-{time.time_ns()}" if endpoint else "pytest-job"
        self.tmp = tmp
        self.nnodes = nnodes
        self.out = tmp / "out"
        self.out.mkdir()
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER)
        self.env = env
        self.nodes: List[subprocess.Popen] = []

    def start_node(self, name: str, max_restarts: int = 0) -> subprocess.Popen:
        env = {**os.environ, "OUT_DIR": str(self.out), "NODE_NAME": name, **self.env}
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}", "--nproc-per-node=2",
            "--rdzv-backend=rdzv", f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}", f"--max-restarts={max_restarts}",
            "--rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,"
            "join_timeout=120,close_timeout=5",
            "--monitor-interval=0.5", str(self.script),
        ]
        log = open(self.tmp / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.nodes.append(proc)
        return proc

    def wait_hosted(self, timeout: float = 60) -> None:
        """Waits until a node hosts the store server on this host's endpoint."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"no node hosts the store on port {self.port}\n{self.logs()}")

    def records(self) -> List[Dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("*.json"))]

    def wait_records(self, predicate, timeout: float = 180) -> List[Dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = self.records()
            if predicate(recs):
                return recs
            time.sleep(0.5)
        raise AssertionError(f"timed out; records: {self.records()}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text()[-3000:] for p in self.tmp.glob("*.log"))

    def wait_all(self, timeout: float = 180) -> None:
        for proc in self.nodes:
            rc = proc.wait(timeout=timeout)
            assert rc == 0, f"torchrun exited {rc}\n{self.logs()}"

    def kill(self, proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def close(self) -> None:
        for proc in self.nodes:
            if proc.poll() is None:
                self.kill(proc)


@pytest.fixture
def job_factory(tmp_path: Path):
    jobs: List[Job] = []

    def make(nnodes: str, endpoint: str = "", **env: str) -> Job:
        folder = tmp_path / f"job{len(jobs)}"
        folder.mkdir()
        job = Job(folder, nnodes, endpoint, **env)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()


def two_nodes_all_reduce(job: Job) -> List[Dict]:
    """Nodes a and b of ``job`` (2 workers each) run to the end: every worker's record,
    checked to be ranks 0-3 of one world of 4 whose all_reduce summed to 4."""
    job.start_node("a")
    job.start_node("b")
    job.wait_all()
    recs = job.records()
    assert sorted(r["rank"] for r in recs) == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["sum"] == 4 for r in recs)
    return recs


def one_worker_fails_once(job: Job, max_restarts: int) -> List[Dict]:
    """Nodes a and b of ``job``, one of whose workers fails once: the records of the
    restarted round, checked to be ranks 0-3 summing to 4 after exactly one restart."""
    mark = job.tmp / "fail-once"
    mark.write_text("")
    job.env["FAIL_ONCE"] = str(mark)
    job.start_node("a", max_restarts=max_restarts)
    job.start_node("b", max_restarts=max_restarts)
    job.wait_all()
    recs = job.records()
    assert any(r["failing"] for r in recs)
    second = [r for r in recs if not r["failing"]]
    assert sorted(r["rank"] for r in second) == [0, 1, 2, 3]
    # The node whose worker failed used one of its restarts.
    assert max(r["restart"] for r in second) == 1
    assert all(r["sum"] == 4 for r in second)
    return second


def test_two_nodes_two_workers_gloo_all_reduce(job_factory) -> None:
    two_nodes_all_reduce(job_factory("2"))


def test_worker_failure_restarts_with_max_restarts(job_factory) -> None:
    one_worker_fails_once(job_factory("2"), max_restarts=2)


def test_late_third_node_scales_up_and_ranks_stay(job_factory) -> None:
    job = job_factory("2:3", TARGET_WORLD="6")
    job.start_node("a")
    job.start_node("b")
    first = job.wait_records(lambda rs: len(rs) >= 4)
    job.start_node("c")
    job.wait_all()
    last = [r for r in job.records() if r["world"] == 6]
    assert sorted(r["rank"] for r in last) == list(range(6))
    assert all(r["sum"] == 6 for r in last)
    # Ranks stable: the two first nodes keep their group ranks.
    before = {r["node"]: r["group_rank"] for r in first}
    after = {r["node"]: r["group_rank"] for r in last}
    assert before["a"] == after["a"] and before["b"] == after["b"], (before, after)


def test_node_killed_scales_down(job_factory) -> None:
    job = job_factory("2:3", TARGET_WORLD="4")
    job.start_node("a")
    # a hosts the store (the first node to bind its endpoint does): the victim must not,
    # or the survivors lose their store with it.
    job.wait_hosted()
    job.start_node("b")
    victim = job.start_node("c")
    job.wait_records(lambda rs: any(r["world"] == 6 for r in rs))
    job.kill(victim)
    job.nodes.remove(victim)
    job.wait_all(timeout=240)
    last = [r for r in job.records() if r["world"] == 4]
    assert sorted(r["rank"] for r in last) == [0, 1, 2, 3]
    assert {r["node"] for r in last} == {"a", "b"}


def handler_params(port: int, run_id: str, node: str, **conf: object):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(
        backend="rdzv",
        endpoint=f"127.0.0.1:{port}",
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        is_host=False,
        node_id=node,
        last_call_timeout=1,
        **conf,
    )


def test_handler_connects_torchs_client_when_created_not_in_next_rendezvous(
    server, monkeypatch
) -> None:
    # torch's TCPStore client resolves the server's address back to a name as it
    # connects; connecting in next_rendezvous put that lookup (5 s when a busy resolver
    # drops it) inside every agent's round. As c10d's creator, the handler connects when
    # torchrun creates it.
    import torch.distributed as dist

    from rdzv import torchrun

    made: List[str] = []
    real = dist.TCPStore

    def recording(*args, **kwargs):
        made.append(phase)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", recording)
    phase = "create"
    handler = torchrun.create_handler(handler_params(server.port, "early", "n0"))
    phase = "next_rendezvous"
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        # Rank 0's address and a free port came with the round (no MASTER_ADDR and
        # MASTER_PORT keys, as torch's RendezvousStoreInfo.build would write).
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert 0 < info.bootstrap_store_info.master_port < 65536
        assert not info.store.check(["MASTER_ADDR"])
        info.store.set("k", b"v")
        assert info.store.get("k") == b"v"
    finally:
        handler.shutdown()
    assert made == ["create"]


def test_handler_creation_fails_with_a_connection_error_without_a_server() -> None:
    from torch.distributed.elastic.rendezvous import api

    from rdzv import torchrun

    port = free_port()  # nothing listens there
    start = time.monotonic()
    # join_timeout bounds it, not read_timeout (torch's client would retry for 60 s).
    with pytest.raises(api.RendezvousConnectionError, match=f"127.0.0.1:{port}") as raised:
        torchrun.create_handler(
            handler_params(port, "nobody", "n0", read_timeout=60, join_timeout=1.5)
        )
    assert time.monotonic() - start < 3.0
    text = str(raised.value)
    # One line: no class name inside it, no C++ frames, no "..".
    assert "\n" not in text and "Error: " not in text and ".." not in text, text


# --- over etcd: the rendezvous in an etcd cluster, the store on rank 0's agent ----------

ETCD = os.environ.get("RDZV_ETCD_ENDPOINTS", "")
needs_etcd = pytest.mark.skipif(
    not ETCD,
    reason="RDZV_ETCD_ENDPOINTS is not set: no etcd cluster to test against "
    "(start one with .ci/etcd-cluster.sh start DIR and export what it prints)",
)


@needs_etcd
def test_etcd_two_nodes_two_workers_gloo_all_reduce_on_rank_0s_agent_store(job_factory) -> None:
    recs = two_nodes_all_reduce(job_factory("2", f"etcd://{ETCD}", CHECK_AGENT_STORE="1"))
    # Every worker's MASTER_ADDR/PORT is the one store rank 0's agent hosts.
    assert all(r["use_agent_store"] == "True" and r["agent_store"] for r in recs)
    assert len({r["master"] for r in recs}) == 1


@needs_etcd
def test_etcd_worker_failure_restarts_with_max_restarts_1(job_factory) -> None:
    job = job_factory("2", f"etcd://{ETCD}", CHECK_AGENT_STORE="1")
    second = one_worker_fails_once(job, max_restarts=1)
    assert all(r["agent_store"] for r in second)


@needs_etcd
def test_etcd_handler_api_without_torchrun() -> None:
    """One node: the handler's info, MASTER_ADDR/PORT on its own hosted server, closing."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, api

    from rdzv import torchrun

    params = RendezvousParameters(
        backend="rdzv",
        endpoint=f"etcd://{ETCD}",
        run_id=f"pytest-api-{os.getpid()}-{time.time_ns()}",
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        node_id="n0",
        last_call_timeout=0.5,
    )
    handler = torchrun.create_handler(params)
    assert handler.get_backend() == "rdzv"
    assert handler.get_run_id() == params.run_id
    assert handler.use_agent_store
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    boot = info.bootstrap_store_info
    assert boot.master_addr == "127.0.0.1"
    info.store.set("k", b"v")
    prefix = f"torch.rendezvous.{params.run_id}."
    assert any(k.startswith(prefix) for k in rdzv_keys(boot.master_port))
    assert handler.num_nodes_waiting() == 0
    assert not handler.is_closed()
    assert handler.shutdown()
    assert handler.is_closed()
    with pytest.raises(api.RendezvousClosedError):
        handler.next_rendezvous()
    # shutdown stopped the hosted server.
    with pytest.raises(Exception):
        rdzv_keys(boot.master_port, timeout=1)


def rdzv_keys(port: int, timeout: float = 10) -> List[str]:
    import rdzv

    return rdzv.Store("127.0.0.1", port, timeout=timeout).list_keys()
