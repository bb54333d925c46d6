"""What a long idle costs the control's own work on this host: the steps of a 1024-block move's
request (resolve, fund, requested, command, its encoding) and the ledger append of its ack (8 KiB
of checksums), each back to back ("hot") and after the thread slept 40 ms, as the control loop
does through a 2 GiB spill's copy. The append also after a warm-up of the ledger's writer
(``LedgerStore.warm_writer``, which the control runs shortly before a big move's ack is due) at
several leads.

The request steps run on the control loop's thread of a real control process (a no-copy worker
holds the blocks); the appends on an SQLite ledger of their own. Prints a table; writes
bench/results/control-cold-<date>-<machine>.json.

    python bench/control_cold.py [--reps 40] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from control_cluster import BIG_LAYOUT, Cluster, git_commit, layout_bytes, write_result  # noqa: E402
from residency.events import Envelope  # noqa: E402
from residency.events import catalog as ev  # noqa: E402
from residency.events.codec import encode_message  # noqa: E402
from residency.events.asks import AskMove  # noqa: E402
from residency.ledger import LedgerStore  # noqa: E402

IDLE_S = 0.040


def _median_us(fn, reps: int, idle_s: float = 0.0, before=None) -> float:
    fn()
    ts = []
    for _ in range(reps):
        if idle_s:
            time.sleep(idle_s)
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    return ts[len(ts) // 2] / 1e3


def request_steps(reps: int) -> dict[str, float]:
    """The request's steps, on the control loop's thread, for 1024 blocks of 2 MiB."""
    from residency.control import moves  # noqa: PLC0415

    d = tempfile.mkdtemp(prefix="rcc-")
    c = Cluster(f"sqlite:///{d}/l.db", "nocopy", "cpu", BIG_LAYOUT, 1032, 1032 * layout_bytes(BIG_LAYOUT))
    try:
        msg = AskMove(ask_id="big", kind="evict", worker=0, blocks=c.commit(1024))

        def steps(p) -> dict[str, float]:
            def resolve():
                return moves.resolve(p.state, msg, "bench", p.moves.busy.by_worker)
            proposals = resolve()
            req = moves.requested(p.state, proposals[0], "m-cold", time.time_ns(), p.cfg.moves)
            cmd = moves.command_for(req)
            return {
                "resolve": _median_us(resolve, reps * 5),
                "resolve_after_idle": _median_us(resolve, reps, IDLE_S),
                "fund": _median_us(lambda: moves.fund(p.state, proposals, p.moves.reserved_bytes()), reps * 5),
                "requested": _median_us(lambda: moves.requested(p.state, proposals[0], "m-cold", time.time_ns(),
                                                                p.cfg.moves),
                                        reps * 5),
                "command_for": _median_us(lambda: moves.command_for(req), reps * 5),
                "encode_command": _median_us(lambda: encode_message(cmd), reps * 5),
            }
        return c.proc.call(steps).result(600)
    finally:
        c.close()


def ack_appends(reps: int) -> dict[str, float]:
    """Appends of a 1024-block MoveAcked (durability normal, as the control writes)."""
    d = tempfile.mkdtemp(prefix="rcc-")
    store = LedgerStore.open(f"sqlite:///{d}/l.db", create=True)
    n = [0]
    sums = ev.pack_checksums([random.getrandbits(64) for _ in range(1024)])

    def append():
        n[0] += 1
        env = Envelope(seq=0, ts_ns=time.time_ns(), producer="control", epoch=1, producer_seq=n[0],
                       correlation_id=None, causation=None)
        ack = ev.MoveAcked(move_id=f"m-1-{n[0]}", worker=0, bytes_moved=1 << 31, bytes_freed_src=1 << 31,
                           checksum_ok=True, started_ns=1, finished_ns=2, checksums=sums)
        store.append([(env, ack)], durability="normal")

    def warm_then(lead_s: float, payload: int = 0):
        def before():
            store.warm_writer("normal", payload)
            end = time.perf_counter() + lead_s
            while time.perf_counter() < end:
                pass
        return before

    try:
        for _ in range(50):
            append()
        return {
            "hot": _median_us(append, reps * 3),
            "after_idle": _median_us(append, reps, IDLE_S),
            "after_idle_warmed_at_once": _median_us(append, reps, IDLE_S, warm_then(0.0)),
            "after_idle_warmed_0.3_ms_before": _median_us(append, reps, IDLE_S, warm_then(0.0003)),
            "after_idle_warmed_1_ms_before": _median_us(append, reps, IDLE_S, warm_then(0.001)),
            "after_idle_warmed_with_a_rolled_back_row_0.3_ms_before": _median_us(append, reps, IDLE_S,
                                                                                warm_then(0.0003, len(sums))),
            "after_idle_warmed_with_a_rolled_back_row_1_ms_before": _median_us(append, reps, IDLE_S,
                                                                              warm_then(0.001, len(sums))),
        }
    finally:
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--machine", default=None, help="name in the result file (default: cpu, or h200 with a GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    steps = request_steps(args.reps)
    appends = ack_appends(args.reps)
    print(f"{'1024-block request step':34s} {'p50 us':>8s}")
    for k, v in steps.items():
        print(f"{k:34s} {v:8.1f}")
    print(f"{'1024-block ack append':34s} {'p50 us':>8s}")
    for k, v in appends.items():
        print(f"{k:34s} {v:8.1f}")
    machine = args.machine or ("h200" if Path("/dev/nvidia0").exists() else "cpu")
    out = {"bench": "control_cold", "date": dt.date.today().isoformat(), "machine": machine,
           "git_commit": git_commit(), "idle_ms": IDLE_S * 1e3, "reps": args.reps,
           "request_steps_us_p50": steps, "ack_append_us_p50": appends}
    write_result(out, "control-cold", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
