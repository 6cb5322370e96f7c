"""Mint on more than one Ray node, tested on one machine.

The pure parts first: the mounts table behind the catalog's refusal of network filesystems, and the placement
planner on made-up clusters of 1-4 nodes of 8 GPUs. Then a real local cluster of two `ray start` daemons ("node-a",
"node-b"), each with its own MINT_CACHE and HF_HOME, so a hidden shared-filesystem assumption shows: a run must ship
the tiny base into each node's own cache, and a hub model cached on one node only must be refused, naming the other.
Both nodes report one logical GPU (`--num-gpus=1`), so `ray.learner_gpus=1` puts one learner rank on each; the
learner still runs on CPU (no CUDA here). Every Ray call of the tests goes through a subprocess (`mint train`, the
wait step), whose environment the test sets, and the daemons are killed by process group at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mint.config import load_config
from mint.errors import ConfigError, MintError
from mint.hub import Catalog
from mint.hub._fs import filesystem_of, require_local_fs
from mint.train.nodes import tree_digest
from mint.train.placement import Node, memory_plan, plan_layout

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "recipes/smoke.toml"
RAY = str(Path(sys.executable).with_name("ray"))
MOUNTS = """\
sysfs /sys sysfs rw 0 0
/dev/sda1 / ext4 rw,relatime 0 0
fs1:/export/home /home nfs4 rw,vers=4.2 0 0
/dev/sdb1 /home/alice/local ext4 rw 0 0
10.0.0.9@o2ib:/lfs /mnt/lustre lustre rw 0 0
//srv/share /mnt/with\\040space cifs rw 0 0
user@host:/data /mnt/ab fuse.sshfs rw 0 0
"""


# ---- the catalog and network filesystems --------------------------------------------------------------------------


def test_filesystem_of_takes_the_longest_mount_point_prefix(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)
    m = str(mounts)
    assert filesystem_of("/home/bob/runs/catalog", m) == ("/home", "nfs4")
    assert filesystem_of("/home/alice/local/catalog", m) == ("/home/alice/local", "ext4")  # a local disk inside NFS
    assert filesystem_of("/mnt/lustre", m) == ("/mnt/lustre", "lustre")
    assert filesystem_of("/mnt/with space/x", m) == ("/mnt/with space", "cifs")  # \040 in the table
    assert filesystem_of("/mnt/abc/x", m) == ("/", "ext4")  # whole components: /mnt/ab does not hold /mnt/abc
    assert filesystem_of("/mnt/ab/x", m) == ("/mnt/ab", "fuse.sshfs")
    link = tmp_path / "link"
    link.symlink_to("/mnt/lustre/project")  # a link into a network mount is on it
    assert filesystem_of(link / "catalog", m) == ("/mnt/lustre", "lustre")
    assert filesystem_of("/x", str(tmp_path / "no-such-table")) is None  # no table: nothing known, nothing refused
    require_local_fs("/home/alice/local/catalog", mounts_file=m)
    with pytest.raises(ConfigError) as err:
        require_local_fs("/home/bob/runs/catalog", mounts_file=m)
    message = str(err.value)
    assert "\n" not in message and "nfs4" in message and "catalog.path" in message and "local" in message


def test_catalog_and_driver_refuse_a_catalog_on_nfs(tmp_path, monkeypatch):
    """The catalog opens nothing on NFS (SQLite WAL), and `mint train` stops before Ray starts, with one line."""
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nfs1:/export {tmp_path / 'shared'} nfs rw 0 0\n")
    monkeypatch.setenv("MINT_MOUNTS", str(mounts))
    with pytest.raises(ConfigError, match="nfs"):
        Catalog(tmp_path / "shared" / "catalog")
    assert not (tmp_path / "shared").exists()  # refused before anything was created
    Catalog(tmp_path / "local" / "catalog").close()  # a local disk is fine
    overrides = [f"logging.root={tmp_path / 'shared' / 'runs'}", "logging.name=nfs", "grpo.steps=1"]
    proc = _mint(["train", str(SMOKE), *overrides], env=os.environ | {"MINT_MOUNTS": str(mounts)}, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mint: config error: catalog.path: the catalog"), proc.stderr
    assert "local" in lines[0] and not (tmp_path / "shared").exists()


def test_a_relative_run_root_is_refused_in_a_ray_job_copy(tmp_path):
    """Under `ray job submit --working-dir` the driver runs in Ray's temporary copy of the checkout, deleted with the
    job: a relative logging.root would vanish with it (launch/submit.sh passes an absolute one)."""
    copy = tmp_path / "session_x/runtime_resources/working_dir_files/_ray_pkg_0123"
    copy.mkdir(parents=True)
    proc = _mint(
        ["train", str(SMOKE), "logging.root=runs", "grpo.steps=1"], env=os.environ.copy(), timeout=120, cwd=copy
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mint: config error: logging.root: 'runs' is relative"), lines
    assert "absolute" in lines[0] and list(copy.iterdir()) == []


def test_the_drivers_own_node_is_checked_as_the_directory_it_built_and_nothing_is_shipped(tmp_path):
    """`node_checks` with the driver's node as `local` (what `check_nodes` passes on a Ray this process started):
    that node's check is the directory check of the tiny base the driver built, which `check_node` answers here,
    and the base's files are not put into Ray's object store (no Ray is running in this test). The other nodes'
    checks and shipping run in the two-node tests below."""
    from mint.models.tiny import ensure_tiny
    from mint.train.nodes import check_node, node_checks

    path = ensure_tiny("qwen3_moe")
    checks = node_checks(_config("learner.num_ranks=2"), path, {"n0": "node 0"}, {"n0"}, tmp_path, local="n0")
    assert checks.args == {"n0": ("dir", path, None, None)} and checks.probe_file is None
    assert checks.paths([("n0", check_node(*checks.args["n0"]))]) == {"n0": path}
    assert list(tmp_path.iterdir()) == []  # no probe file: the learner ranks are on the driver's node


# ---- the placement planner ------------------------------------------------------------------------------------------


def _config(*overrides: str):
    return load_config(SMOKE, list(overrides))


def _planned(text: str) -> dict[str, str]:
    """The actor lines of a printed layout: actor -> "node N, bundle B, C CPU, GPU ..." """
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
    return {row[0]: row[1] for row in rows if row[0].startswith(("learner rank", "rollout actor"))}


def _nodes(n: int, gpus: float = 8, cpus: float = 64) -> list[Node]:
    return [Node(f"id{i:02d}" + "0" * 52, f"10.0.0.{i + 1}", cpus, gpus, driver=i == 0) for i in range(n)]


def test_learner_fills_nodes_in_order_and_rollout_gets_its_own_nodes():
    """4 nodes of 8 GPUs: 16 learner ranks take nodes 0-1 (GPU 0-7 each), 16 rollout actors nodes 2-3; one bundle
    per node, pinned to it by the node-id label."""
    config = _config("learner.num_ranks=16", "rollout.num_actors=16", "ray.learner_gpus=1", "ray.rollout_gpus=1")
    layout = plan_layout(config, _nodes(4))
    assert [s.node for s in layout.learners] == [0] * 8 + [1] * 8
    assert [s.node for s in layout.rollouts] == [2] * 8 + [3] * 8
    assert [s.gpu_index for s in layout.learners[:8]] == [(g,) for g in range(8)]
    assert layout.bundles == ({"CPU": 8.0, "GPU": 8},) * 4
    assert [sel["ray.io/node-id"][:4] for sel in layout.selectors] == ["id00", "id01", "id02", "id03"]
    text = layout.table()
    assert _planned(text)["learner rank 15"] == "node 1, bundle 1, 1 CPU, GPU 7"
    assert (
        "node 0: 10.0.0.1 (id000000) [driver], 64 CPU, 8 GPU; bundle 0 {CPU: 8, GPU: 8}; 8 learner, 0 rollout" in text
    )


def test_rollout_shares_a_node_but_never_a_gpu_unless_colocated():
    # One node of 8: 4 learner ranks on GPU 0-3, 4 rollout actors on GPU 4-7, in a bundle of their own.
    layout = plan_layout(
        _config("learner.num_ranks=4", "rollout.num_actors=4", "ray.learner_gpus=1", "ray.rollout_gpus=1"), _nodes(1)
    )
    assert [s.gpu_index for s in layout.rollouts] == [(4,), (5,), (6,), (7,)]
    assert layout.bundles == ({"CPU": 4.0, "GPU": 4}, {"CPU": 4.0, "GPU": 4}) and {
        s.bundle for s in layout.rollouts
    } == {1}
    # Half a GPU each on a 1-GPU node: refused without colocate (one line), shared with it.
    half = ["learner.num_ranks=1", "rollout.num_actors=1", "ray.learner_gpus=0.5", "ray.rollout_gpus=0.5"]
    with pytest.raises(MintError) as err:
        plan_layout(_config(*half), _nodes(1, gpus=1))
    assert "ray.colocate" in str(err.value) and "\n" not in str(err.value)
    shared = plan_layout(_config(*half, "ray.colocate=true"), _nodes(1, gpus=1))
    assert [s.gpu_index for s in shared.slots] == [(0,), (0,)] and shared.bundles == ({"CPU": 2.0, "GPU": 1},)
    assert _planned(shared.table())["rollout actor 0"] == "node 0, bundle 0, 1 CPU, GPU 0 (0.5 of it)"
    # Colocated rollout actors fill the learner's nodes first, even with a spare node.
    colo = plan_layout(_config(*half, "ray.colocate=true"), _nodes(2, gpus=1))
    assert [s.node for s in colo.slots] == [0, 0]


def test_parallel_groups_stay_in_a_node_and_errors_name_what_is_missing():
    # 6 GPUs per node and expert-parallel groups of 4: each node takes one whole group, never 6 ranks.
    ep = _config("learner.num_ranks=8", "learner.expert_parallel=4", "ray.learner_gpus=1", "rollout.num_actors=1")
    layout = plan_layout(ep, _nodes(3, gpus=6))
    assert [s.node for s in layout.learners] == [0] * 4 + [1] * 4 and layout.rollouts[0].node == 2
    with pytest.raises(MintError) as err:
        plan_layout(_config("learner.num_ranks=16", "ray.learner_gpus=1"), _nodes(1))
    message = str(err.value)
    assert "16 learner rank(s)" in message and "8 fit" in message and "1 alive node(s)" in message, message
    # Ray's own strategies: one bundle per actor, no pinning, nodes chosen by Ray.
    packed = plan_layout(_config("ray.placement=PACK"), _nodes(2))
    assert packed.selectors is None and len(packed.bundles) == 3 and all(s.node is None for s in packed.slots)


def test_memory_plan_for_a_real_base():
    config = _config("model.path=Qwen/Qwen3-30B-A3B", "model.dtype=bfloat16", "learner.num_ranks=8")
    text = memory_plan(config, 4096, "96GB")
    assert "per learner GPU" in text and "total" in text and "DP=8" in text
    assert memory_plan(_config(), 20, "96GB").startswith("memory plan: none for tiny:qwen3_moe")


# ---- a real two-node cluster on this machine ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mint(args: list[str], env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mint.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


class LocalCluster:
    """Ray daemons on this machine, each a "node" with its own environment, started with `ray start --block` in a
    process group of its own and killed by it (never `ray stop`: it stops every Ray on the machine)."""

    def __init__(self, base: Path):
        self.base = base
        self.temp = tempfile.mkdtemp(prefix="mint-mn-", dir="/tmp")  # short: Ray's socket paths must fit 107 chars
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.caches: dict[str, Path] = {}
        self.hf: dict[str, Path] = {}

    def env(self, **extra) -> dict:
        """A client's environment: no token authentication (the daemons run without it), one torch thread."""
        return os.environ | {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", **extra}

    def start(self, name: str, head: bool = False) -> None:
        self.caches[name] = self.base / f"cache-{name}"
        self.hf[name] = self.base / f"hf-{name}"
        env = self.env(
            MINT_CACHE=str(self.caches[name]),
            HF_HOME=str(self.hf[name]),
            HF_HUB_OFFLINE="1",
            # A dead node is noticed in about 3 s instead of 30: the node-loss test waits on it.
            RAY_health_check_period_ms="1000",
            RAY_health_check_failure_threshold="3",
            RAY_health_check_timeout_ms="1000",
        )
        common = ["--num-cpus=2", "--num-gpus=1", f"--node-name={name}", "--block", "--disable-usage-stats"]
        ports = [f"--dashboard-agent-listen-port={_free_port()}", f"--metrics-export-port={_free_port()}"]
        if head:
            args = ["--head", f"--port={self.port}", f"--temp-dir={self.temp}", "--include-dashboard=false"]
            ports += [f"--dashboard-port={_free_port()}", f"--ray-client-server-port={_free_port()}"]
        else:
            args = [f"--address={self.address}"]
        log = open(self.base / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        self.procs[name] = subprocess.Popen(
            [RAY, "start", *args, *common, *ports],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, nodes: int, gpus: int, timeout: float) -> subprocess.CompletedProcess:
        """The launch scripts' wait step, as they run it."""
        cmd = ["bash", str(ROOT / "launch/wait_for_nodes.sh"), self.address, str(nodes), str(gpus), str(timeout)]
        return subprocess.run(
            cmd, cwd=ROOT, env=self.env(PYTHON=sys.executable), capture_output=True, text=True, timeout=timeout + 120
        )

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):  # the daemon, its raylet and its workers: a node that died
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def close(self) -> None:
        for name in list(self.procs)[::-1]:
            self.kill(name)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("multinode"))
    try:
        c.start("node-a", head=True)
        c.start("node-b")
        joined = c.wait(nodes=2, gpus=2, timeout=90)
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert "2 node(s) with 2 GPU(s) joined" in joined.stdout
        yield c
    finally:
        c.close()


def _run_overrides(tmp_path: Path, cluster: LocalCluster, name: str, *extra: str) -> list[str]:
    return [
        f"ray.address={cluster.address}",
        f"logging.root={tmp_path}",
        f"logging.name={name}",
        "logging.progress=false",
        "logging.samples_every=0",
        *extra,
    ]


def _rewards(run: Path) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _learned(rewards: list[float], k: int = 10) -> float:
    """Mean reward over the last k steps minus the first k."""
    return sum(rewards[-k:]) / k - sum(rewards[:k]) / k


@pytest.mark.slow
def test_wait_step_fails_in_bounded_time_when_a_node_never_joins(cluster):
    """launch/slurm.sbatch's wait step against a cluster with fewer nodes than asked, and against no head at all."""
    t0 = time.monotonic()
    proc = cluster.wait(nodes=3, gpus=3, timeout=5)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1 and elapsed < 60, (proc.returncode, elapsed, proc.stderr[-2000:])
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("mint: wait: after 5 s, 2 of 3 node(s) and 2 of 3 GPU(s) joined"), proc.stderr
    assert "missing 1 node(s) and 1 GPU(s)" in line and "node-a (1 GPU)" in line and "node-b (1 GPU)" in line
    no_head = f"127.0.0.1:{_free_port()}"
    nobody = subprocess.run(
        [sys.executable, "-m", "mint.train.nodes", "wait", "--address", no_head, "--nodes", "1", "--timeout", "2"],
        cwd=ROOT,
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert nobody.returncode == 1 and "no Ray head answered" in nobody.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_model_missing_on_one_node_is_refused_naming_it(tmp_path, cluster):
    """A hub model in node-a's (and the driver's) Hugging Face cache but not node-b's: one line naming node-b, before
    any actor starts."""
    snapshot = cluster.hf["node-a"] / "hub/models--mint-test--tiny/snapshots/0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs/main").write_text("0123abcd")
    from mint.models.tiny import ensure_tiny

    for f in Path(ensure_tiny("qwen3_moe")).iterdir():
        shutil.copy(f, snapshot / f.name)
    env = cluster.env(HF_HOME=str(cluster.hf["node-a"]), HF_HUB_OFFLINE="1")
    overrides = _run_overrides(tmp_path, cluster, "hub", "model.path=mint-test/tiny", "learner.num_ranks=1")
    proc = _mint(["train", str(SMOKE), *overrides, "grpo.steps=2"], env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("mint: config error: node node-b (") and "mint-test/tiny is not in this node's" in line
    assert not (tmp_path / "hub" / "placement.json").exists()  # no actor was started


@pytest.mark.slow
def test_dry_run_then_two_learner_ranks_split_over_both_nodes_learn(tmp_path, cluster):
    """`--dry-run` prints the layout on the live cluster and starts nothing (no node receives the tiny base); the run
    then reserves that layout: one learner rank per node (one GPU each), the rollout actor beside rank 0 on CPU, the
    tiny base shipped into each node's own cache. 30 steps of the smoke recipe: the reward rises."""
    overrides = _run_overrides(tmp_path, cluster, "split", "learner.num_ranks=2", "ray.learner_gpus=1", "grpo.steps=30")
    dry = _mint(["train", str(SMOKE), *overrides, "--dry-run"], env=cluster.env(), timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert _planned(dry.stdout) == {
        "learner rank 0": "node 0, bundle 0, 1 CPU, GPU 0",
        "learner rank 1": "node 1, bundle 1, 1 CPU, GPU 0",
        "rollout actor 0": "node 0, bundle 2, 1 CPU, no GPU",
    }, dry.stdout
    assert not any(p.exists() for p in cluster.caches.values())  # nothing was shipped: no task, no actor

    proc = _mint(["train", str(SMOKE), *overrides], env=cluster.env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    placement = json.loads((tmp_path / "split/placement.json").read_text())
    nodes = {a: placement["layout"]["nodes"][s["node"]] for a, s in _slots(placement).items()}
    assert nodes["learner rank 0"]["address"] != nodes["learner rank 1"]["address"]  # node-a and node-b
    assert nodes["rollout actor 0"] == nodes["learner rank 0"]
    from mint.models.tiny import ensure_tiny

    digest = tree_digest(ensure_tiny("qwen3_moe"))
    for actor, info in placement["actors"].items():
        node = nodes[actor]["address"]
        assert info["model_path"].startswith(str(cluster.caches[node])), (actor, info)  # that node's own cache
        assert tree_digest(info["model_path"]) == digest  # the driver's bytes
    rewards = _rewards(tmp_path / "split")
    assert summary["steps"] == 30 and _learned(rewards) > 0.1, rewards


def _slots(placement: dict) -> dict:
    return {s["actor"]: s for s in placement["layout"]["slots"]}


@pytest.mark.slow
def test_learner_and_rollout_on_separate_nodes_learn_and_survive_losing_the_rollout_node(tmp_path, cluster):
    """The learner on the driver's node, the rollout actor on the other. That node is killed mid-run: the driver
    says so in one line, restarts the actors from the latest checkpoint on the node that is left, and the run ends
    with all 30 steps, having learned. (Last in this file: it leaves the cluster one node short.)"""
    overrides = _run_overrides(tmp_path, cluster, "lose", "learner.num_ranks=1", "grpo.steps=30", "checkpoint.every=5")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mint.cli", "train", str(SMOKE), *overrides],
        cwd=ROOT,
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = tmp_path / "lose"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").exists() and len(_rewards(run)) >= 12:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        placement = json.loads((run / "placement.json").read_text())
        layout_nodes = placement["layout"]["nodes"]
        slots = _slots(placement)
        learner_node = layout_nodes[slots["learner rank 0"]["node"]]
        rollout_node = layout_nodes[slots["rollout actor 0"]["node"]]
        assert learner_node["driver"] and not rollout_node["driver"]
        assert placement["actors"]["rollout actor 0"]["model_path"].startswith(
            str(cluster.caches[rollout_node["address"]])
        )
        cluster.kill(rollout_node["address"])
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    lost = [line for line in err.splitlines() if "left the cluster" in line]
    assert len(lost) == 1 and lost[0].startswith(f"mint: node {rollout_node['address']} ("), err[-3000:]
    assert "with rollout actor 0 on it; restarting the actors from the checkpoint" in lost[0]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 30 and summary["restarts"] == 1
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31))  # resumed at the checkpoint, no step twice
    after = json.loads((run / "placement.json").read_text())
    assert {after["layout"]["nodes"][s["node"]]["address"] for s in after["layout"]["slots"]} == {
        learner_node["address"]
    }
    assert _learned(_rewards(run)) > 0.1
