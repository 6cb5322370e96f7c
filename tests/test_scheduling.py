"""`make test`'s two-worker schedule (tests/scheduling.py) on a small suite of its own, run by pytest-xdist exactly as
the Makefile runs the real one: every file's tests on one worker, so a module fixture starts once; a SPREAD file's
tests handed out one by one; the heaviest file first. (The xdist_group marks this replaced grouped nothing under
pytest 9.2, and no test noticed.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FILE = """
import os, time, pytest

@pytest.fixture(scope="module")
def started():
    with open({log!r}, "a") as f:
        f.write("{name} " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(4))
def test_one(started, i):
    time.sleep(0.2)
"""


def test_make_tests_xdist_schedule_keeps_a_file_on_one_worker_and_spreads_the_independent_runs(tmp_path):
    log = tmp_path / "fixtures.log"
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from scheduling import pytest_collection_modifyitems, pytest_xdist_make_scheduler  # noqa: F401\n"
    )
    # A heavy file, an unlisted one and a SPREAD one, under the names the real schedule knows.
    for name in ("test_workflow.py", "test_reliability.py", "test_golden.py"):
        (suite / name).write_text(FILE.format(log=str(log), name=name))
    (line,) = [line for line in (TESTS.parent / "Makefile").read_text().splitlines() if line.startswith("XDIST")]
    xdist = line.split("=", 1)[1].replace("$(TEST_WORKERS)", "2").split()  # the flags `make test` passes
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *xdist, "-v", str(suite)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    starts = [line.split() for line in log.read_text().splitlines()]
    per_file = {name: [w for n, w in starts if n == name] for name in ("test_workflow.py", "test_reliability.py")}
    assert all(len(workers) == 1 for workers in per_file.values()), starts  # one start: one worker ran the file
    golden = {w for n, w in starts if n == "test_golden.py"}
    assert golden == {"gw0", "gw1"}, starts  # its tests went out one by one, to both workers
    order = [line.split("::")[0].split("/")[-1] for line in run.stdout.splitlines() if "PASSED" in line]
    # The two listed files went out first, one to each worker, before the lighter SPREAD tests.
    assert len(order) == 12 and set(order[:2]) == {"test_reliability.py", "test_workflow.py"}, order
