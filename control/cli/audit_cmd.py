"""`residency audit reclaimed|stranded|tenants|experts`: totals and the moves behind them.

The answers come from the SQL views ``residency_reclaimed`` and ``residency_stranded`` (created
by a migration), so the CLI and an auditor's own SQL agree by construction.

``tenants``: device bytes each outside tenant was granted (TenantReclaimed), gave back
(TenantReleased) and holds, from the audit columns of those events (``kind`` is the tenant).

``experts``: an offloaded MoE model's experts per tier and over time (control/cli/audit_experts.py).

The views read the audit columns, which are outside the hash chain, so the ledger is verified
first (chain, payloads, and every row's columns against its payload): a ledger that does not
verify gets no totals, only the seq that failed.
"""
from __future__ import annotations

import json

from sqlalchemy import text

from residency.control.cli.common import add_db_arg, open_store, parse_time_ns
from residency.control.cli.main import UserError
from residency.control.views import human_bytes, iso

GROUP_COLUMNS = {
    "reclaimed": {"tier": "tier", "worker": "worker", "session": "session", "kind": "cause"},
    "stranded": {"tier": "tier", "worker": "worker", "session": "session", "kind": "why"},
}


def register(sub) -> None:
    p = sub.add_parser("audit", help="reclaimed or stranded bytes: totals and the moves behind them")
    p.add_argument("what", choices=["reclaimed", "stranded", "tenants", "experts"],
                   help="reclaimed: bytes freed as workers reported; stranded: bytes of moves nobody answered; "
                        "tenants: device bytes granted to outside tenants, given back, and held; "
                        "experts: an offloaded MoE model's expert bytes per tier and expert over time")
    add_db_arg(p)
    p.add_argument("--by", choices=["tier", "worker", "session", "kind"], default="tier",
                   help="group the totals by (default tier; kind: the cause or the why)")
    p.add_argument("--since", metavar="TIME", help="ISO 8601 or ns since the epoch")
    p.add_argument("--until", metavar="TIME", help="ISO 8601 or ns since the epoch")
    p.add_argument("--limit", type=int, default=20, help="how many rows behind the totals to list (default 20)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def _window(since_ns: int | None, until_ns: int | None) -> tuple[list[str], dict]:
    """SQL conditions (and their parameters) keeping the rows of ``ts_ns`` in [since, until]; an
    end that is None is open."""
    where, params = [], {}
    if since_ns is not None:
        where.append("ts_ns >= :since")
        params["since"] = since_ns
    if until_ns is not None:
        where.append("ts_ns <= :until")
        params["until"] = until_ns
    return where, params


def query(store, what: str, by: str, since_ns: int | None, until_ns: int | None, limit: int):
    view = f"residency_{what}"
    col = GROUP_COLUMNS[what][by]
    where, params = _window(since_ns, until_ns)
    cond = (" WHERE " + " AND ".join(where)) if where else ""
    with store.engine.connect() as conn:
        totals = conn.execute(text(
            f"SELECT {col} AS grp, SUM(bytes) AS total, COUNT(*) AS n FROM {view}{cond} "
            f"GROUP BY {col} ORDER BY total DESC"), params).all()
        rows = conn.execute(text(
            f"SELECT * FROM {view}{cond} ORDER BY bytes DESC, seq LIMIT :limit"), {**params, "limit": limit}
        ).mappings().all()
    return [(r.grp, int(r.total or 0), int(r.n)) for r in totals], [dict(r) for r in rows]


def tenants(store, since_ns: int | None, until_ns: int | None) -> list[dict]:
    """Per outside tenant and worker: bytes granted, released, held, and how many reclaims failed."""
    where, params = _window(since_ns, until_ns)
    where.insert(0, "type IN ('TenantReclaimed', 'TenantReleased', 'TenantReclaimFailed')")
    with store.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT kind, worker, type, SUM(bytes) AS total, COUNT(*) AS n FROM events WHERE "
            + " AND ".join(where) + " GROUP BY kind, worker, type ORDER BY kind, worker"), params).all()
    out: dict[tuple, dict] = {}
    for kind, worker, type_, total, n in rows:
        row = out.setdefault((kind, worker), {"tenant": kind, "worker": worker, "granted_bytes": 0,
                                              "released_bytes": 0, "num_reclaims": 0, "num_failed": 0})
        if type_ == "TenantReclaimed":
            row["granted_bytes"], row["num_reclaims"] = int(total or 0), int(n)
        elif type_ == "TenantReleased":
            row["released_bytes"] = int(total or 0)
        else:
            row["num_failed"] = int(n)
    for row in out.values():
        row["held_bytes"] = row["granted_bytes"] - row["released_bytes"]
    return list(out.values())


def run(args) -> int:
    since = parse_time_ns(args.since) if args.since else None
    until = parse_time_ns(args.until) if args.until else None
    if since is not None and until is not None and since > until:
        raise UserError("--since is after --until")
    with open_store(args.db) as store:
        report = store.verify()
        if not report.ok:
            raise UserError(f"no audit of a ledger that does not verify: {report.problem} "
                            f"(`residency ledger verify --db {store.url}` says more)")
        if args.what == "tenants":
            return _answer("tenants", "tenants", tenants(store, since, until), args.json, NO_TENANTS, _print_tenants)
        if args.what == "experts":
            from residency.control.cli.audit_experts import NO_EXPERTS, expert_rows, print_experts  # noqa: PLC0415

            return _answer("experts", "workers", expert_rows(store, since, until, args.limit), args.json,
                           NO_EXPERTS, print_experts)
        totals, rows = query(store, args.what, args.by, since, until, args.limit)
    return _print_totals(args.what, args.by, totals, rows, args.json)


def _print_totals(what: str, by: str, totals: list[tuple], rows: list[dict], as_json: bool) -> int:
    grand = sum(t for _, t, _ in totals)
    if as_json:
        print(json.dumps({"what": what, "by": by, "total_bytes": grand,
                          "groups": [{"group": g, "bytes": t, "rows": n} for g, t, n in totals],
                          "behind": rows}, indent=2, default=str))
        return 0
    print(f"{what} bytes by {by}: {human_bytes(grand)} ({grand} B) in all")
    for g, t, n in totals:
        print(f"  {str(g):<24} {human_bytes(t):>12}  ({t} B, {n} rows)")
    if rows:
        print(f"\nlargest {len(rows)} behind them:")
        for r in rows:
            extra = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("seq", "ts_ns", "bytes") and v is not None)
            print(f"  seq {r['seq']:>8}  {iso(r['ts_ns'])}  {human_bytes(r['bytes']):>10}  {extra}")
    return 0


def _answer(what: str, key: str, rows: list[dict], as_json: bool, none_line: str, print_rows) -> int:
    """An audit's rows as JSON (``{"what": what, key: rows}``), else the line saying there are none,
    else drawn by ``print_rows``."""
    if as_json:
        print(json.dumps({"what": what, key: rows}, indent=2))
    elif not rows:
        print(none_line)
    else:
        print_rows(rows)
    return 0


NO_TENANTS = "no outside tenant was granted device memory"


def _print_tenants(rows: list[dict]) -> None:
    print(f"  {'tenant':<16}{'worker':>7}{'granted':>14}{'released':>14}{'held':>14}{'reclaims':>10}{'failed':>8}")
    for r in rows:
        print(f"  {r['tenant']:<16}{r['worker']:>7}{human_bytes(r['granted_bytes']):>14}"
              f"{human_bytes(r['released_bytes']):>14}{human_bytes(r['held_bytes']):>14}{r['num_reclaims']:>10}"
              f"{r['num_failed']:>8}")
