"""`residency serve`'s options as the control process's config."""
from __future__ import annotations

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
