"""``residency ctl memory``: the memory view of a running server (the same answer as
``GET /admin/memory``), as a table per worker and tier, or ``--json``."""
from __future__ import annotations

import json
import os
import uuid


def register(verbs, add_target_args) -> None:
    m = verbs.add_parser("memory", help="every worker's memory by tier and tenant: used, hot, reclaimable, pinned")
    add_target_args(m)
    m.add_argument("--probe-timeout-ms", type=int, default=1000,
                   help="how long to wait for each worker's probe (default 1000)")
    m.set_defaults(func=run)


def _b(v) -> str:
    from residency.control.views import human_bytes  # noqa: PLC0415

    return "unknown" if v is None else human_bytes(v)


def render(view: dict) -> str:
    lines = [f"memory at seq {view['last_seq']}"]
    for w in view["workers"]:
        s = w.get("sizing")
        lines.append(f"worker {w['worker']} ({w['device']}), blocks of {_b(w['block_bytes'])}")
        if s is not None:
            if s["how"] == "explicit":
                lines.append(f"  pool: {s['num_blocks']} blocks, --device-blocks")
            else:
                lines.append(f"  pool: {s['num_blocks']} blocks = {s['fraction']} x {_b(s['total_bytes'])} - "
                             f"{_b(s['in_use_bytes'])} in use - {_b(s['reserve_bytes'])} reserve")
        if w.get("weights"):
            lines.append(f"  weights: {w['weights']}")
        p = w["probe"]
        lines.append(f"  probe: {'answered' if p['answered'] else 'NO ANSWER (unknown)'}; device total "
                     f"{_b(p['device_total_bytes'])}, free {_b(p['device_free_bytes'])}, allocator "
                     f"{_b(p['allocator_allocated_bytes'])}; pinned {_b(p['pinned_in_use_bytes'])}")
        lines.append(f"  {'tier':<7}{'capacity':>12}{'used':>12}{'hot':>12}{'reclaimable':>13}{'pinned':>12}")
        for t, tv in w["tiers"].items():
            hot = _b(tv["hot_bytes"]) + ("" if tv["hotness_known"] else "*")
            lines.append(f"  {t:<7}{_b(tv['capacity_bytes']):>12}{_b(tv['used_bytes']):>12}{hot:>12}"
                         f"{_b(tv['reclaimable_bytes']):>13}{_b(tv['pinned_bytes']):>12}")
            ten = {k: v for k, v in tv["tenants"].items() if v}
            if ten:
                lines.append("         " + ", ".join(f"{k} {_b(v) if isinstance(v, int) else v}" for k, v in ten.items()))
    if any(not tv["hotness_known"] for w in view["workers"] for tv in w["tiers"].values()):
        lines.append("* hotness unknown: every resident page counted hot")
    return "\n".join(lines)


def run(args) -> int:
    from residency.control.cli.ctl_cmd import ask_server  # noqa: PLC0415
    from residency.control.cli.main import UserError  # noqa: PLC0415
    from residency.events.asks import AskMemory  # noqa: PLC0415

    reply = ask_server(args, AskMemory(ask_id=f"ctl-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                                       probe_timeout_ms=args.probe_timeout_ms))
    if type(reply).__name__ != "MemoryAnswer":
        raise UserError(f"{getattr(reply, 'error', '?')}: {getattr(reply, 'detail', reply)}")
    view = json.loads(reply.view)
    print(json.dumps(view, indent=2) if args.json else render(view))
    return 0
