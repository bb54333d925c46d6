"""`residency ctl`: ask the running control process for moves by hand, and print what happened.

    residency ctl park    --session S [--worker W] [--to host|disk]
    residency ctl restore (--session S | --blocks 1,2,3) [--worker W] [--from host|disk] [--keep-source]
    residency ctl spill   (--session S | --blocks ...) [--to host|disk]      (keeps the device copy)
    residency ctl evict   (--session S | --blocks ...) [--to host|disk]      (frees the device copy)
    residency ctl budget  --worker W --tier device --floor 64MiB --ceiling 1GiB
    residency ctl commit  --blocks N [--session S] [--tier device]          (fill blocks with test data)
    residency ctl release --tier T --blocks 1,2,3
    residency ctl reclaim --tenant NAME --bytes 4GiB [--worker W]        (an outside tenant takes device memory)
    residency ctl release --tenant NAME [--worker W]                     (... and gives it back)
    residency ctl resize  --worker W --tier device --bytes 6GiB             (the pool, live; rebinds its readers)
    residency ctl flip    --to NAME [--worker W]                         (the weights arena serves another model)
    residency ctl sleep   [--level 1|2] [--worker W]   /   ctl wake [--worker W]   (the weights leave the device)

The answer is what the ledger recorded: acked with the bytes the worker measured, refused with the
budget's arithmetic, failed or rejected with the reason, stranded with the bytes at risk.
A session already where the verb would put it (a park of a parked session) is done: nothing is
recorded and the answer says where its blocks are.
Exit status: 0 done, 1 refused/failed/rejected/stranded/abandoned, 2 the ask was invalid or nobody answered.
"""
from __future__ import annotations

import json
import os
import re
import uuid

from residency.control.cli.common import add_db_arg
from residency.control.cli.main import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "mi": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "gi": 1 << 30,
          "t": 10**12, "tb": 10**12, "tib": 1 << 40, "ti": 1 << 40}
BAD = ("MoveRefused", "MoveFailed", "MoveRejected", "MoveStranded", "MoveAbandoned", "RebindTorn", "RebindRefused",
       "TenantReclaimFailed", "FlipFailed")


def parse_size(text: str) -> int:
    """'64MiB', '1.5 GiB', '4096' -> bytes."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 4096, 64MiB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_blocks(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    return out


def add_target_args(p, run_dir: bool = True) -> None:
    add_db_arg(p)
    p.add_argument("--run-dir", help="the server's run dir (default: derived from the ledger URL)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the answer")
    p.add_argument("--json", action="store_true", help="print the recorded events as JSON")


def register(sub) -> None:
    p = sub.add_parser("ctl", help="ask the running server for a move, a budget, a commit or a release")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    for kind, help_ in (("park", "move every device block of a session to host (frees the device)"),
                        ("restore", "bring blocks back to the device (checksum verified)"),
                        ("spill", "copy blocks to a slower tier, keeping the source"),
                        ("evict", "move blocks to a slower tier, freeing the source"),
                        ("demote", "move host blocks to disk"), ("promote", "copy disk blocks to host")):
        v = verbs.add_parser(kind, help=help_)
        add_target_args(v)
        v.add_argument("--worker", type=int, default=0, help="the worker to ask (default 0)")
        what = v.add_mutually_exclusive_group(required=True)
        what.add_argument("--session", help="every block of this session")
        what.add_argument("--blocks", type=parse_blocks, help="block ids: 1,2,5-9")
        v.add_argument("--from", dest="src", choices=("device", "host", "disk"),
                       help="source tier (default: the verb's; restore: host, else disk)")
        v.add_argument("--to", dest="dst", choices=("device", "host", "disk"),
                       help="destination tier (default: the verb's)")
        keep = v.add_mutually_exclusive_group()
        keep.add_argument("--keep-source", dest="keep", action="store_true", default=None,
                          help="keep the source copy (default: spill and promote keep it, the others free it)")
        keep.add_argument("--free-source", dest="keep", action="store_false", help="free the source copy once the copy lands")
        v.set_defaults(func=run, kind=kind)
    from residency.control.cli import memory_cmd  # noqa: PLC0415

    memory_cmd.register(verbs, add_target_args)
    b = verbs.add_parser("budget", help="set a tier's floor and ceiling")
    add_target_args(b)
    b.add_argument("--worker", type=int, default=0, help="the worker to ask (default 0)")
    b.add_argument("--tier", choices=("device", "host", "disk"), required=True, help="the tier whose budget is set")
    b.add_argument("--floor", type=parse_size, default=0, metavar="SIZE",
                   help="headroom no move may take (the serving path's reserve), e.g. 256MiB (default 0)")
    b.add_argument("--ceiling", type=parse_size, default=0, help="0 = the tier's capacity")
    b.set_defaults(func=run, kind="budget")
    c = verbs.add_parser("commit", help="fill new blocks with seeded test bytes (demos, tests)")
    add_target_args(c)
    c.add_argument("--worker", type=int, default=0, help="the worker to ask (default 0)")
    c.add_argument("--blocks", type=int, required=True, help="how many blocks")
    c.add_argument("--session", help="the session that owns the new blocks (default: none)")
    c.add_argument("--tier", choices=("device", "host", "disk"), default="device",
                   help="where the blocks are written (default device)")
    c.add_argument("--seed", type=int, default=0, help="seed of the test bytes (default 0)")
    c.set_defaults(func=run, kind="commit")
    r = verbs.add_parser("release", help="free blocks' copies on one tier, or give an outside tenant's grant back")
    add_target_args(r)
    r.add_argument("--worker", type=int, default=0, help="the worker to ask (default 0)")
    r.add_argument("--tier", choices=("device", "host", "disk"), help="the tier whose copies are freed")
    r.add_argument("--blocks", type=parse_blocks, help="block ids: 1,2,5-9")
    r.add_argument("--tenant", help="instead: the outside tenant whose whole grant on --worker goes back to the "
                                    "device pool (the pool grows by it)")
    r.set_defaults(func=run, kind="release")
    g = verbs.add_parser("reclaim", help="an outside tenant takes device memory: pool slots are emptied by its "
                                         "routes, then the device pool shrinks by the ask (whole pages)")
    add_target_args(g)
    g.add_argument("--worker", type=int, default=0, help="the worker to ask (default 0)")
    g.add_argument("--tenant", required=True, help="the tenant, as declared with serve --tenant")
    g.add_argument("--bytes", type=parse_size, required=True, metavar="SIZE", help="how much, e.g. 4GiB")
    g.set_defaults(func=run, kind="reclaim")
    z = verbs.add_parser("resize", help="resize a worker's device pool live (a shrink moves the coldest blocks out first)")
    add_target_args(z)
    z.add_argument("--worker", type=int, default=0, help="the worker whose pool is resized (default 0)")
    z.add_argument("--tier", choices=("device", "host", "disk"), default="device",
                   help="the pool (only device can be resized; the others are refused with why)")
    z.add_argument("--bytes", dest="nbytes", type=parse_size, required=True, metavar="SIZE",
                   help="the pool's new size, rounded down to whole blocks, e.g. 6GiB; its current size rebinds in place")
    z.set_defaults(func=run, kind="resize")
    f = verbs.add_parser("flip", help="flip a worker's weights arena to another of the models it was started with "
                                      "(its requests end and its sessions' device pages are parked first)")
    add_target_args(f)
    f.add_argument("--to", dest="to_model", required=True, metavar="NAME", help="the model (serve --model NAME=PATH)")
    f.add_argument("--worker", type=int, default=None, help="the worker (default: the lowest not serving NAME)")
    f.set_defaults(func=run, kind="flip")
    sl = verbs.add_parser("sleep", help="put the weights to sleep: level 1 to pinned host, 2 dropped (every worker "
                                        "unless --worker)")
    add_target_args(sl)
    sl.add_argument("--level", type=int, choices=(1, 2), default=1, help="1: weights to host (default); 2: dropped")
    sl.add_argument("--worker", type=int, default=None, help="one worker (default: every serving worker)")
    sl.set_defaults(func=run, kind="sleep")
    wk = verbs.add_parser("wake", help="wake the weights that slept (every worker unless --worker)")
    add_target_args(wk)
    wk.add_argument("--worker", type=int, default=None, help="one worker (default: every serving worker)")
    wk.set_defaults(func=run, kind="wake")


def ask_of(args):
    from residency.events.asks import (  # noqa: PLC0415
        AskCommitBlocks, AskFlip, AskMove, AskReclaim, AskReleaseBlocks, AskReleaseTenant, AskResize, AskSetBudget,
    )

    ask_id = f"ctl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if args.kind in ("flip", "sleep", "wake"):
        return AskFlip(ask_id=ask_id, action=args.kind, to_model=getattr(args, "to_model", "") or "",
                       worker=args.worker, level=getattr(args, "level", 1))
    if args.kind == "resize":
        return AskResize(ask_id=ask_id, worker=args.worker, tier=args.tier, bytes=args.nbytes)
    if args.kind == "budget":
        return AskSetBudget(ask_id=ask_id, worker=args.worker, tier=args.tier, floor_bytes=args.floor,
                            ceiling_bytes=args.ceiling)
    if args.kind == "commit":
        return AskCommitBlocks(ask_id=ask_id, worker=args.worker, session=args.session, tier=args.tier,
                               num_blocks=args.blocks, seed=args.seed)
    if args.kind == "reclaim":
        if args.bytes <= 0:
            raise UserError(f"--bytes must be > 0, not {args.bytes}")
        return AskReclaim(ask_id=ask_id, tenant=args.tenant, worker=args.worker, bytes=args.bytes)
    if args.kind == "release":
        if args.tenant is not None:
            if args.tier or args.blocks:
                raise UserError("release: --tenant gives a tenant's grant back; --tier/--blocks free blocks: not both")
            return AskReleaseTenant(ask_id=ask_id, tenant=args.tenant, worker=args.worker)
        if not args.tier or not args.blocks:
            raise UserError("release: give --tier and --blocks (free blocks' copies) or --tenant (a tenant's grant)")
        return AskReleaseBlocks(ask_id=ask_id, worker=args.worker, tier=args.tier, blocks=args.blocks)
    return AskMove(ask_id=ask_id, kind=args.kind, worker=args.worker, blocks=args.blocks or [],
                   session=args.session, src=args.src, dst=args.dst, keep_source=args.keep)


def client_for(args):
    from pathlib import Path  # noqa: PLC0415

    from residency.control.cli.run_dir import check_private  # noqa: PLC0415
    from residency.control.transport import AskClient, ask_endpoint, default_run_dir  # noqa: PLC0415
    from residency.events.handshake import PeerKeyError, key_in  # noqa: PLC0415

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.db)
    if not server_running(run_dir):
        raise UserError(f"no server is running on this ledger (run dir {run_dir}); start `residency serve`")
    check_private(run_dir)      # a socket in a directory others control may not be our server's
    try:
        key = key_in(run_dir)
    except PeerKeyError as e:
        raise UserError(str(e)) from None
    return AskClient(ask_endpoint(run_dir), timeout_s=args.timeout, key=key)


def server_running(run_dir) -> bool:
    """`residency serve` holds an exclusive lock on <run dir>/serve.lock while it runs; the kernel
    drops it when the process dies, however it dies (a leftover socket file proves nothing)."""
    import fcntl  # noqa: PLC0415

    try:
        fd = os.open(run_dir / "serve.lock", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def ask_server(args, msg):
    from residency.control.transport import TransportError  # noqa: PLC0415

    try:
        reply = client_for(args).ask(msg)
    except TransportError as e:
        raise UserError(str(e)) from e
    if type(reply).__name__ == "ErrorReply":
        raise UserError(f"{reply.error}: {reply.detail}")
    return reply


def describe(seq: int, e) -> str:
    from residency.control.views import human_bytes as hb  # noqa: PLC0415

    t = type(e).__name__
    at = f"(seq {seq})"
    if t in ("MoveAcked", "MoveLateAcked"):
        ms = (e.finished_ns - e.started_ns) / 1e6
        return (f"{'acked' if t == 'MoveAcked' else 'late-acked'} {e.move_id} on worker {e.worker}: moved "
                f"{hb(e.bytes_moved)}, freed {hb(e.bytes_freed_src)} at the source, checksum "
                f"{'ok' if e.checksum_ok else 'MISMATCH'}, {ms:.2f} ms {at}")
    if t == "MoveRefused":
        return (f"refused ({e.ask}): asked {hb(e.asked_bytes)} on {e.tier} of worker {e.worker}, available "
                f"{hb(e.available_bytes)} above the floor of {hb(e.floor_bytes)}: {e.reason} {at}")
    if t == "MoveFailed":
        moved = "not measured" if e.bytes_moved is None else hb(e.bytes_moved)
        return f"failed {e.move_id} on worker {e.worker}: {e.error} (moved: {moved}) {at}"
    if t == "MoveRejected":
        avail = "not measured" if e.available_bytes is None else hb(e.available_bytes)
        return (f"rejected by worker {e.worker}: {e.move_id}: {e.reason} (asked {hb(e.asked_bytes)}, "
                f"available {avail}) {at}")
    if t == "MoveStranded":
        return f"stranded {e.move_id} on worker {e.worker}: {hb(e.bytes_at_risk)} at risk ({e.why}) {at}"
    if t == "MoveAbandoned":
        return f"abandoned {e.move_id} on worker {e.worker}: {e.why} {at}"
    if t == "BlocksCommitted":
        ids = f"{e.blocks[0]}..{e.blocks[-1]}" if e.blocks else "-"
        return (f"committed {len(e.blocks)} blocks ({ids}) on {e.tier} of worker {e.worker}, "
                f"session {e.session or '-'}: {hb(e.bytes)} {at}")
    if t == "CopiesReleased":
        return f"released {len(e.blocks)} blocks on {e.tier} of worker {e.worker}: {hb(e.bytes)} freed ({e.move_id}) {at}"
    if t == "BlocksFreed":
        return f"freed {len(e.blocks)} blocks on {e.tier} of worker {e.worker}: {hb(e.bytes)} ({e.reason}) {at}"
    if t == "BudgetSet":
        return (f"budget of {e.tier} on worker {e.worker}: floor {hb(e.floor_bytes)}, ceiling "
                f"{hb(e.ceiling_bytes) if e.ceiling_bytes else 'capacity'} {at}")
    if t == "SessionParked":
        return f"session {e.session} parked on {e.tier}: {hb(e.bytes)} {at}"
    if t == "SessionRestored":
        return f"session {e.session} restored: {e.restored_tokens} tokens {at}"
    if t == "TenantReclaimed":
        measured = "not measured" if e.measured_bytes is None else hb(e.measured_bytes)
        return (f"reclaimed for tenant {e.tenant} on worker {e.worker}: the device pool gave up {hb(e.granted_bytes)} "
                f"(asked {hb(e.asked_bytes)}); the moves freed {hb(e.freed_bytes)} ({len(e.moves)} moves, sessions "
                f"{', '.join(e.sessions) or '-'}); the driver measured {measured} freed; rebind {e.rebind_id} {at}")
    if t == "TenantReclaimFailed":
        stranded = (f"; {hb(e.stranded_bytes)} stranded on the way ({', '.join(e.stranded_moves)})"
                    if e.stranded_moves else "")
        return f"reclaim for tenant {e.tenant} on worker {e.worker} FAILED, nothing granted: {e.reason}{stranded} {at}"
    if t == "TenantReleased":
        measured = "not measured" if e.measured_bytes is None else hb(e.measured_bytes)
        return (f"released by tenant {e.tenant} on worker {e.worker}: the device pool grew back by {hb(e.bytes)} "
                f"(the driver measured {measured} taken); rebind {e.rebind_id} {at}")
    if t == "RebindRequested":
        return (f"rebind {e.rebind_id} of the {e.pool} pool of worker {e.worker} requested: gen {e.from_gen} -> "
                f"{e.to_gen}, readers {', '.join(e.readers)} {at}")
    if t == "ReaderStamped":
        return f"reader {e.reader} stamped gen {e.gen} ({e.rebind_id}) {at}"
    if t == "PoolResized":
        freed = "not measured" if e.measured_freed_bytes is None else hb(e.measured_freed_bytes)
        return (f"{e.pool} pool of worker {e.worker} resized {hb(e.from_bytes)} -> {hb(e.to_bytes)} at gen {e.gen}; "
                f"measured freed: {freed} {at}")
    if t == "RebindCommitted":
        return f"rebind {e.rebind_id} committed: every reader carries the new generation {at}"
    if t == "RebindTorn":
        return (f"rebind {e.rebind_id} TORN: readers behind {', '.join(e.readers_behind)}; the pool is refused until "
                f"a complete resize repairs it {at}")
    if t == "FlipRequested":
        what = {"flip": f"flip {e.from_model!r} -> {e.to_model!r}", "sleep": f"sleep level {e.level} of {e.from_model!r}",
                "wake": f"wake {e.to_model!r}"}.get(e.action, e.action)
        kv = "" if e.kv_pool_bytes is None else f"; its wake grows the KV pool back to {hb(e.kv_pool_bytes)}"
        return (f"{what} on worker {e.worker} requested ({e.flip_id}): {hb(e.bytes_out)} out, {hb(e.bytes_in)} in, "
                f"arena gen -> {e.to_gen}{kv} {at}")
    if t == "FlipCompleted":
        freed = "not measured" if e.measured_freed_bytes is None else hb(e.measured_freed_bytes)
        return (f"flip {e.flip_id} completed on worker {e.worker}: {hb(e.bytes_out)} out, {hb(e.bytes_in)} in, "
                f"{hb(e.dropped_bytes)} dropped, {e.overlapped_steps}/{e.steps} steps overlapped, "
                f"{(e.finished_ns - e.started_ns) / 1e6:.1f} ms, checksum {'ok' if e.checksum_ok else 'MISMATCH'}, "
                f"measured freed: {freed} {at}")
    if t == "FlipFailed":
        if e.stranded:
            nb = "unknown" if e.stranded_bytes is None else hb(e.stranded_bytes)
            return f"flip {e.flip_id} STRANDED ({nb} of the arena unknown): {e.error} {at}"
        return f"flip {e.flip_id} failed, nothing changed: {e.error} {at}"
    if t == "RebindRefused":
        return f"rebind {e.rebind_id} refused by worker {e.worker}, nothing changed: {e.error} {at}"
    return f"{t} {at}"


def describe_group(events) -> str:
    """The group's figure of a tensor-parallel group's reclaim or release (one event per rank):
    the ranks' bytes summed, measured only when every rank was; "" for a worker alone."""
    from residency.control.views import human_bytes as hb  # noqa: PLC0415

    for name, field, verb in (("TenantReclaimed", "granted_bytes", "gave up"), ("TenantReleased", "bytes", "took back")):
        ranks = [e for e in events if type(e).__name__ == name]
        if len(ranks) > 1:
            measured = [e.measured_bytes for e in ranks]
            said = "not measured" if None in measured else hb(sum(measured))
            total = hb(sum(getattr(e, field) for e in ranks))
            return (f"the group's pools (workers {', '.join(str(e.worker) for e in ranks)}) {verb} {total} for "
                    f"tenant {ranks[0].tenant}; the driver measured {said}")
    return ""


def run(args) -> int:
    from residency.events.codec import event_to_display_obj  # noqa: PLC0415

    reply = ask_server(args, ask_of(args))
    if reply.error:
        raise UserError(f"{reply.error}: {reply.detail}")
    if args.json:
        print(json.dumps({"ask_id": reply.ask_id, "move_ids": reply.move_ids,
                          "events": [dict(seq=s, **event_to_display_obj(e)) for s, e in zip(reply.seqs, reply.events)],
                          "detail": reply.detail or None},
                         indent=2))
    else:
        for seq, e in zip(reply.seqs, reply.events):
            print(describe(seq, e))
        if not reply.events and reply.detail:       # nothing to do (a park of a parked session)
            print(reply.detail)
        group = describe_group(reply.events)
        if group:
            print(group)
    from residency.control.flip import is_pool_refusal  # noqa: PLC0415

    # a sleep whose KV pool the dial would not shrink still slept: the refusal is shown, not failed on
    return 1 if any(type(e).__name__ in BAD and not is_pool_refusal(e) for e in reply.events) else 0
