import os

import pytest

from residency.control.cli.main import main
from tests.diagnose.test_cli import wedged_db  # noqa: F401  (fixture)


def test_report_writes_one_html_file(wedged_db, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out" / "report.html"
    out.parent.mkdir()
    assert main(["report", "--db", wedged_db[0], "-o", str(out)]) == 0
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>") and wedged_db[1] in html
    assert os.listdir(out.parent) == ["report.html"]        # no temporary file left behind
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("target, says", [
    ("missing-dir/report.html", "does not exist"),
    ("a-file/report.html", "does not exist"),
    ("a-dir", "is a directory"),
])
def test_report_to_a_path_that_cannot_be_written_writes_nothing(wedged_db, tmp_path, capsys, target, says):  # noqa: F811
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    before = sorted(os.listdir(tmp_path))
    assert main(["report", "--db", wedged_db[0], "-o", str(tmp_path / target)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "a-dir") == []


def test_report_of_a_file_that_is_not_a_ledger_writes_nothing(tmp_path, capsys):
    junk = tmp_path / "junk.db"
    junk.write_text("not a database " * 50)
    assert main(["report", "--db", f"sqlite:///{junk}", "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    # NOTE: the ledger words this "is not a ledger" or "... failed: file is not a database" depending on
    # where SQLite notices; either names the problem, and neither is a traceback
    assert ("not a ledger" in err or "not a database" in err) and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()


def test_report_at_beyond_the_end_writes_nothing(wedged_db, tmp_path, capsys):  # noqa: F811
    assert main(["report", "--db", wedged_db[0], "-o", str(tmp_path / "r.html"), "--at", "10000000"]) == 2
    assert "beyond the end" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_report_at_a_seq_covers_the_ledger_up_to_it(wedged_db, tmp_path):  # noqa: F811
    url, mid, req, _ = wedged_db
    out = tmp_path / "r.html"
    assert main(["report", "--db", url, "-o", str(out), "--at", str(req.seq - 1)]) == 0
    html = out.read_text()
    assert f"through seq {req.seq - 1}" in html and mid not in html
