"""`residency simulate --events N`: write a realistic, valid ledger for tests, benchmarks and demos."""
from __future__ import annotations

from residency.control.cli.common import add_db_arg, open_store, progress_bar
from residency.control.cli.main import UserError
from residency.control.replay import write_snapshots
from residency.control.simulate import simulate


def register(sub) -> None:
    p = sub.add_parser("simulate", help="write a realistic simulated ledger (spills, parks, restores, faults, ...)")
    add_db_arg(p)
    p.add_argument("--events", type=int, required=True, metavar="N", help="number of events to write")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same ledger (default 0)")
    p.add_argument("--workers", type=int, default=2, help="number of simulated workers (default 2)")
    p.add_argument("--snapshot-every", type=int, default=100_000, metavar="N",
                   help="save a replay snapshot every N events (0: none)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.events <= 0:
        raise UserError("--events must be positive")
    if args.workers <= 0:
        raise UserError("--workers must be positive")
    with open_store(args.db, create=True) as store:
        if store.last_seq() != 0:
            raise UserError(f"the ledger at {args.db} is not empty (last seq {store.last_seq()}); "
                            "simulate writes only into an empty ledger")
        batch = []
        with progress_bar(args.events, "simulate", min_total=50_000) as update:
            for item in simulate(args.events, seed=args.seed, num_workers=args.workers):
                batch.append(item)
                if len(batch) == 5000:
                    store.append(batch)
                    update(len(batch))
                    batch = []
            if batch:
                store.append(batch)
                update(len(batch))
        snaps = write_snapshots(store, args.snapshot_every) if args.snapshot_every else []
        print(f"wrote {store.last_seq()} events to {args.db}" + (f"; snapshots at {snaps}" if snaps else ""))
    return 0
