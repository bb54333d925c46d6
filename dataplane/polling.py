"""The awake poll: wait for a message known to be on its way without sleeping through its arrival."""
from __future__ import annotations

import time

import zmq


def poll_until(poller: zmq.Poller, until_ns: int) -> list:
    """Poll without sleeping until something is ready or the monotonic clock reaches ``until_ns``
    (then []). For a message announced ahead (a CommandAhead's command): a thread that sleeps in a
    blocking poll is woken some time after the message lands; a thread that spins reads it at once."""
    while True:
        ready = poller.poll(0)
        if ready or time.monotonic_ns() >= until_ns:
            return ready
