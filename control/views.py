"""What an operator reads: a State turned into a summary (for --json) and into text tables."""
from __future__ import annotations

from datetime import datetime, timezone

from residency.events.catalog import TIERS
from residency.control.state import State, check_integrity, IntegrityError


def iso(ts_ns: int) -> str:
    if not ts_ns:
        return "-"
    return datetime.fromtimestamp(ts_ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def summarize(state: State) -> dict:
    """Everything `residency replay` shows, as plain data."""
    try:
        check_integrity(state)
        integrity = "ok"
    except IntegrityError as e:
        integrity = str(e)
    workers = []
    for w, ws in sorted(state.workers.items()):
        tiers = {}
        for t in TIERS:
            acc = ws.tiers[t]
            tiers[t] = {
                "capacity_bytes": acc.capacity_bytes, "used_bytes": acc.used_bytes,
                "inflight_in_bytes": acc.inflight_in_bytes, "stranded_bytes": acc.stranded_bytes,
                "reclaimed_bytes": acc.reclaimed_bytes, "floor_bytes": acc.floor_bytes,
                "ceiling_bytes": acc.ceiling_bytes,
            }
        # after a clean stop (ServerStopped) no worker runs: their copies stay in the books until
        # the next start's incarnations say what they kept (WorkerLost), but none is alive
        status = ("alive" if state.server_up else "stopped") if ws.alive else "lost"
        workers.append({
            "worker": w, "device": ws.device, "alive": status == "alive", "status": status,
            "lost_reason": ws.lost_reason,
            "bytes_lost": ws.bytes_lost, "block_bytes": ws.block_bytes, "tiers": tiers,
            "pinned_bytes": sum(ws.pinned.values()), "last_step": ws.last_step,
        })
    per_session: dict[str, dict[str, int]] = {}
    for w, blocks in state.blocks.items():
        for b in blocks.values():
            if b.session is None:
                continue
            counts = per_session.setdefault(b.session, {t: 0 for t in TIERS})
            for t in b.tiers:
                counts[t] += 1
    sessions = []
    for name, s in sorted(state.sessions.items()):
        sessions.append({
            "session": name, "worker": s.worker, "parked_tier": s.parked_tier,
            "blocks_by_tier": per_session.get(name, {t: 0 for t in TIERS}),
            "num_parks": s.num_parks, "num_restores": s.num_restores,
            "restored_tokens": s.restored_tokens, "computed_tokens": s.computed_tokens,
        })
    def move(m):
        return {"move_id": m.move_id, "kind": m.kind, "worker": m.worker, "src": m.src, "dst": m.dst,
                "num_blocks": len(m.blocks), "bytes": m.bytes_planned, "deadline": iso(m.deadline_ns),
                "deadline_ns": m.deadline_ns, "status": m.status, "requested_seq": m.requested_seq,
                "session": m.session}
    return {
        "seq": state.last_seq, "time": iso(state.last_ts_ns), "server_up": state.server_up,
        "integrity": integrity, "workers": workers, "sessions": sessions,
        "moves_in_flight": [move(m) for m in state.inflight.values()],
        "stranded_moves": [move(m) for m in state.stranded.values()],
        "stranded_bytes_total": state.stranded_bytes_total(),
        "arenas": [{"worker": a.worker, "arena": a.arena, "model": a.model, "bytes": a.bytes, "gen": a.gen,
                    "flip_in_flight": a.flip_in_flight, "action": a.action or None,
                    "incoming_model": a.incoming_model, "asleep": a.asleep,
                    "sleep_level": a.sleep_level if a.asleep else None, "stranded": a.stranded,
                    "stranded_bytes": a.stranded_bytes, "num_flips": a.num_flips} for a in state.arenas.values()],
        "rebinds_open": [{"rebind_id": r.rebind_id, "pool": r.pool, "status": r.status, "to_gen": r.to_gen,
                          "readers": r.readers} for r in state.rebinds.values() if r.status != "committed"],
        "requests_waiting_or_running": len(state.requests),
        "moves_by_outcome": dict(sorted(state.num_moves.items())),
        "num_refusals": state.num_refusals,
        "recent_refusals": [{"seq": r.seq, "ask": r.ask, "worker": r.worker, "tier": r.tier,
                             "asked_bytes": r.asked_bytes, "available_bytes": r.available_bytes,
                             "floor_bytes": r.floor_bytes, "reason": r.reason} for r in state.refusals[-5:]],
    }


def _table(headers: list[str], rows: list[list]) -> list[str]:
    cols = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cols]


def render_text(summary: dict, max_rows: int = 20) -> str:
    out = [f"state at seq {summary['seq']} ({summary['time']}), server {'up' if summary['server_up'] else 'down'}",
           f"integrity: {summary['integrity']}", ""]
    rows = []
    for w in summary["workers"]:
        for t, a in w["tiers"].items():
            shown = {"alive": "alive", "stopped": "stopped with the server"}.get(w["status"], f"LOST ({w['lost_reason']})")
            rows.append([w["worker"], w["device"], shown, t,
                         human_bytes(a["capacity_bytes"]), human_bytes(a["used_bytes"]),
                         human_bytes(a["inflight_in_bytes"]), human_bytes(a["stranded_bytes"]),
                         human_bytes(a["reclaimed_bytes"]), human_bytes(a["floor_bytes"])])
    out += ["workers and tiers"] + _table(
        ["worker", "device", "status", "tier", "capacity", "used", "in-flight", "stranded", "reclaimed", "floor"], rows)
    lost = [w for w in summary["workers"] if w["bytes_lost"]]
    for w in lost:
        out.append(f"  worker {w['worker']}: {human_bytes(w['bytes_lost'])} lost with the worker")
    out.append(f"stranded bytes in all: {human_bytes(summary['stranded_bytes_total'])}")
    out.append("")
    sess = summary["sessions"]
    out.append(f"sessions ({len(sess)}; showing {min(len(sess), max_rows)})")
    out += _table(["session", "worker", "parked", "device", "host", "disk", "parks", "restores"],
                  [[s["session"], s["worker"], s["parked_tier"] or "-", s["blocks_by_tier"]["device"],
                    s["blocks_by_tier"]["host"], s["blocks_by_tier"]["disk"], s["num_parks"], s["num_restores"]]
                   for s in sess[-max_rows:]])
    out.append("")
    for title, key in (("moves in flight", "moves_in_flight"), ("stranded moves awaiting a late ack", "stranded_moves")):
        ms = summary[key]
        out.append(f"{title} ({len(ms)})")
        if ms:
            out += _table(["move", "kind", "worker", "route", "blocks", "bytes", "deadline", "status"],
                          [[m["move_id"], m["kind"], m["worker"], f"{m['src']}->{m['dst']}", m["num_blocks"],
                            human_bytes(m["bytes"]), m["deadline"], m["status"]] for m in ms[:max_rows]])
        out.append("")
    out.append("weights arenas")
    out += _table(["worker", "arena", "model", "bytes", "gen", "state", "flip in flight"],
                  [[a["worker"], a["arena"], a["model"], human_bytes(a["bytes"]), a["gen"], _arena_state(a),
                    f"{a['action']} {a['flip_in_flight']}" + (f" -> {a['incoming_model']}" if a["incoming_model"] else "")
                    if a["flip_in_flight"] else "-"]
                   for a in summary["arenas"]])
    out.append("")
    if summary["rebinds_open"]:
        out.append("rebinds not committed")
        out += _table(["rebind", "pool", "status", "to gen", "readers"],
                      [[r["rebind_id"], r["pool"], r["status"], r["to_gen"], r["readers"]] for r in summary["rebinds_open"][-max_rows:]])
        out.append("")
    out.append(f"moves by outcome: {summary['moves_by_outcome']}; refusals: {summary['num_refusals']}; "
               f"requests waiting or running: {summary['requests_waiting_or_running']}")
    for r in summary["recent_refusals"]:
        out.append(f"  refused seq {r['seq']} {r['ask']} on worker {r['worker']} {r['tier']}: asked "
                   f"{human_bytes(r['asked_bytes'])}, available {human_bytes(r['available_bytes'])}, "
                   f"floor {human_bytes(r['floor_bytes'])} ({r['reason']})")
    return "\n".join(out)


def diff_summaries(a: dict, b: dict) -> list[str]:
    """What changed between two summaries, one line per change."""
    out = [f"from seq {a['seq']} ({a['time']}) to seq {b['seq']} ({b['time']})"]
    wa = {w["worker"]: w for w in a["workers"]}
    for w in b["workers"]:
        old = wa.get(w["worker"])
        if old is None:
            out.append(f"+ worker {w['worker']} joined ({w['device']})")
            continue
        if old["status"] != w["status"]:
            out.append(f"~ worker {w['worker']}: {old['status']} -> {w['status']}")
        for t, acc in w["tiers"].items():
            for k, v in acc.items():
                dv = v - old["tiers"][t][k]
                if dv:
                    out.append(f"~ worker {w['worker']} {t} {k}: {human_bytes(old['tiers'][t][k])} -> "
                               f"{human_bytes(v)} ({'+' if dv > 0 else '-'}{human_bytes(abs(dv))})")
    ma = {m["move_id"] for m in a["moves_in_flight"]}
    mb = {m["move_id"] for m in b["moves_in_flight"]}
    for m in sorted(mb - ma):
        out.append(f"+ move {m} in flight")
    for m in sorted(ma - mb):
        out.append(f"- move {m} finished")
    sa = {s["session"]: s for s in a["sessions"]}
    for s in b["sessions"]:
        old = sa.get(s["session"])
        if old is None:
            out.append(f"+ session {s['session']} ({s['blocks_by_tier']})")
        elif old["blocks_by_tier"] != s["blocks_by_tier"] or old["parked_tier"] != s["parked_tier"]:
            out.append(f"~ session {s['session']}: blocks {old['blocks_by_tier']} -> {s['blocks_by_tier']}, "
                       f"parked {old['parked_tier'] or '-'} -> {s['parked_tier'] or '-'}")
    for k in ("stranded_bytes_total", "num_refusals"):
        if a[k] != b[k]:
            out.append(f"~ {k}: {a[k]} -> {b[k]}")
    for k in sorted(set(a["moves_by_outcome"]) | set(b["moves_by_outcome"])):
        d = b["moves_by_outcome"].get(k, 0) - a["moves_by_outcome"].get(k, 0)
        if d:
            out.append(f"~ {k}: +{d}")
    if len(out) == 1:
        out.append("no change")
    return out


def _arena_state(a: dict) -> str:
    if a.get("stranded"):
        return f"STRANDED by {a['stranded']} ({human_bytes(a['stranded_bytes'])} unknown)"
    if a.get("asleep"):
        return f"asleep (level {a['sleep_level']})"
    return "serving"
