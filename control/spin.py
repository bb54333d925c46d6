"""Waiting for an ack awake: the control loop polls without sleeping near a move's expected end.

A loop that sleeps in ``poll`` through a 40 ms copy pays for waking when the ack lands: the
thread is rescheduled, its core comes out of an idle state with cold caches, and on a VM the
vCPU is woken through the host. Measured on this project's hosts, the control's part of a 2 GiB
spill after such a sleep costs ~0.1-0.2 ms more per hop than the same work done awake.

``AckSpin`` learns each route's rate from the acks (bytes moved over the worker's measured time,
per worker, source and destination tier), predicts when each dispatched move will end, and tells
the loop to poll with a zero timeout from ``before_ns`` ahead of the earliest predicted end until
``after_ns`` past it (then it sleeps again: an ack that late is not worth a core). A route with
no ack yet is not predicted. At most ``MAX_TRACKED`` moves are predicted at once; under that much
load the loop does not sleep anyway.

While it spins, the loop also reads (never writes) the state the ack will touch: the blocks of
the move predicted to end first (``warm_move``, at most every ``WARM_EVERY_NS``). On a shared
host a working set untouched for a few ms is cold again (1,024 block lookups: ~0.1 ms warm,
~1 ms cold on the 2-core VM); read just before the ack, the fold finds it in cache.

It changes when the loop looks, never what it does. Off on hosts with few cores, where a
spinning control would take the CPU a worker needs (ControlConfig.ack_spin_before_ms).
"""
from __future__ import annotations

MS = 1_000_000
MAX_TRACKED = 64
WARM_EVERY_NS = 250_000


class AckSpin:
    def __init__(self, before_ms: float, after_ms: float):
        self.before_ns = int(before_ms * MS)
        self.after_ns = int(after_ms * MS)
        self.enabled = self.before_ns > 0 or self.after_ns > 0
        self.rates: dict[tuple[int, str, str], float] = {}   # route -> bytes per ns, from acks
        self.expected: dict[str, int] = {}                    # move_id -> predicted end (monotonic ns)
        self.spin_at: int | None = None                       # the earliest predicted end
        self.num_spins = 0
        self._warmed_ns = 0

    def learned(self, route: tuple[int, str, str], nbytes: int, measured_ns: int) -> None:
        """An ack: the route's rate is what it just measured (a half-life of one move)."""
        if not self.enabled or nbytes <= 0 or measured_ns <= 0:
            return
        rate = nbytes / measured_ns
        old = self.rates.get(route)
        self.rates[route] = rate if old is None else (old + rate) / 2

    def dispatched(self, move_id: str, route: tuple[int, str, str], nbytes: int, now_ns: int) -> None:
        if not self.enabled or len(self.expected) >= MAX_TRACKED:
            return
        rate = self.rates.get(route)
        if rate is None:
            return
        end = now_ns + int(nbytes / rate)
        self.expected[move_id] = end
        if self.spin_at is None or end < self.spin_at:
            self.spin_at = end

    def warm_move(self, now_ns: int) -> str | None:
        """The move whose state to read now, while spinning (the one predicted to end first), or
        None (not spinning, or read less than WARM_EVERY_NS ago)."""
        if self.spin_at is None or now_ns < self.spin_at - self.before_ns or now_ns - self._warmed_ns < WARM_EVERY_NS:
            return None
        self._warmed_ns = now_ns
        return min(self.expected, key=self.expected.__getitem__) if self.expected else None

    def settled(self, move_id: str) -> None:
        if self.expected.pop(move_id, None) is not None:
            self.spin_at = min(self.expected.values()) if self.expected else None

    def timeout_ms(self, now_ns: int, timeout_ms: int) -> int:
        """The poll's timeout: 0 inside the window, else no later than the window's start."""
        at = self.spin_at
        if at is None:
            return timeout_ms
        if now_ns < at - self.before_ns:
            return min(timeout_ms, -(-(at - self.before_ns - now_ns) // MS))
        if now_ns <= at + self.after_ns:
            self.num_spins += 1
            return 0
        # past the window: forget the moves predicted that far back (their acks are late)
        for mid in [m for m, e in self.expected.items() if e + self.after_ns < now_ns]:
            del self.expected[mid]
        self.spin_at = min(self.expected.values()) if self.expected else None
        return self.timeout_ms(now_ns, timeout_ms) if self.spin_at is not None else timeout_ms
