"""conftest.processes_of_run, which finds a run's own processes, finds a Ray worker after it titles itself."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import new_run_mark, processes_of_run, run_mark_env, wait_for_processes

# What a Ray worker does at start-up and around every task: retitle itself with the setproctitle code Ray bundles.
# It modifies the environment first, as a worker's imports do. Without SPT_NOENV this zeroes the start of
# /proc/PID/environ.
WORKER = """
import os, sys, time
import ray._raylet
os.environ["HOME"] = "/nowhere"
ray._raylet.setproctitle("ray::MarkProbe")
print("titled", flush=True)
time.sleep(60)
"""


def test_a_retitled_ray_worker_keeps_its_run_mark():
    mark = new_run_mark()
    # The mark first: the zeroes cover the start of the environment, and a worker's order is whatever the raylet's
    # hash map gives it, so on some machine the mark is there.
    env = {**run_mark_env(mark), **{k: v for k, v in os.environ.items() if k not in run_mark_env(mark)}}
    child = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "titled"
        assert wait_for_processes(mark, "ray::MarkProbe", 1, timeout=10) == [child.pid]
        assert processes_of_run(new_run_mark(), "ray::MarkProbe") == []  # another run's mark finds nothing
    finally:
        child.kill()
        child.wait()
