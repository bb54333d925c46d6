"""`residency serve`'s options as the control process's config."""
from __future__ import annotations

import os
import random

import pytest

from residency.control.cli.main import build_parser
from residency.control.cli.serve_cmd import build_config


def _park_idle_s(tmp_path, *argv: str) -> float:
    args = build_parser().parse_args(["serve", *argv])
    return build_config(args, tmp_path, ["cpu"]).policy.park_idle_s


def test_one_option_sets_when_an_idle_session_is_parked(tmp_path):
    assert _park_idle_s(tmp_path) == 2.0                       # serving a model: parked soon
    assert _park_idle_s(tmp_path, "--model", "none") == 30.0   # no model: an operator's sessions wait longer
    assert _park_idle_s(tmp_path, "--park-after-s", "7") == 7.0
    assert _park_idle_s(tmp_path, "--model", "none", "--park-after-s", "0.5") == 0.5


def test_the_old_second_spelling_of_the_park_delay_is_gone():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--park-idle-s", "5"])


def test_the_wait_for_a_dead_workers_next_incarnation_is_an_option(tmp_path):
    wait = random.uniform(1, 500)
    args = build_parser().parse_args(["serve", "--replace-wait-s", str(wait)])
    assert build_config(args, tmp_path, ["cpu"]).replace_wait_s == wait
    assert build_config(build_parser().parse_args(["serve"]), tmp_path, ["cpu"]).replace_wait_s == 120.0


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_the_admin_key_can_come_from_a_file(tmp_path):
    from residency.control.cli.main import UserError
    from residency.control.cli.serve_cmd import admin_key

    path = tmp_path / "admin.key"
    path.write_text("s3cret-" + os.urandom(8).hex() + "\n")
    path.chmod(0o600)
    assert admin_key(_serve_args("--admin-key-file", str(path))) == path.read_text().strip()
    assert admin_key(_serve_args("--admin-key", "k1")) == "k1"
    assert admin_key(_serve_args()) is None
    path.write_text("\n")
    with pytest.raises(UserError, match="is empty"):
        admin_key(_serve_args("--admin-key-file", str(path)))
    with pytest.raises(UserError, match="No such file"):
        admin_key(_serve_args("--admin-key-file", str(tmp_path / "missing")))
    with pytest.raises(SystemExit):       # one setting, one option at a time
        _serve_args("--admin-key", "k", "--admin-key-file", str(path))


@pytest.mark.parametrize("host,key,warned", [
    ("0.0.0.0", None, True), ("192.168.1.7", None, True), ("::", None, True), ("myhost", None, True),
    ("0.0.0.0", "k", False), ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False),
])
def test_open_admin_routes_on_a_reachable_address_are_warned_of(host, key, warned):
    from structlog.testing import capture_logs

    from residency.control.cli.serve_cmd import warn_if_open

    with capture_logs() as logs:
        assert warn_if_open(host, key) is warned
    assert [e["event"] for e in logs] == (["admin_routes_open"] if warned else [])
