"""Each of the control's sockets decodes exactly its own union (events/asks.py for the ask socket,
the worker protocol of events/commands.py for the worker socket) and names what it does not take."""
from __future__ import annotations

import typing

import pytest
import zmq

from residency.control.transport import AskServer, UnexpectedMessage, WorkerRouter
from residency.events import asks
from residency.events.codec import encode_message
from residency.events.commands import Ping, Pong


def _recv(sock_owner, timeout_ms: int = 5000):
    assert sock_owner.sock.poll(timeout_ms, zmq.POLLIN), "nothing arrived"
    return sock_owner.recv()


def test_the_ask_unions_are_the_asks_and_their_answers():
    assert set(typing.get_args(asks.AnyAsk)) == {asks.AskMove, asks.AskCommitBlocks, asks.AskReleaseBlocks,
                                                 asks.AskSetBudget, asks.AskStatus, asks.AskMemory, asks.AskResize,
                                                 asks.AskReclaim, asks.AskReleaseTenant, asks.AskFlip}
    assert {t.__name__ for t in typing.get_args(asks.AnyAskReply)} == {"AskAnswered", "StatusReport", "ErrorReply",
                                                                       "MemoryAnswer"}


def test_the_ask_socket_takes_an_ask_and_names_a_worker_message_unexpected(tmp_path):
    ctx = zmq.Context()
    server = AskServer(ctx, f"ipc://{tmp_path}/a.sock")
    client = ctx.socket(zmq.DEALER)
    client.connect(f"ipc://{tmp_path}/a.sock")
    try:
        client.send_multipart([b"", encode_message(asks.AskStatus(ask_id="s"))])
        _, msg = _recv(server)
        assert msg == asks.AskStatus(ask_id="s")
        client.send_multipart([b"", encode_message(Ping(nonce=1, ts_ns=2))])
        with pytest.raises(UnexpectedMessage, match="Ping"):
            _recv(server)
    finally:
        client.close(0)
        server.close()
        ctx.term()


def test_the_worker_socket_names_an_ask_unexpected_not_unknown(tmp_path):
    ctx = zmq.Context()
    router = WorkerRouter(ctx, f"ipc://{tmp_path}/w.sock")
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.IDENTITY, b"w0")
    worker.connect(f"ipc://{tmp_path}/w.sock")
    try:
        worker.send(encode_message(Pong(worker=0, nonce=1, ts_ns=2)))
        assert _recv(router) == (b"w0", Pong(worker=0, nonce=1, ts_ns=2))
        worker.send(encode_message(asks.AskMove(ask_id="a", kind="evict", worker=0, blocks=[1])))
        with pytest.raises(UnexpectedMessage, match="AskMove"):
            _recv(router)
    finally:
        worker.close(0)
        router.close()
        ctx.term()
