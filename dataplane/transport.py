"""A worker's sockets to the control process: DEALERs, msgspec structs only (no pickle).

    DEALER  identity b"w<N>", connected to the control's ROUTER (ipc:// by default, tcp:// if asked)
            frames in:  [payload]          decodes: events.commands.ToWorker
            frames out: [payload]          events.commands.FromWorker (Hello, Pong, acks, reports, ...)
    DEALER  identity b"w<N>.lane" (the lane, owned by the worker's device thread): the device's
            commands in, their replies out, so neither waits for a hand-over between the worker's
            threads. Announced in Hello.lane; used by the control after LaneHello.

Input that does not decode raises a ``WorkerTransportError`` naming what it is; the worker answers
it with an ``ErrorReply`` and goes on. The error names are the protocol's (the control process
uses the same strings); they are repeated here because dataplane never imports control.
"""
from __future__ import annotations

from typing import Any

import msgspec
import structlog
import zmq

from residency.events import handshake
from residency.events.codec import encode_message
from residency.events.commands import AnyMessage, ToWorker

log = structlog.get_logger("dataplane.transport")
MALFORMED = "malformed_message"
UNKNOWN_TYPE = "unknown_message_type"
UNEXPECTED = "unexpected_message"
MAX_PAYLOAD_BYTES = 64 << 20
# Bounded queues (the control's WORKER_HWM): with the control gone, what a worker sends waits here
# only up to this many messages; past it a message is dropped and counted (``num_dropped``): the
# WorkerRecord still has every outcome for the QueryMoves of whoever comes back.
HWM = 100_000


class WorkerTransportError(Exception):
    """Root of the worker transport's errors.

    NOTE: not a ``DataPlaneError``: that tree lives in ``dataplane.pools``, which imports torch, and
    the socket side of a worker (and the benchmarks' no-copy worker) must start without it.
    """

    name = "transport_error"

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


class MalformedMessage(WorkerTransportError):
    name = MALFORMED


class UnknownMessageType(WorkerTransportError):
    name = UNKNOWN_TYPE


class UnexpectedMessage(WorkerTransportError):
    name = UNEXPECTED


_raw = msgspec.msgpack.Decoder()
_any = msgspec.msgpack.Decoder(AnyMessage)


def identity_of(worker: int) -> bytes:
    return b"w%d" % worker


def lane_identity_of(worker: int) -> bytes:
    return b"w%d.lane" % worker


class ControlLink:
    """DEALER to the control process. Not thread-safe: one thread owns it (the worker's I/O thread;
    the device thread owns the lane, ``lane=True``)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, worker: int, lane: bool = False, key: bytes | None = None):
        """``key``: the run's peer key, proven in the handshake (None: the control takes anyone)."""
        self.endpoint = endpoint
        self.num_dropped = 0
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, lane_identity_of(worker) if lane else identity_of(worker))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        if key is not None:
            handshake.apply(self.sock, handshake.client_options(key, endpoint, "worker"))
        self.sock.setsockopt(zmq.RECONNECT_IVL, 50)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        self.sock.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(ToWorker)

    def recv(self) -> Any:
        """One command, non-blocking (``zmq.Again`` when none); a WorkerTransportError if it is bad."""
        frames = self.sock.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 1:
            raise MalformedMessage(f"expected one frame, got {len(frames)}")
        return self.decode(frames[0])

    def decode(self, data: bytes) -> Any:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        try:
            raw = _raw.decode(data)
        except msgspec.DecodeError as e:
            raise MalformedMessage(f"{len(data)} bytes are not msgpack: {e}") from None
        if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
            raise MalformedMessage(f"not a tagged message array ({type(raw).__name__})")
        try:
            msg = _any.decode(data)
        except msgspec.ValidationError as e:
            if "$[0]" in str(e):
                raise UnknownMessageType(f"unknown message type {raw[0][:64]!r}") from None
            raise MalformedMessage(f"{raw[0][:64]}: {e}") from None
        raise UnexpectedMessage(f"{type(msg).__name__} is not a command a worker takes")

    def send(self, msg) -> None:
        self.send_bytes(encode_message(msg))

    def send_bytes(self, payload: bytes) -> None:
        try:
            self.sock.send(payload, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.num_dropped += 1
            if self.num_dropped & (self.num_dropped - 1) == 0:     # 1, 2, 4, 8, ...: not a flood of lines
                log.warning("control_queue_full", endpoint=self.endpoint, hwm=HWM, dropped=self.num_dropped)

    def close(self) -> None:
        self.sock.close(0)
