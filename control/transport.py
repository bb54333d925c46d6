"""The control process's sockets: framing, one decoder per socket, and named errors.

Two sockets, both ZMQ ROUTER, both carrying msgspec structs from ``events`` only (no pickle):

    workers  ROUTER  bound at ipc://<run_dir>/w.sock (or a configured tcp://)
             frames in:  [identity, payload]          identity = b"w<N>" set by the worker's DEALER
             decodes:    events.commands.FromWorker   (Hello, Pong, acks, reports, ...)
    asks     ROUTER  bound at ipc://<run_dir>/ctl.sock (local only)
             frames in:  [identity, b"", payload]     from a REQ client (``residency status|ctl``)
             decodes:    events.asks.AnyAsk; answers events.asks.AnyAskReply

Anything that does not decode is a ``TransportError`` subclass carrying the sender's identity, so
the caller can answer it with an ``ErrorReply`` naming the error and log it once; nothing here
raises past a bad peer. ``ROUTER_MANDATORY`` turns a send to a worker that is not connected into
``WorkerUnreachable`` instead of a silent drop; ``ROUTER_HANDOVER`` lets a restarted worker take
its identity back from the dead connection. With a peer key (``residency serve`` always has one)
both sockets take only peers that prove it in the handshake (events/handshake.py,
control/peer_gate.py), so only a holder of the key can say Hello or take an identity over.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Union

import msgspec
import zmq

from residency.events import handshake
from residency.events.codec import encode_message
from residency.events.asks import AnyAsk, AnyAskReply
from residency.events.commands import AnyMessage, ErrorReply, FromWorker, Message

# The errors a peer can provoke, by the name carried in ``ErrorReply.error``.
MALFORMED = "malformed_message"            # bytes that are not one msgpack message
UNKNOWN_TYPE = "unknown_message_type"      # a tag no version of us knows
UNEXPECTED = "unexpected_message"          # a known message this socket does not take
UNKNOWN_WORKER = "unknown_worker"          # a sender that never said Hello (or is not expected)
WORKER_MISMATCH = "worker_mismatch"        # a body naming another worker than its identity
WORKER_LOST = "worker_lost"                # a sender the ledger already recorded as lost
INVALID_ASK = "invalid_ask"                # an ask that names blocks/tiers the state does not have


class TransportError(Exception):
    """Root of the control transport's errors. ``name`` is what goes in ``ErrorReply.error``."""

    name = "transport_error"

    def __init__(self, detail: str, identity: bytes = b""):
        super().__init__(detail)
        self.detail = detail
        self.identity = identity

    def reply(self) -> ErrorReply:
        return ErrorReply(error=self.name, detail=self.detail)


class MalformedMessage(TransportError):
    name = MALFORMED


class UnknownMessageType(TransportError):
    name = UNKNOWN_TYPE


class UnexpectedMessage(TransportError):
    name = UNEXPECTED


class WorkerUnreachable(TransportError):
    """A send to a worker identity with no live connection (ROUTER_MANDATORY)."""

    name = "worker_unreachable"


class ControlUnreachable(TransportError):
    """The control process did not answer on its ask socket within the timeout."""

    name = "control_unreachable"


class ControlRefused(TransportError):
    """The control process refused the ask client's handshake (no peer key, or another one)."""

    name = "control_refused"


_raw = msgspec.msgpack.Decoder()
# every message of ours, whichever socket takes it: tells "unexpected here" from "unknown"
_any = msgspec.msgpack.Decoder(Union[AnyMessage, AnyAsk, AnyAskReply])
MAX_PAYLOAD_BYTES = 64 << 20
# Bounded queues: far above any burst the protocol makes, so reaching one means a peer stopped
# reading; a send then fails at once (WorkerUnreachable) instead of queueing without end.
WORKER_HWM = 100_000
ASK_HWM = 1_000


def decode_or_raise(decoder: msgspec.msgpack.Decoder, data: bytes, identity: bytes = b"") -> Any:
    """Decode ``data`` with this socket's decoder, or raise the named error saying why not."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    # Slow path, errors only: say which of the three it is.
    try:
        raw = _raw.decode(data)
    except msgspec.DecodeError as e:
        raise MalformedMessage(f"{len(data)} bytes are not msgpack: {e}", identity) from None
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise MalformedMessage(f"not a tagged message array ({type(raw).__name__})", identity)
    try:
        msg = _any.decode(data)
    except msgspec.ValidationError as e:
        if "Invalid value" in str(e) and "$[0]" in str(e):
            raise UnknownMessageType(f"unknown message type {raw[0][:64]!r}", identity) from None
        raise MalformedMessage(f"{raw[0][:64]}: {e}", identity) from None
    raise UnexpectedMessage(f"{type(msg).__name__} is not a message this socket takes", identity)


# ---------------------------------------------------------------- where the sockets live
def default_run_dir(ledger_url: str) -> Path:
    """A short per-ledger directory for ipc sockets and pid files.

    Derived from the ledger URL (relative SQLite paths made absolute) so ``serve``, ``status``
    and ``ctl`` agree without configuration. Short on purpose: ipc paths must fit ~100 bytes.
    """
    url = ledger_url
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:":
            url = "sqlite:///" + os.path.abspath(path)
    digest = hashlib.sha1(url.encode()).hexdigest()[:10]
    return Path(os.environ.get("RESIDENCY_RUN_ROOT") or per_user_root()) / digest


def per_user_root() -> Path:
    """The default root of run dirs: this user's, in the shared temp dir (so checked, not trusted)."""
    return Path(tempfile.gettempdir()) / f"residency-{os.getuid()}"


def worker_endpoint(run_dir: Path) -> str:
    return f"ipc://{run_dir}/w.sock"


def ask_endpoint(run_dir: Path) -> str:
    return f"ipc://{run_dir}/ctl.sock"


def check_ipc_path(endpoint: str) -> None:
    if endpoint.startswith("ipc://") and len(endpoint) - len("ipc://") > 100:
        raise ValueError(f"ipc path too long for a unix socket ({len(endpoint) - 6} > 100 bytes): {endpoint}; "
                         "set --run-dir or RESIDENCY_RUN_ROOT to a shorter directory")


# ---------------------------------------------------------------- the worker socket
def worker_identity(worker: int) -> bytes:
    return b"w%d" % worker


def parse_worker_identity(identity: bytes) -> int | None:
    if identity[:1] == b"w" and identity[1:].isdigit() and len(identity) < 12:
        return int(identity[1:])
    return None


class WorkerRouter:
    """ROUTER to the workers. Not thread-safe: the control loop's thread owns it."""

    def __init__(self, ctx: zmq.Context, endpoint: str, key: bytes | None = None):
        """``key``: only peers that prove it in the handshake get in (None: any peer; tests'
        scripted workers)."""
        check_ipc_path(endpoint)
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, WORKER_HWM)
        self.sock.setsockopt(zmq.RCVHWM, WORKER_HWM)
        if key is not None:
            handshake.apply(self.sock, handshake.server_options(key, endpoint, "workers"))
        self.sock.bind(endpoint)
        self._decoder = msgspec.msgpack.Decoder(FromWorker)

    def recv(self) -> tuple[bytes, Any]:
        """One message, non-blocking (``zmq.Again`` when none). Raises a TransportError for bad input."""
        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
        identity = frames[0]
        if len(frames) != 2:
            raise MalformedMessage(f"expected [identity, payload], got {len(frames)} frames", identity)
        return identity, decode_or_raise(self._decoder, frames[1], identity)

    def send(self, identity: bytes, msg: Message | msgspec.Struct) -> None:
        self.send_bytes(identity, encode_message(msg))

    def send_bytes(self, identity: bytes, payload: bytes) -> None:
        try:
            self.sock.send_multipart((identity, payload), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise WorkerUnreachable(f"no connection for {identity!r}: {e.strerror}", identity) from e
            raise

    def close(self) -> None:
        self.sock.close(0)


# ---------------------------------------------------------------- the ask socket
class AskServer:
    """ROUTER for ``residency status|ctl`` (REQ clients). Replies may be sent at any later time."""

    def __init__(self, ctx: zmq.Context, endpoint: str, key: bytes | None = None):
        check_ipc_path(endpoint)
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self.sock.setsockopt(zmq.SNDHWM, ASK_HWM)
        self.sock.setsockopt(zmq.RCVHWM, ASK_HWM)
        if key is not None:
            handshake.apply(self.sock, handshake.server_options(key, endpoint, "asks"))
        self.sock.bind(endpoint)
        self._decoder = msgspec.msgpack.Decoder(AnyAsk)

    def recv(self) -> tuple[bytes, Any]:
        frames = self.sock.recv_multipart(zmq.NOBLOCK)
        identity = frames[0]
        if len(frames) != 3 or frames[1] != b"":
            raise MalformedMessage(f"expected [identity, '', payload], got {len(frames)} frames", identity)
        return identity, decode_or_raise(self._decoder, frames[2], identity)

    def send(self, identity: bytes, msg: Message) -> None:
        try:
            self.sock.send_multipart((identity, b"", encode_message(msg)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the asker went away (timed out); its answer is in the ledger anyway

    def close(self) -> None:
        self.sock.close(0)


class AskClient:
    """A REQ client of the ask socket, for the CLI. One request at a time, with a timeout."""

    def __init__(self, endpoint: str, timeout_s: float = 30.0, ctx: zmq.Context | None = None,
                 key: bytes | None = None):
        self.endpoint = endpoint
        self.key = key
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = ctx or zmq.Context.instance()
        self._decoder = msgspec.msgpack.Decoder(AnyAskReply)

    def ask(self, msg: Message, timeout_s: float | None = None) -> Any:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if self.key is not None:
            handshake.apply(sock, handshake.client_options(self.key, self.endpoint, "ctl"))
        # a refused handshake is said at once, not after the whole timeout
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        timeout = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        # NOTE: a REQ send blocks while it has no pipe, and a refused handshake can drop the pipe
        # before the send: bounded, so a refusal or an absent server is said, never waited forever
        sock.setsockopt(zmq.SNDTIMEO, timeout)
        try:
            sock.connect(self.endpoint)
            try:
                sock.send(encode_message(msg))
            except zmq.Again:
                if monitor.poll(0):
                    raise self._refused() from None
                raise ControlUnreachable(
                    f"could not send to the control process at {self.endpoint} within {timeout / 1000:.1f} s "
                    "(is `residency serve` running on this ledger?)") from None
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            ready = dict(poller.poll(timeout))
            if monitor in ready and sock not in ready:
                raise self._refused()
            if sock not in ready:
                raise ControlUnreachable(
                    f"no answer from the control process at {self.endpoint} within {timeout / 1000:.1f} s "
                    "(is `residency serve` running on this ledger?)")
            return decode_or_raise(self._decoder, sock.recv())
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def _refused(self) -> ControlRefused:
        return ControlRefused(f"the control process at {self.endpoint} refused this client's handshake: "
                              + ("no peer key was given" if self.key is None else "the peer key does not match"))
