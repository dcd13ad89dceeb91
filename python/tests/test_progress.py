"""What ``rdzv rendezvous`` says while a round waits (issue 36, item 4.3 and part 3):
without a terminal, one line on stderr when the last call starts, with its length."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import rdzv

from test_package import rdzv_command


def test_rendezvous_command_says_how_long_the_last_call_waits(server: rdzv.StoreServer) -> None:
    url = f"elastic://127.0.0.1:{server.port}/progress?nodes=1:2&last_call=1500ms"
    node = subprocess.Popen(
        [rdzv_command(), "rendezvous", url, "--node-id", "a"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stdout is not None and node.stderr is not None
        start = time.monotonic()
        lines = []
        for line in node.stdout:
            lines.append(line)
            if line.startswith("round "):
                break
        # The round closed by the last call, not before it.
        assert time.monotonic() - start >= 1.4, lines
        assert lines[-1].startswith("round 0 rank 0 world_size 1 "), lines
    finally:
        node.send_signal(signal.SIGTERM)
        _, stderr = node.communicate(timeout=30)
    assert node.returncode == 0, stderr
    # No terminal: no updating line, one line for the last call, with its real length.
    assert stderr.splitlines().count("last call: waiting up to 1.5 s for more nodes") == 1, stderr
    assert "\r" not in stderr, stderr


def test_a_client_command_that_retries_says_so_on_stderr() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    out = subprocess.run(
        [rdzv_command(), "rendezvous", f"elastic://127.0.0.1:{port}/retry?nodes=1:1",
         "--connect-timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out
    # After a second of retrying, once: not 3 s of silence.
    said = [line for line in out.stderr.splitlines() if "retrying for" in line]
    assert len(said) == 1, out.stderr
    # Bare, as a person reads it: no log time, level or module before it.
    assert said[0].startswith(f"connecting to 127.0.0.1:{port}, "), said
    assert re.search(
        f"connecting to 127.0.0.1:{port}, retrying for [12] s more: 127.0.0.1:{port}: "
        "connection refused",
        said[0],
    ), said


def test_the_torchrun_handlers_log_where_a_waiting_round_stands(
    server: rdzv.StoreServer, caplog: "pytest.LogCaptureFixture"
) -> None:
    # The torchrun handlers (rdzv.torchrun, rdzv._etcd) wait through wait_with_progress:
    # the progress line at INFO when it changes, and once at WARNING after a long wait,
    # so that a job stuck at rendezvous says which nodes it waits for.
    import logging

    import pytest

    from rdzv._progress import wait_with_progress

    node = rdzv.ElasticRendezvous(
        "127.0.0.1", server.port, "stuck", min_nodes=2, max_nodes=2, node_id="a",
        join_timeout=2.5,
    )
    caplog.set_level(logging.INFO, logger="rdzv.torchrun")
    with pytest.raises(rdzv.RendezvousTimeoutError):
        wait_with_progress(node, "stuck", every=0.2, warn_after=1.0)
    node.shutdown()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "rdzv.torchrun"]
    waiting = re.compile(r"rdzv: run stuck: round \d+: 1 of min 2 nodes; waiting for 1 more$")
    infos = [m for level, m in said if level == logging.INFO]
    warnings = [m for level, m in said if level == logging.WARNING]
    assert infos and all(waiting.match(m) for m in infos), said
    assert len(infos) == 1, said  # said again only when it changes
    assert len(warnings) == 1, said
    assert re.match(
        r"rdzv: run stuck: no round after \d+ s: round \d+: 1 of min 2 nodes; waiting for 1 more$",
        warnings[0],
    ), said


def test_on_a_terminal_the_rendezvous_command_shows_an_updating_line(server: rdzv.StoreServer) -> None:
    # stderr is a pseudo-terminal: the command draws "round N: 1 of min 2 nodes; waiting
    # for 1 more" and redraws it in place (carriage returns), instead of staying silent.
    import os
    import pty
    import select

    primary, secondary = pty.openpty()
    url = f"elastic://127.0.0.1:{server.port}/tty?nodes=2:2&join_timeout=3s"
    node = subprocess.Popen(
        [rdzv_command(), "rendezvous", url, "--node-id", "a"],
        stdout=subprocess.DEVNULL,
        stderr=secondary,
        stdin=subprocess.DEVNULL,
    )
    os.close(secondary)
    seen = b""
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(primary, 4096)
                except OSError:
                    break  # the command exited and closed the terminal
                if not chunk:
                    break
                seen += chunk
            elif node.poll() is not None:
                break
    finally:
        if node.poll() is None:
            node.kill()
        node.wait(timeout=30)
        os.close(primary)
    text = seen.decode(errors="replace")
    assert re.search(r"round \d+: 1 of min 2 nodes; waiting for 1 more", text), text
    assert "\r" in text, text  # redrawn in place
