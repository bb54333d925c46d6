"""`residency status`: the live state of the running server (asked over its local control socket).

Health first (a stalled loop, a lagging or back-pressured ledger, a failed control loop are named),
then the state of every byte as the replay commands show it, then the moves still in flight and
the stranded ones, each with its bytes.
"""
from __future__ import annotations

import json
import time

from residency.control.cli.ctl_cmd import add_target_args, ask_server


def register(sub) -> None:
    p = sub.add_parser("status", help="live state of the running server: health, tiers, moves in flight, stranded")
    add_target_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from residency.control.state import decode_state  # noqa: PLC0415
    from residency.control.views import human_bytes, render_text, summarize  # noqa: PLC0415
    from residency.events.asks import AskStatus  # noqa: PLC0415

    report = ask_server(args, AskStatus(ask_id=f"status-{time.time_ns()}"))
    state = decode_state(report.state)
    summary = summarize(state)
    now = time.time_ns()
    inflight = [{"move_id": m.move_id, "kind": m.kind, "worker": m.worker, "src": m.src, "dst": m.dst,
                 "blocks": len(m.blocks), "bytes_planned": m.bytes_planned, "deadline_in_ms": (m.deadline_ns - now) // 10**6}
                for m in state.inflight.values()]
    stranded = [{"move_id": m.move_id, "kind": m.kind, "worker": m.worker, "src": m.src, "dst": m.dst,
                 "bytes_at_risk": m.bytes_planned} for m in state.stranded.values()]
    if args.json:
        print(json.dumps({"healthy": report.healthy, "problems": report.problems, "last_seq": report.last_seq,
                          "state_hash": report.state_hash, "metrics": report.metrics, "state": summary,
                          "in_flight": inflight, "stranded": stranded}, indent=2))
        return 0 if report.healthy else 1
    m = report.metrics
    print(f"health: {'ok' if report.healthy else 'UNHEALTHY'}" + "".join(f"\n  - {p}" for p in report.problems))
    print(f"ledger: last seq {report.last_seq} (committed {int(m.get('committed_seq', 0))}), state hash "
          f"{report.state_hash[:16]}, commit lag {m.get('commit_lag_ms', 0):.1f} ms, writer queue "
          f"{int(m.get('ledger_queue_depth', 0))}, back-pressure waits {int(m.get('ledger_backpressure_waits', 0))}, "
          f"loop lag {m.get('loop_lag_ms', 0):.1f} ms, workers linked {int(m.get('workers_linked', 0))}")
    print(render_text(summary))
    if inflight:
        print(f"\nmoves in flight ({len(inflight)}):")
        for x in inflight[:50]:
            print(f"  {x['move_id']} {x['kind']} worker {x['worker']} {x['src']}->{x['dst']} {x['blocks']} blocks "
                  f"{human_bytes(x['bytes_planned'])}, deadline in {x['deadline_in_ms']} ms")
    if stranded:
        print(f"\nstranded moves ({len(stranded)}), bytes at risk until a late ack re-accounts them:")
        for x in stranded[:50]:
            print(f"  {x['move_id']} {x['kind']} worker {x['worker']} {x['src']}->{x['dst']}: "
                  f"{human_bytes(x['bytes_at_risk'])}")
    return 0 if report.healthy else 1
