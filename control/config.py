"""The control process's settings (``ControlConfig``) and what its health check answers (``Health``).
Every setting has its reason beside it; ``residency serve`` builds one from its flags. The last
few (test hooks) exist for the tests and benches: ``residency serve`` leaves them as they are."""
from __future__ import annotations

import msgspec

from residency.control import moves
from residency.control.policy import PolicyConfig


class ControlConfig(msgspec.Struct, kw_only=True):
    worker_endpoint: str
    ask_endpoint: str | None = None
    expected_workers: list[int] | None = None  # None: any worker that says Hello is taken
    # the run's peer key: both sockets take only peers proving it in the ZMQ handshake; `residency
    # serve` always sets it (<run dir>/peer.key). None: any local peer gets in (tests' scripted peers)
    peer_key: bytes | None = None
    ping_interval_s: float = 0.25
    heartbeat_missed_s: float = 1.5
    worker_lost_s: float = 5.0
    lane_wait_s: float = 2.0              # a lane named in Hello but silent this long: use the Hello socket
    adopt_grace_s: float = 3.0            # after a crash: how long workers have to come back
    rebind_deadline_s: float = 30.0       # a resize's PoolRebound is due within this (plus its bytes at 1 GB/s)
    # ... and then, with keep_disk, how long one that held disk copies waits for its next
    # incarnation to say which it found, before they are counted lost with the rest
    replace_wait_s: float = 120.0
    requery_interval_s: float = 1.0       # ask workers again about stranded moves (late acks)
    deadline_grace_s: float = 1.0         # past a move's deadline, wait this long for the worker's own
                                          # verdict (it refuses to start a move past its deadline)
    policy_interval_s: float = 0.1
    checkpoint_every_events: int = 10_000
    checkpoint_every_s: float = 5.0
    snapshot_every_events: int = 100_000
    # the ledger's head is appended to this file (ledger.anchor) every anchor_every_events committed
    # events and at stop, keyed (HMAC) with the key file's bytes when one is named; None: no anchors
    anchor_file: str | None = None
    anchor_key_file: str | None = None
    anchor_every_events: int = 10_000
    commit_max_batch: int = 1000
    commit_max_delay_s: float = 0.0       # 0: commit at once; batches form while a commit runs
    max_queue: int = 100_000
    durability: str = "normal"
    stall_after_s: float = 1.0            # health: a loop or a commit stuck this long is unhealthy
    shutdown_grace_s: float = 2.0
    # a clean stop frees every copy by the book, but for the disk copies with keep_disk: they stay
    # in the ledger and on the worker's disk, and the next incarnation keeps those it finds and
    # verifies (WorkerLost.kept_on_disk); `residency serve` on with --keep-disk (its default)
    keep_disk: bool = False
    config_digest: str = ""
    # after answering a thread of this process before an ack's fold, the loop steps off the GIL
    # so that thread can take its answer first, when the fold is of at least this many blocks
    # (control/answers.py)
    answer_yield_min_blocks: int = 32
    # on a worker's MoveNearlyDone, poll without sleeping until that move's outcome comes, at most
    # this long (its bytes_left at 10 GB/s, capped here); 0: sleep in the poll as always
    ack_spin_max_us: int = 3000
    # ... and first warm the ledger's write path (a transaction opened and rolled back), so the
    # ack's commit does not pay for the caches the idle wait cost (LedgerStore.warm_writer), this
    # long before the worker's estimate of the ack (about what the warm-up itself takes)
    warm_lead_us: int = 1000
    # a copy of at least this many bytes: its worker's lane hears CommandAhead before the
    # MoveRequested commits and polls awake for the command (0: never). An ask naming that many
    # bytes of blocks wakes the lane before it is resolved (not while keep_awake's spinners spin:
    # then a woken thread runs at once), and (device <-> host copies) the hint carries the
    # command, so the worker may begin its copies while the MoveRequested commits (an early
    # start: nothing is visible on the worker before the command itself comes; see
    # events.commands.CommandAhead)
    command_ahead_min_bytes: int = 64 << 20
    command_ahead_us: int = 2000          # ... polling awake for at most this long
    # while a move of at least ``keep_awake_min_bytes`` is in flight, a SCHED_IDLE spinner on
    # every CPU keeps the host's vCPUs from halting (control/keep_awake.py); off by default, on for
    # ``residency serve`` on a GPU host
    keep_awake: bool = False
    keep_awake_min_bytes: int = 64 << 20
    keep_awake_linger_s: float = 1.0      # ... and this long after the last one is settled
    moves: moves.MoveConfig = msgspec.field(default_factory=moves.MoveConfig)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    # tensor-parallel groups (``serve --tp N``): name -> its workers in rank order; the leader
    # (rank 0) is planned for, every rank is told (control/groups.py)
    groups: dict[str, list[int]] = {}
    # ---- test hooks (tests and benches set these; `residency serve` never does)
    # False: a stop leaves every copy where it is (tests that stop many controls skip the releases)
    release_on_stop: bool = True
    # False: every commit goes through the group-commit writer's thread, never inline on the loop
    # (the path a commit under load takes; tests drive it with this)
    commit_inline: bool = True
    faults: str = ""                      # ControlFaults spec: injected crashes (control/probes.py)
    trace_moves: int = 0                  # keep wall-clock phase marks of the last N moves (MoveTraces)


class Health(msgspec.Struct, kw_only=True):
    healthy: bool
    problems: list[str]
    metrics: dict[str, float]
