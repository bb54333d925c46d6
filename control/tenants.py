"""Outside tenants: who may ask this server for device memory, and in which order the server
frees pool slots for each of them. Pure.

A tenant is declared at start (``residency serve --tenant trainer=park,evict``); an ask naming
any other is refused with the names that are declared. A route is one way to empty pool slots:

    prefixes   drop idle retained prefixes (sessions named "~..."): a cache nobody owns; only a
               release, nothing is copied, and the next request that wanted it recomputes it
    park       move idle sessions whole to host: one batched copy per session; its next turn
               restores the conversation instead of recomputing it
    evict      move single idle pages to host, coldest first: the finest grain, so it can stop at
               exactly the slots still missing, but it leaves sessions split across tiers

The default order is that list: what is cheapest to lose goes first, whole sessions before
scattered pages (a parked session comes back in one move; pages evicted from many sessions
make each of their next turns restore).
"""
from __future__ import annotations

import re

import msgspec

ROUTES: tuple[str, ...] = ("prefixes", "park", "evict")
DEFAULT_ROUTES: tuple[str, ...] = ROUTES
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class TenantError(ValueError):
    """A tenant declaration or name that cannot be used; the message says why."""


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    routes: tuple[str, ...] = DEFAULT_ROUTES


def parse_tenant(spec: str) -> Tenant:
    """``NAME`` or ``NAME=ROUTE,ROUTE,...`` -> a Tenant; raises TenantError."""
    name, eq, routes_text = spec.strip().partition("=")
    name = name.strip()
    if not _NAME.match(name):
        raise TenantError(f"tenant name {name!r}: letters, digits, '_', '.', '-' (at most 64, not starting with "
                          f"a punctuation mark)")
    if not eq:
        return Tenant(name=name)
    routes = tuple(r.strip() for r in routes_text.split(",") if r.strip())
    if not routes:
        raise TenantError(f"tenant {name!r}: no route after '=' (choose from {', '.join(ROUTES)})")
    unknown = [r for r in routes if r not in ROUTES]
    if unknown:
        raise TenantError(f"tenant {name!r}: unknown route(s) {unknown} (choose from {', '.join(ROUTES)})")
    if len(set(routes)) != len(routes):
        raise TenantError(f"tenant {name!r}: a route is named twice in {list(routes)}")
    return Tenant(name=name, routes=routes)


def parse_tenants(specs: list[str] | None) -> dict[str, Tenant]:
    """Every ``--tenant`` given, by name; a name declared twice is an error."""
    out: dict[str, Tenant] = {}
    for spec in specs or []:
        t = parse_tenant(spec)
        if t.name in out:
            raise TenantError(f"tenant {t.name!r} is declared twice")
        out[t.name] = t
    return out


def lookup(tenants: dict[str, Tenant], name: str) -> Tenant:
    """The declared tenant ``name``; raises TenantError naming the declared ones."""
    t = tenants.get(name)
    if t is None:
        declared = ", ".join(sorted(tenants)) or "none (start serve with --tenant NAME)"
        raise TenantError(f"unknown tenant {name!r}; declared: {declared}")
    return t
