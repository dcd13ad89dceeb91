"""``contrib/rdzv-store.service`` is ``Type=notify`` and hardened (issue 36, item 4.7):
``rdzv store serve`` sends READY=1 once it listens and STOPPING=1 when SIGTERM starts its
drain, to the unix datagram socket ``$NOTIFY_SOCKET`` names; systemd rates the unit's
exposure at 2.0 or less."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from test_package import rdzv_command

CONTRIB = Path(__file__).resolve().parents[2] / "contrib"


def test_serve_tells_systemd_ready_then_stopping(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(path))
    manager.settimeout(30)
    server = subprocess.Popen(
        [rdzv_command(), "store", "serve", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NOTIFY_SOCKET": str(path)},
    )
    try:
        assert server.stdout is not None
        listening = server.stdout.readline()
        assert listening.startswith("listening on 127.0.0.1:"), listening
        assert manager.recv(256) == b"READY=1"
        # READY came after the listen: a client connects at once.
        port = int(listening.rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        server.send_signal(signal.SIGTERM)
        assert manager.recv(256) == b"STOPPING=1"
        _, stderr = server.communicate(timeout=30)
        assert server.returncode == 0, stderr
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        manager.close()


def test_the_unit_is_hardened_to_an_exposure_of_two_or_less() -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: cannot rate the unit's exposure")
    unit = CONTRIB / "rdzv-store.service"
    if not unit.exists():
        pytest.skip(f"no {unit}: the tests run outside a checkout")
    out = subprocess.run(
        [str(CONTRIB / "check-hardening.sh"), str(unit), "2.0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Type=notify" in unit.read_text()
