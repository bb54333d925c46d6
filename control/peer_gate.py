"""The control process's gate: its ZAP handler, which checks each peer's handshake against the
run's peer key (events/handshake.py), and a watch on the gated sockets that logs every refusal.

    peer connects ─► handshake ─► ZAP request (PLAIN password / CURVE public key) ─► 200 or 400
                                  no credentials at all (NULL) ─► mechanism mismatch, no request
    either refusal ─► the socket's monitor ─► ``peer_refused`` logged, ``num_refused`` + 1

A refused peer never gets a routing id on the ROUTER, so it cannot take a worker's identity
(``ROUTER_HANDOVER`` only ever hands an identity to a peer that proved the key).
Its own thread; the ZAP socket and monitors are touched by nothing else once it starts.
"""
from __future__ import annotations

import os
import threading

import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from residency.control.errors import ControlError
from residency.events.handshake import ZAP_ENDPOINT, accepts

log = structlog.get_logger("control.peer_gate")
REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "wrong key",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "no key or another mechanism",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}


class PeerGate:
    def __init__(self, ctx: zmq.Context, key: bytes):
        self.key = key
        self.num_refused = 0
        self.num_accepted = 0
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        try:
            self._zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self._zap.close(0)
            raise ControlError(f"another ZAP handler already runs in this ZMQ context ({e.strerror}): "
                               "give each keyed control process its own context") from e
        self._watched: list[tuple[zmq.Socket, str]] = []
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="peer-gate", daemon=True)

    def watch(self, sock: zmq.Socket, name: str) -> None:
        """Log the refused handshakes of ``sock`` (before ``start``)."""
        self._watched.append((sock.get_monitor_socket(sum(REFUSALS)), name))

    def start(self) -> "PeerGate":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join(5.0)
        for mon, _ in self._watched:
            mon.close(0)
        self._zap.close(0)
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        names = {}
        for mon, name in self._watched:
            poller.register(mon, zmq.POLLIN)
            names[mon] = name
        while True:
            ready = dict(poller.poll())
            if self._stop_r in ready:
                return
            if self._zap in ready:
                self._answer(self._zap.recv_multipart())
            for mon, name in names.items():
                if mon in ready:
                    self._refused(name, mon.recv_multipart())

    def _answer(self, request: list[bytes]) -> None:
        # RFC 27: version, request id, domain, address, routing id, mechanism, credentials...
        if len(request) < 6:
            ok, request_id = False, request[1] if len(request) > 1 else b""
        else:
            ok, request_id = accepts(self.key, request[5], request[6:]), request[1]
        if ok:
            self.num_accepted += 1
        self._zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                  b"OK" if ok else b"the peer key does not match", b"", b""])

    def _refused(self, name: str, frames: list[bytes]) -> None:
        try:
            msg = parse_monitor_message(frames)
        except Exception:  # noqa: BLE001 - a monitor frame we cannot read still means a refusal
            msg = {"event": 0, "value": 0, "endpoint": b""}
        self.num_refused += 1
        endpoint = msg["endpoint"]
        log.warning("peer_refused", socket=name, why=REFUSALS.get(msg["event"], "handshake failed"),
                    code=int(msg["value"]), endpoint=endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else endpoint)
