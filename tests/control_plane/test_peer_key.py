"""Only a holder of the run's peer key gets through the control's sockets: a local process
without it can neither say Hello, nor take a live worker's identity over, nor ask anything."""
from __future__ import annotations

import secrets
import socket
import subprocess
import time

import pytest
import zmq

from residency.control.transport import AskClient, ControlRefused
from residency.events.asks import AskStatus
from residency.events.commands import ErrorReply, Ping
from residency.events.handshake import KEY_FILE, new_key_file

from tests.control_plane.conftest import FakeWorker, joined, spawn, wait_for, worker_argv


def _refused(proc) -> int:
    return int(proc.health().metrics.get("peers_refused", 0))


def _free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _pings_reach(fw: FakeWorker, seconds: float = 1.5) -> bool:
    """Whether the control's Pings still come to ``fw`` (they go to whoever holds its identity)."""
    fw.answer_pings = False
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if fw.sock.poll(100):
            from residency.events.codec import decode_message
            if type(decode_message(fw.sock.recv())) is Ping:
                return True
    return False


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
@pytest.mark.parametrize("rogue_key", [None, "another"])
def test_a_peer_without_the_key_cannot_take_a_live_workers_identity(make_control, short_dir, sqlite_url,
                                                                    transport, rogue_key):
    key = secrets.token_bytes(32)
    endpoint = f"ipc://{short_dir}/w.sock" if transport == "ipc" else _free_tcp_endpoint()
    proc, store = make_control(sqlite_url, peer_key=key, worker_endpoint=endpoint, expected_workers=[0])
    real = FakeWorker(endpoint, key=key)
    rogue = None
    try:
        real.hello()
        wait_for(lambda: joined(proc), what="the keyed worker joined")
        # same identity, Hello and a forged ack-looking error: with handover, it would take the route
        rogue = FakeWorker(endpoint, key=None if rogue_key is None else secrets.token_bytes(32))
        try:
            rogue.hello(epoch=99)
            rogue.send(ErrorReply(error="forged", detail="from a rogue peer"))
        except zmq.Again:       # the control refused its handshake before the send: no peer to send to
            pass
        # refused at the handshake, or (without the key check) answered as the worker it claims
        wait_for(lambda: _refused(proc) >= 1 or rogue.sock.poll(0), what="the rogue peer refused or answered")
        assert not rogue.sock.poll(300), "the rogue peer was answered"
        while real.sock.poll(0):
            real.sock.recv()
        assert _pings_reach(real), "the real worker no longer hears the control"
        state = proc.call(lambda p: (p.workers.by_worker[0].epoch, p.metrics.get("worker_error_forged", 0))).result(5)
        assert state == (real.epoch, 0)
    finally:
        real.close()
        if rogue is not None:
            rogue.close()


def test_the_ask_socket_answers_only_a_client_with_the_key(make_control, short_dir, sqlite_url):
    key = secrets.token_bytes(32)
    proc, _ = make_control(sqlite_url, peer_key=key)
    endpoint = f"ipc://{short_dir}/c.sock"
    assert AskClient(endpoint, timeout_s=5, key=key).ask(AskStatus(ask_id="ok")).ask_id == "ok"
    for wrong in (None, secrets.token_bytes(32)):
        t0 = time.monotonic()
        with pytest.raises(ControlRefused, match="refused this client's handshake"):
            AskClient(endpoint, timeout_s=20, key=wrong).ask(AskStatus(ask_id="no"))
        assert time.monotonic() - t0 < 15      # said at the handshake, not at the timeout (a liveness bound)
    wait_for(lambda: _refused(proc) >= 2, what="both refusals counted")


def test_a_real_worker_proves_the_key_from_its_run_dir(make_control, short_dir, sqlite_url, tmp_path):
    key = new_key_file(short_dir / KEY_FILE)
    proc, _ = make_control(sqlite_url, peer_key=key, expected_workers=[0])
    w = spawn(worker_argv(0, f"ipc://{short_dir}/w.sock", short_dir, mover="nocopy"), tmp_path / "worker.log")
    try:
        wait_for(lambda: joined(proc), timeout=60, what="the real worker joined")
        wait_for(lambda: proc.call(lambda p: p.workers.by_worker[0].lane_up).result(5), what="its lane up")
        assert _refused(proc) == 0
    finally:
        w.terminate()
        w.wait(10)


def test_a_worker_refuses_a_key_file_others_may_read(short_dir, tmp_path):
    path = short_dir / KEY_FILE
    new_key_file(path)
    path.chmod(0o644)
    argv = worker_argv(0, f"ipc://{short_dir}/w.sock", short_dir, mover="nocopy")
    out = subprocess.run(argv, capture_output=True, timeout=60, text=True)
    assert out.returncode == 2
    assert "worker_peer_key_refused" in out.stdout + out.stderr and "mode 644" in out.stdout + out.stderr
