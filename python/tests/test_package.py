"""The installed package: the rdzv command, the torchrun entry point, lazy torch import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import rdzv
from rdzv import torchrun


def rdzv_command() -> str:
    beside = Path(sys.executable).parent / "rdzv"
    if beside.exists():
        return str(beside)
    found = shutil.which("rdzv")
    if found is None:
        pytest.skip("the rdzv console script is not installed (install the wheel to test it)")
    return found


def test_rdzv_command_runs_the_bundled_binary() -> None:
    out = subprocess.run(
        [rdzv_command(), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert rdzv.__version__ in out.stdout


def test_rdzv_command_talks_to_an_in_process_server(server: rdzv.StoreServer) -> None:
    store = rdzv.Store("127.0.0.1", server.port, timeout=5)
    store.set("from-python", b"hello")
    out = subprocess.run(
        [rdzv_command(), "store", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_bundled_binary_is_executable() -> None:
    from rdzv import _cli

    path = _cli.binary()
    if not path.exists():
        pytest.skip(f"no bundled binary at {path} (built only by maturin with bundle-cli)")
    assert os.access(path, os.X_OK)


def test_torchrun_entry_point_is_registered() -> None:
    eps = metadata.entry_points()
    group = (
        eps.select(group="torchrun.handlers")
        if hasattr(eps, "select")
        else eps.get("torchrun.handlers", [])
    )
    names = {ep.name: ep for ep in group}
    assert "rdzv" in names, sorted(names)
    # torchrun calls the loaded object with no arguments and registers the result.
    creator = names["rdzv"].load()()
    assert creator is torchrun.create_handler


def test_importing_the_package_and_handler_does_not_import_torch() -> None:
    code = "import sys, rdzv, rdzv.torchrun; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "endpoint, expected",
    [
        ("", ("localhost", 29400)),
        ("node1", ("node1", 29400)),
        ("node1:1234", ("node1", 1234)),
        ("[::1]:5000", ("::1", 5000)),
        ("[fe80::1]", ("fe80::1", 29400)),
        ("::1", ("::1", 29400)),
    ],
)
def test_parse_endpoint(endpoint: str, expected: tuple) -> None:
    assert torchrun.parse_endpoint(endpoint) == expected


def test_parse_endpoint_refuses_bad_ports() -> None:
    with pytest.raises(ValueError, match="between 0 and 65536"):
        torchrun.parse_endpoint("host:port")
    with pytest.raises(ValueError, match="between 0 and 65536"):
        torchrun.parse_endpoint("host:70000")


def test_is_this_host() -> None:
    import socket

    assert torchrun.is_this_host("localhost")
    assert torchrun.is_this_host("127.0.0.1")
    assert torchrun.is_this_host(socket.gethostname())
    assert not torchrun.is_this_host("192.0.2.1")  # TEST-NET-1, never local


class FakeParams:
    """torch's RendezvousParameters, as far as Settings reads it (no torch needed)."""

    def __init__(self, endpoint: str, **config) -> None:
        self.backend = "rdzv"
        self.endpoint = endpoint
        self.run_id = "job"
        self.min_nodes = 1
        self.max_nodes = 2
        self.local_addr = None
        self.config = config

    def get(self, key, default=None):
        return self.config.get(key, default)

    def get_as_bool(self, key, default=None):
        value = self.config.get(key, default)
        if isinstance(value, str):
            return value.lower() in ("1", "true", "t", "yes", "y")
        return value

    def get_as_int(self, key, default=None):
        value = self.config.get(key, default)
        return None if value is None else int(value)


def test_settings_read_torchrun_conf_names() -> None:
    s = torchrun.Settings(
        FakeParams(
            "h:1",
            join_timeout="90",
            last_call_timeout="2",
            close_timeout="3",
            keep_alive_interval="1",
            keep_alive_max_attempt="5",
            read_timeout="7",
            is_host="true",
        )
    )
    assert (s.host, s.port) == ("h", 1)
    assert (s.join_timeout, s.last_call_timeout, s.close_timeout) == (90, 2, 3)
    assert (s.keep_alive_interval, s.keep_alive_max_attempt, s.read_timeout) == (1, 5, 7)
    assert s.is_host is True
    # What both the TCP and the etcd handler give the rendezvous.
    assert s.timing() == {
        "join_timeout": 90,
        "last_call_timeout": 2,
        "close_timeout": 3,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": 5,
    }


def test_settings_refuse_unknown_conf_names() -> None:
    with pytest.raises(ValueError, match="last_call"):
        torchrun.Settings(FakeParams("h:1", last_call="2"))


def test_host_server_when_is_host_or_endpoint_is_local() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = torchrun.Settings(FakeParams(f"127.0.0.1:{port}"))
    server = torchrun._host_server(settings)
    assert server is not None and server.port == port
    try:
        # A second agent on this host becomes a client of the first one's server.
        assert torchrun._host_server(settings) is None
        # is_host=false never hosts.
        assert torchrun._host_server(torchrun.Settings(FakeParams(f"127.0.0.1:{port}", is_host="false"))) is None
        # is_host=true insists: a taken port is an error.
        with pytest.raises(rdzv.StoreServerError):
            torchrun._host_server(torchrun.Settings(FakeParams(f"127.0.0.1:{port}", is_host="true")))
    finally:
        server.stop()
    assert torchrun._host_server(torchrun.Settings(FakeParams("192.0.2.1:1"))) is None
