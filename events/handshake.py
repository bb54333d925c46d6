"""The peer key: what a process must prove in the ZMQ handshake before the control process takes
a single frame from it (workers on the worker socket, ``residency status|ctl`` on the ask socket).

This is part of the wire protocol, so both sides take it from here (dataplane never imports
control). One random key per run, in ``<run dir>/peer.key`` (mode 0600, in a 0700 directory):

    ipc://   PLAIN  the key itself, as the password; the socket file sits in the private run dir,
                    so no other user can reach it, let alone read what crosses it
    tcp://   CURVE  both key pairs derived from the key: the server's proves the control process,
                    the client's proves a worker, and the traffic is encrypted

The control's ZAP handler (control/peer_gate.py) checks the credentials with ``accepts``; a peer
without them never reaches the ROUTER, so it can neither say Hello nor take a worker's identity.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

import zmq
from zmq.utils import z85

KEY_FILE = "peer.key"
# A worker whose device pool cannot be sized (weights plus the smallest pool do not fit its
# share) exits with this status (EX_CONFIG) after writing the arithmetic to
# ``<run dir>/worker-N.refused``: ``residency serve`` then stops with it instead of restarting it.
SIZING_REFUSED_EXIT = 78


def refused_file(run_dir: str | os.PathLike, worker: int) -> Path:
    return Path(run_dir) / f"worker-{worker}.refused"
KEY_BYTES = 32
ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class PeerKeyError(Exception):
    """A key file that is missing, not ours, readable by others, or the wrong size (says which)."""


def new_key_file(path: Path) -> bytes:
    """Write a fresh random key to ``path`` (0600, never over an existing file) and return it."""
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, key.hex().encode())
    finally:
        os.close(fd)
    return key


def read_key_file(path: Path) -> bytes:
    """The key in ``path``; refuses a file another user owns or that group/others may read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise PeerKeyError(f"cannot read the peer key {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise PeerKeyError(f"the peer key {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
        if st.st_mode & 0o077:
            raise PeerKeyError(f"the peer key {path} has mode {stat.S_IMODE(st.st_mode):o}: others may read it "
                               "(it must be 600)")
        text = os.read(fd, 4 * KEY_BYTES).decode(errors="replace").strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise PeerKeyError(f"the peer key {path} is not {KEY_BYTES} bytes of hex")
    return key


def key_in(run_dir: str | os.PathLike) -> bytes | None:
    """The run dir's key, or None when it has none (a control started without one)."""
    path = Path(run_dir) / KEY_FILE
    if not os.path.lexists(path):
        return None
    return read_key_file(path)


def uses_curve(endpoint: str) -> bool:
    return not endpoint.startswith("ipc://")


def _curve_pair(key: bytes, role: bytes) -> tuple[bytes, bytes]:
    secret = z85.encode(hmac.new(key, b"residency curve " + role, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def server_options(key: bytes, endpoint: str, domain: str) -> list[tuple[int, object]]:
    """The options of a ROUTER that only takes peers holding ``key`` (set before bind)."""
    opts: list[tuple[int, object]] = [(zmq.ZAP_DOMAIN, domain.encode())]
    if uses_curve(endpoint):
        _, secret = _curve_pair(key, b"server")
        return opts + [(zmq.CURVE_SERVER, 1), (zmq.CURVE_SECRETKEY, secret)]
    return opts + [(zmq.PLAIN_SERVER, 1)]


def client_options(key: bytes, endpoint: str, user: str) -> list[tuple[int, object]]:
    """The options of a socket that proves ``key`` to the control process (set before connect)."""
    if uses_curve(endpoint):
        server_public, _ = _curve_pair(key, b"server")
        public, secret = _curve_pair(key, b"client")
        return [(zmq.CURVE_SERVERKEY, server_public), (zmq.CURVE_PUBLICKEY, public), (zmq.CURVE_SECRETKEY, secret)]
    return [(zmq.PLAIN_USERNAME, user.encode()), (zmq.PLAIN_PASSWORD, key.hex().encode())]


def apply(sock: zmq.Socket, options: list[tuple[int, object]]) -> None:
    for opt, value in options:
        sock.setsockopt(opt, value)


def accepts(key: bytes, mechanism: bytes, credentials: list[bytes]) -> bool:
    """Whether a ZAP request's credentials prove ``key`` (constant-time comparisons)."""
    if mechanism == b"PLAIN" and len(credentials) == 2:
        return hmac.compare_digest(credentials[1], key.hex().encode())
    if mechanism == b"CURVE" and len(credentials) == 1:
        public, _ = _curve_pair(key, b"client")
        return hmac.compare_digest(z85.encode(credentials[0]), public)
    return False
