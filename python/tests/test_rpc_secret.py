"""Peers that prove they belong (issue 34, part 4; docs/rpc-security.md): workers with the
same secret (given, from ``RDZV_RPC_SECRET``, or shared through the store by default)
talk; a wrong secret or none fails the call saying authentication failed; and a raw
socket that sends a pickle to a worker's port is refused with nothing unpickled, while
the worker goes on serving its group. Workers are child processes (``test_rpc``'s
harness)."""

from __future__ import annotations

import json
import os
import pickle
import socket
import tempfile
import time
from typing import Any, Dict, List, Optional

import test_rpc
from test_rpc import add, assert_all_true

SECRET_A = "a-secret-of-at-least-sixteen-bytes"
SECRET_B = "another-secret-sixteen-bytes-long"


def child_main(argv: List[str]) -> None:
    """A worker: ``scenario rank world port [secret]``; ``secret`` is ``-`` for the
    default (shared), ``none`` for no secret, else the secret."""
    scenario, rank, world, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    given = argv[4] if len(argv) > 4 else "-"
    import rdzv.rpc as rpc

    secret: Any = None if given == "-" else False if given == "none" else given
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20, secret=secret
    )
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    seen: Dict[str, Any] = {}
    done = os.environ["RDZV_TEST_DONE"]
    if rank == 0:
        seen = SCENARIOS[scenario](rpc, world)
        open(done, "w").close()
    else:
        # Serve until rank 0 is done (a refused group has no graceful shutdown to wait on).
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.02)
    print(json.dumps({"rank": rank, "result": seen}), flush=True)
    # Not graceful: the graceful protocol itself needs the pipes a wrong secret refuses.
    rpc.shutdown(graceful=scenario == "talk")


def own_address() -> str:
    import rdzv.rpc as rpc

    return rpc._agent().address()


def scenario_talk(rpc: Any, world: int) -> Dict[str, Any]:
    return {
        "call": rpc.rpc_sync("w1", add, args=(2, 3)) == 5,
        "refused": rpc._agent().handshakes_refused() == 0,
    }


def scenario_refused(rpc: Any, world: int) -> Dict[str, Any]:
    try:
        rpc.rpc_sync("w1", add, args=(2, 3))
        return {"refused": "the call went through"}
    except RuntimeError as e:
        text = str(e)
        return {"refused": ("failed authentication" in text and "w1" in text) or text}


def scenario_raw_pickle(rpc: Any, world: int) -> Dict[str, Any]:
    """A stranger connects to w1's RPC port and sends a pickle whose unpickling would
    create a file; w1 must refuse it before unpickling anything, and go on serving."""
    marker = os.environ["RDZV_TEST_MARKER"]
    address = rpc.rpc_sync("w1", own_address)
    seen: Dict[str, Any] = {}
    tcp = [a for a in address.split(";") if a.startswith("tcp://")]
    host, port = tcp[0][len("tcp://"):].rsplit(":", 1)

    class Evil:
        def __reduce__(self) -> Any:
            return (open, (marker, "w"))

    payload = pickle.dumps(Evil())
    for attempt in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            try:
                s.sendall(payload * 4)
                s.settimeout(10)
                while s.recv(4096):
                    pass
            except OSError:
                pass  # reset: closed with our bytes unread
    seen["never_unpickled"] = not os.path.exists(marker) or "the marker file exists"
    seen["still_serves"] = rpc.rpc_sync("w1", add, args=(40, 2)) == 42
    return seen


SCENARIOS = {"talk": scenario_talk, "refused": scenario_refused, "raw_pickle": scenario_raw_pickle}


def run(children: Any, scenario: str, secrets: List[str], env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    port = test_rpc.free_port()
    code = test_rpc.CHILD.format(tests=test_rpc.TESTS, module="test_rpc_secret")
    saved = dict(os.environ)
    os.environ.update(env or {})
    os.environ["RDZV_TEST_DONE"] = os.path.join(tempfile.mkdtemp(), "done")
    try:
        procs = [
            children.spawn(code, scenario, str(rank), str(len(secrets)), str(port), secret)
            for rank, secret in enumerate(secrets)
        ]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    outputs = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"worker {rank} failed:\n{err}"
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    return outputs[0]["result"]


def test_the_same_given_secret_talks(children: Any) -> None:
    assert_all_true(run(children, "talk", [SECRET_A, SECRET_A]))


def test_the_default_shares_a_secret_through_the_store(children: Any) -> None:
    assert_all_true(run(children, "talk", ["-", "-"]))


def test_the_secret_from_the_environment(children: Any) -> None:
    assert_all_true(run(children, "talk", ["-", "-"], {"RDZV_RPC_SECRET": SECRET_B}))


def test_a_wrong_secret_fails_the_call_saying_so(children: Any) -> None:
    assert_all_true(run(children, "refused", [SECRET_A, SECRET_B]))


def test_no_secret_against_a_secret_fails_the_call_saying_so(children: Any) -> None:
    assert_all_true(run(children, "refused", ["none", SECRET_A]))
    assert_all_true(run(children, "refused", [SECRET_A, "none"]))


def test_a_raw_pickle_is_never_unpickled_and_the_worker_serves_on(children: Any, tmp_path: Any) -> None:
    marker = str(tmp_path / "unpickled")
    assert_all_true(run(children, "raw_pickle", ["-", "-"], {"RDZV_TEST_MARKER": marker}))
    time.sleep(0.2)
    assert not os.path.exists(marker)


def test_options_take_and_check_the_secret() -> None:
    import pytest

    from rdzv.rpc import RpcBackendOptions, TensorPipeRpcBackendOptions

    assert RpcBackendOptions(secret="x" * 16).secret == b"x" * 16
    assert TensorPipeRpcBackendOptions(secret=b"y" * 16).secret == b"y" * 16
    assert RpcBackendOptions().secret is None
    assert RpcBackendOptions(secret=False).secret is False
    assert "secret=<16 bytes>" in repr(RpcBackendOptions(secret="x" * 16))
    assert "x" * 16 not in repr(RpcBackendOptions(secret="x" * 16))
    with pytest.raises(TypeError):
        RpcBackendOptions(secret=123)  # type: ignore[arg-type]
