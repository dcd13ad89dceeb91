"""A join to an endpoint nobody serves ends by ``join_timeout``, in one clear line
(issue 36, item 4.2): torchrun's handler (its torch-free half), ``rdzv.rendezvous`` with
an ``elastic://`` URL, and the ``rdzv rendezvous`` command."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import Any, Dict, Optional

import pytest

import rdzv
from rdzv import torchrun

from test_package import rdzv_command

JOIN_TIMEOUT = 1.5
#: What a join may take beyond its join timeout: the last connect attempt, process start.
MARGIN = 1.5


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Params:
    """What the handler reads of torch's ``RendezvousParameters``, without torch."""

    def __init__(self, endpoint: str, **config: Any) -> None:
        self.backend = "rdzv"
        self.endpoint = endpoint
        self.run_id = "unreachable"
        self.min_nodes = 1
        self.max_nodes = 1
        self.local_addr: Optional[str] = "127.0.0.1"
        self.config: Dict[str, Any] = config

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def get_as_int(self, key: str, default: Optional[int] = None) -> Optional[int]:
        value = self.config.get(key)
        return default if value is None else int(value)

    def get_as_bool(self, key: str, default: Optional[bool] = None) -> Optional[bool]:
        value = self.config.get(key)
        return default if value is None else str(value).lower() in ("1", "true", "yes")


def assert_one_clear_line(text: str) -> None:
    assert "\n" not in text.strip(), text
    assert ".." not in text, text
    assert "Error: " not in text, text  # no class name inside the message


def test_handler_fails_by_join_timeout_not_read_timeout() -> None:
    port = closed_port()
    # read_timeout (60 s) is what torch's client would retry for; join_timeout bounds it.
    settings = torchrun.Settings(
        Params(f"127.0.0.1:{port}", join_timeout=JOIN_TIMEOUT, read_timeout=60)
    )
    assert settings.connect_timeout() == JOIN_TIMEOUT
    start = time.monotonic()
    with pytest.raises(rdzv.RendezvousConnectionError) as raised:
        torchrun.reach_server(settings)
    elapsed = time.monotonic() - start
    assert elapsed < JOIN_TIMEOUT + MARGIN, elapsed
    text = str(raised.value)
    assert_one_clear_line(text)
    assert text.startswith(
        f"run 'unreachable': no rdzv store server answered at 127.0.0.1:{port} within 1.5 s "
        "(join_timeout 1.5 s, read_timeout 60 s): "
    ), text
    assert "connection refused" in text, text
    assert text.endswith(
        f"Start the agent that hosts it (--rdzv-conf is_host=true) or `rdzv store serve "
        f"--port {port}` there, or correct --rdzv-endpoint"
    ), text


def test_handler_reaches_a_running_server(server: rdzv.StoreServer) -> None:
    torchrun.reach_server(torchrun.Settings(Params(f"127.0.0.1:{server.port}")))


def test_elastic_url_join_fails_by_join_timeout() -> None:
    port = closed_port()
    start = time.monotonic()
    # rendezvous's own timeout (30 minutes by default) does not outlast the join timeout.
    with pytest.raises(rdzv.RendezvousConnectionError) as raised:
        rdzv.rendezvous(f"elastic://127.0.0.1:{port}/run?nodes=1:1&join_timeout=1500ms")
    elapsed = time.monotonic() - start
    assert elapsed < JOIN_TIMEOUT + MARGIN, elapsed
    assert_one_clear_line(str(raised.value))
    assert f"127.0.0.1:{port}" in str(raised.value)


def test_rdzv_rendezvous_command_fails_by_join_timeout() -> None:
    port = closed_port()
    start = time.monotonic()
    out = subprocess.run(
        [rdzv_command(), "rendezvous", f"elastic://127.0.0.1:{port}/run?nodes=1:1&join_timeout=1500ms"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert out.returncode == 1, out
    assert elapsed < JOIN_TIMEOUT + MARGIN, elapsed
    # One line on stderr names the store, the refusal and nothing twice.
    errors = [line for line in out.stderr.splitlines() if line.startswith("rdzv: ")]
    assert len(errors) == 1, out.stderr
    assert_one_clear_line(errors[0])
    assert errors[0].startswith(f"rdzv: connecting to the store at 127.0.0.1:{port}: "), errors
    assert "connection refused" in errors[0], errors
