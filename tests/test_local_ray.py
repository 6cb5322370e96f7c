"""A run that starts its own Ray returns only once every process that Ray started has exited
(mint.train.cluster.LocalRay.stop), and leaves the caller's other processes alone.

On an idle machine ray.shutdown() alone usually gets there; the worker that outlives it shows up under load (the
Ctrl-C drill in test_reliability.py caught one), which a test cannot order up. This one pins the contract: every
descendant that appeared with Ray is gone when stop() returns, and one that was there before Ray is not touched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import ray

from mint.config.load import load_config
from mint.train import cluster

ROOT = Path(__file__).resolve().parents[1]


@ray.remote(num_cpus=0)
class Straggler:
    """An actor with a process of its own, in a session of its own: part of what Ray started, two levels down."""

    def start(self) -> int:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        return child.pid


def test_stop_returns_after_rays_processes_exit_and_leaves_the_callers_alone(monkeypatch):
    assert not ray.is_initialized(), "another test left Ray running in this worker"
    monkeypatch.setattr(cluster, "RAY_EXIT_WAIT_S", 2.0)  # what Ray leaves gets 2 s, not 15, before it is killed
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # the caller's, not Ray's
    try:
        local = cluster.start_ray(load_config(ROOT / "recipes" / "smoke.toml"))
        assert local is not None and bystander.pid in local.before
        straggler = ray.get(Straggler.remote().start.remote())
        # what Ray started: the worker may hold processes of earlier tests (still exiting), which are not this Ray's
        rays = [p for p in psutil.Process().children(recursive=True) if p.pid not in local.before]
        assert straggler in {p.pid for p in rays} and len(rays) >= 3  # GCS, raylet, the actor, its child
        local.stop()
        assert not ray.is_initialized()
        assert [p.pid for p in rays if cluster._running(p)] == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
