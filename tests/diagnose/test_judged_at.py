"""``diagnose`` and ``diagnose --at now`` on the same ledger: the same findings for a server that stopped."""
from residency.events import catalog as ev
from residency.control.diagnose import diagnose
from tests.diagnose.ledgers import SECOND


def test_a_ledger_that_ends_with_a_stop_is_judged_the_same_later(L):
    L.add(ev.ServerStarted(version="test", config_digest="d"))
    L.worker(0)
    L.step(0, 1)
    rid, _ = L.admit()                       # cut by the stop: still open
    L.chatter(3)
    blocks = L.commit(0, 4)
    for _ in range(4):                       # pressure swings: a real pendulum, over before the stop
        L.move(0, "spill", "device", "host", blocks, dt_ms=500)
        L.move(0, "restore", "host", "device", blocks, dt_ms=500)
    L.add(ev.ServerStopped(reason="signal SIGTERM"))
    at_stop = diagnose(L.events)
    later = diagnose(L.events, at_ns=L.now + 7 * 24 * 3600 * SECOND)
    assert at_stop.findings and later.findings == at_stop.findings
    assert later.at_ns == at_stop.at_ns
