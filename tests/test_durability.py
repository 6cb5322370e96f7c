"""What a crash at any moment leaves behind is whole, and recovery holds up under the failures it is for.

The crash tests kill a real process with SIGKILL at every filesystem step of an operation (tests/crash_points.py)
and check each state it leaves as its next user would: `mint revisions verify --all`, a second publish, or the
search for a checkpoint that `--resume` makes.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from crash_points import killed_at_every_step

from mint.cli import main
from mint.hub.catalog import Catalog
from mint.hub.revisions import ADAPTER_FILE, CONFIG_FILE, META_FILE

CONFIG = {"r": 2, "lora_alpha": 4.0, "peft_type": "LORA"}
# The body a crashed process runs has these tensors too: seed -> the revision's tensors.
TENSORS = """
import torch
def tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {"x.lora_A.weight": torch.randn(2, 3, generator=g), "x.lora_B.weight": torch.randn(3, 2, generator=g)}
"""
CATALOG_IMPORTS = "import torch\nfrom mint.hub import Catalog"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    scope: dict = {}
    exec(TENSORS, scope)
    return scope["tensors"](seed)


def _verify_all(capsys, catalog: Path) -> tuple[int, list[str]]:
    """`mint revisions verify --all` on `catalog`: its exit status and output lines."""
    code = main(["revisions", "verify", "--all", "--catalog", str(catalog)])
    return code, capsys.readouterr().out.splitlines()


def _revision_dirs(catalog: Path) -> set[str]:
    """Every directory under revisions/<id[:2]>/, hidden ones included."""
    return {d.name for shard in (catalog / "revisions").iterdir() for d in shard.iterdir()}


# ---- the catalog: gc and publish ----


def test_gc_killed_at_any_step_leaves_a_catalog_that_verifies_and_republishes_whole(tmp_path, capsys):
    """kill -9 of `gc` at each of its steps. gc used to mark a revision unstored and then delete its directory in
    place: killed after the first file went, it left a partial directory under the revision's name, and publishing
    the same tensors again kept that directory (it existed) and marked the entry stored, so the index pointed at a
    partial revision and verify failed. Now the directory is renamed aside first, and a publish rewrites whatever is
    not whole."""
    state = tmp_path / "state"
    with Catalog(state / "cat") as cat:
        first = cat.put(_tensors(0), CONFIG, run="a", step=0)
        cat.put(_tensors(1), CONFIG, run="a", step=1, parent=first.id)
    body = "with Catalog(root / 'cat') as cat:\n    cat.gc(keep_last=1)"
    killed = killed_at_every_step(body, state, tmp_path / "crashes", CATALOG_IMPORTS)
    assert len(killed) >= 4, killed  # before the first step, and after each file and directory gc touches

    for crashed in killed:
        catalog = crashed / "cat"
        code, out = _verify_all(capsys, catalog)
        assert code == 0 and out[-1].endswith("all good"), (crashed.name, out)
        with Catalog(catalog) as cat:
            again = cat.put(_tensors(0), CONFIG, run="b", step=7)  # published again, by another run
            assert again.stored and (again.run, again.step) == ("a", 0)
            cat.load(again.id)  # the tensors hash to the id
        code, out = _verify_all(capsys, catalog)
        assert code == 0 and out[-1].endswith("all good"), (crashed.name, out)
        with Catalog(catalog) as cat:
            cat.gc(keep_last=1)  # removes what the crash set aside, with no grace period
            stored = {m.id for m in cat.list(stored=True, limit=None)}
        assert _revision_dirs(catalog) == stored, crashed.name


def test_publish_killed_at_any_step_then_published_again_verifies_clean(tmp_path, capsys):
    """kill -9 of a publish (`Catalog.put`) at each of its steps, then the same tensors published again, as a
    resumed run does. Killed after its directory was renamed into place but before the entry was inserted, the
    publish left a whole directory with no entry; the second publish kept the directory and inserted an entry of its
    own, whose `created` differed from the directory's, so verify reported mint_revision.json as differing from the
    index. Now the directory's own metadata becomes the entry (the first publish wins, as everywhere)."""
    state = tmp_path / "state"
    with Catalog(state / "cat") as cat:
        parent = cat.put(_tensors(0), CONFIG, run="a", step=0).id
    put = f"cat.put(tensors(1), {CONFIG!r}, run='a', step=1, parent={parent!r})"
    body = f"{TENSORS}\nwith Catalog(root / 'cat') as cat:\n    {put}"
    killed = killed_at_every_step(body, state, tmp_path / "crashes", CATALOG_IMPORTS)
    assert len(killed) >= 2, killed  # before the directory is renamed into place, and after

    for crashed in killed:
        with Catalog(crashed / "cat") as cat:
            meta = cat.put(_tensors(1), CONFIG, run="a", step=1, parent=parent)
            assert (meta.step, meta.parent, meta.stored) == (1, parent, True)
        code, out = _verify_all(capsys, crashed / "cat")
        assert code == 0 and out[-1].endswith("all good"), (crashed.name, out)


def _break_missing(path: Path, name: str) -> None:
    (path / name).unlink()


def _break_flipped(path: Path, name: str) -> None:
    data = bytearray((path / name).read_bytes())
    data[-2] ^= 0x01  # one bit of the last weight: the file parses, the hash does not match
    (path / name).chmod(0o644)
    (path / name).write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "name"),
    [
        (_break_missing, ADAPTER_FILE),
        (_break_missing, CONFIG_FILE),
        (_break_missing, META_FILE),
        (_break_flipped, ADAPTER_FILE),
    ],
    ids=["no-tensors", "no-config", "no-metadata", "flipped-tensors"],
)
def test_republishing_over_a_partial_revision_directory_rewrites_it(tmp_path, capsys, damage, name):
    """A reclaimed revision whose directory is still there but not whole (what an older Mint's gc, killed
    mid-delete, left: some files gone; or a flipped bit) is published again: the publish used to keep the directory
    because it existed and mark the entry stored, so verify failed and loading it was refused. It is rewritten now."""
    with Catalog(tmp_path / "cat") as cat:
        first = cat.put(_tensors(0), CONFIG, run="a", step=0)
        cat.put(_tensors(1), CONFIG, run="a", step=1, parent=first.id)
        directory = cat.revision_dir(first.id)
        kept = {p.name: p.read_bytes() for p in directory.iterdir()}
        cat.gc(keep_last=1)
        directory.mkdir()
        for file, data in kept.items():
            (directory / file).write_bytes(data)
        damage(directory, name)

        again = cat.put(_tensors(0), CONFIG, run="a", step=0)
        assert again.stored
        cat.load(first.id)
        assert sorted(p.name for p in directory.iterdir()) == sorted(kept)
    code, out = _verify_all(capsys, tmp_path / "cat")
    assert code == 0 and out[-1].endswith("all good"), out


# ---- checkpoints ----

CHECKPOINT_BODY = """
from mint.train import checkpoint
from mint.train.checkpoint import RunState

# Step 2 written again (a restart re-ran it: the same step's checkpoint is replaced), then step 4, which with
# keep_last = 1 discards step 2. The ranks' files say which writing of which step they belong to.
for step, writing in ((2, 2), (4, 1)):
    partial = checkpoint.begin(root, step)
    (partial / "deepspeed").mkdir()
    for rank in range(2):
        (partial / "deepspeed" / f"rank_{rank}.pt").write_text(f"step {step} writing {writing}")
        (partial / "rng" / f"rank_{rank}.pt").write_text(f"step {step} writing {writing}")
    checkpoint.commit(partial, RunState(step=step, revision=str(writing) * 64), "digest", keep_last=1)
"""


def test_a_checkpoint_replace_killed_at_any_step_leaves_a_whole_checkpoint_to_resume(tmp_path):
    """kill -9 while a checkpoint replaces the one of the same step (keep_last = 1), and while the next one discards
    it. The replace used to delete the old checkpoint before renaming the new one into place: killed in between,
    the run had no checkpoint at all, and killed mid-delete, `latest` returned a directory with files missing. Now
    the old one is set aside and deleted only once the new one is in place, and `latest` puts it back if the new
    one never got there."""
    state = tmp_path / "state"
    exec(CHECKPOINT_BODY.replace("((2, 2), (4, 1))", "((2, 1),)"), {"root": state})  # the checkpoint replaced
    killed = killed_at_every_step(CHECKPOINT_BODY, state, tmp_path / "crashes", "import mint.train.checkpoint")
    assert len(killed) >= 6, killed

    from mint.train import checkpoint

    def whole(directory: Path) -> bool:
        run_state = checkpoint.read(directory, "digest")
        expected = f"step {run_state.step} writing {run_state.revision[0]}"
        parts = [directory / part / f"rank_{rank}.pt" for part in ("deepspeed", "rng") for rank in range(2)]
        return all(p.is_file() and p.read_text() == expected for p in parts)

    for crashed in killed:
        latest = checkpoint.latest(crashed)  # what --resume restores
        assert latest is not None and whole(latest), crashed.name
        left = sorted(p.name for p in (crashed / "checkpoints").iterdir())
        # every directory under a checkpoint's name is whole; what the crash set aside is settled
        assert all(whole(crashed / "checkpoints" / n) for n in left if n.startswith("step_")), (crashed.name, left)
        assert all(n.startswith("step_") or n.endswith(".partial") for n in left), (crashed.name, left)


# ---- the per-step logs on resume ----


def test_resume_cuts_every_step_log_back_to_the_checkpoint_and_drops_a_torn_last_line(tmp_path):
    """A driver killed mid-write leaves metrics.jsonl ending in half a line, and samples.jsonl holds rows of the
    steps after the checkpoint. Resuming used to fail with a JSONDecodeError traceback on the torn line, and left
    samples.jsonl alone, so the resumed run logged those steps' samples twice."""
    from mint.train.metrics import truncate_step_logs

    metrics = "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(1, 6))
    (tmp_path / "metrics.jsonl").write_text(metrics + '{"step": 6, "lo')
    samples = "".join(json.dumps({"step": s, "completion": c}) + "\n" for s in range(1, 7) for c in "ab")
    (tmp_path / "samples.jsonl").write_text(samples)

    truncate_step_logs(tmp_path, 4)
    for name, per_step in (("metrics.jsonl", 1), ("samples.jsonl", 2)):
        text = (tmp_path / name).read_text()
        assert text.endswith("\n")
        steps = [json.loads(line)["step"] for line in text.splitlines()]
        assert steps == [s for s in range(1, 5) for _ in range(per_step)], name


def test_a_complete_last_line_missing_its_newline_is_kept_and_ended(tmp_path):
    """A kill between a row and its newline leaves a last line that parses; kept, it must end with a newline, or the
    resumed run's next row would be glued to it."""
    from mint.train.metrics import truncate_step_logs

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}')
    truncate_step_logs(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


# ---- the node watchdog ----


def _watched_cluster(node: str = "n1") -> SimpleNamespace:
    """What the watchdog reads of a Cluster: one learner rank on `node`, and the owners' kill calls, recorded."""
    slot = SimpleNamespace(actor="learner rank 0")
    placement = SimpleNamespace(
        layout=SimpleNamespace(learners=[slot], rollouts=[]), node_of={slot.actor: node}, names={node: "node-1"}
    )
    killed: list = []
    return SimpleNamespace(
        placement=placement,
        lost="",
        _stop=threading.Event(),
        fleet=SimpleNamespace(node_left=lambda what, actors: killed.append(("fleet", actors))),
        learners=SimpleNamespace(kill=lambda ranks: killed.append(("learners", ranks))),
        killed=killed,
    )


def _nodes(answers: list):
    """A stand-in for ray.nodes() giving `answers` in turn: an exception is raised, a list of alive ids returned."""

    def nodes():
        answer = answers.pop(0) if answers else answers_end
        if isinstance(answer, Exception):
            raise answer
        return [{"NodeID": n, "Alive": True} for n in answer]

    answers_end = ["n1"]
    return nodes


def _fast_polls(monkeypatch, cluster_mod) -> None:
    """Milliseconds instead of seconds between the watchdog's asks (raising=False: a watchdog without backoff
    has no NODE_POLL_MAX_S)."""
    monkeypatch.setattr(cluster_mod, "NODE_POLL_S", 0.001)
    monkeypatch.setattr(cluster_mod, "NODE_POLL_MAX_S", 0.004, raising=False)


def test_the_node_watchdog_outlives_transient_gcs_errors_and_still_sees_a_node_leave(monkeypatch):
    """ray.nodes() fails three times (the GCS restarting), answers, then the learner's node is gone. The watchdog
    used to stop for good at the first failure, so the node's loss went unnoticed and the run waited on its actors."""
    from mint.train import cluster as cluster_mod

    _fast_polls(monkeypatch, cluster_mod)
    answers = [ConnectionError("GCS unavailable")] * 3 + [["n1"], []]
    monkeypatch.setattr(cluster_mod.ray, "nodes", _nodes(answers))
    watched = _watched_cluster()
    cluster_mod._watch(watched)
    assert watched.lost == "node node-1 left the cluster with learner rank 0 on it"
    assert ("learners", [0]) in watched.killed and answers == []


def test_the_node_watchdog_gives_up_after_its_bound_with_one_line(monkeypatch, capsys):
    """ray.nodes() never answers: the watchdog stops after NODE_POLL_FAILURES failures in a row, saying so in one
    line, and marks nothing lost; an answer in between restarts the count."""
    from mint.train import cluster as cluster_mod

    _fast_polls(monkeypatch, cluster_mod)
    n = 4
    monkeypatch.setattr(cluster_mod, "NODE_POLL_FAILURES", n, raising=False)
    answers = [ConnectionError("GCS unavailable")] * (n - 1) + [["n1"]] + [ConnectionError("GCS\nunavailable")] * n
    monkeypatch.setattr(cluster_mod.ray, "nodes", _nodes(answers))
    watched = _watched_cluster()
    cluster_mod._watch(watched)
    assert answers == [] and watched.lost == "" and watched.killed == []
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"mint: the node watchdog stopped: ray.nodes() failed {n} times in a row (last: GCS); a node that leaves is "
        "now noticed only when a call on it fails"
    ]


# ---- every wait on a learner rank restarts the session when it died ----


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _dying_rank(method: str):
    """A learner rank stand-in that exits its process when `method` is called (a SIGKILL from outside would do the
    same); its other calls answer as a LearnerActor's would. Defined here so Ray pickles it by value."""

    class Rank:
        def __init__(self, *args):
            pass

        def _maybe_die(self, name: str) -> None:
            if name == method:
                os._exit(1)

        def address(self):
            self._maybe_die("address")
            return "127.0.0.1", 1

        def setup(self, *args):
            self._maybe_die("setup")

        def where(self):
            self._maybe_die("where")
            return f"(pid {os.getpid()} on 127.0.0.1)"

        def adapter_config(self, path):
            self._maybe_die("adapter_config")
            return {}

    return Rank


@pytest.mark.slow
@pytest.mark.parametrize("method", ["address", "where"])
def test_a_learner_rank_dying_while_the_group_starts_is_learner_died(local_ray, monkeypatch, method):
    """A rank that dies while LearnerGroup.start waits on its address or its place: the bare ray.get there raised
    Ray's own ActorDiedError, which ended the run, where the same death in a step (LearnerDied) restarts it."""
    from mint.config import build_config
    from mint.train import learner_group
    from mint.train.learner_group import LearnerDied, LearnerGroup

    monkeypatch.setattr(learner_group, "LearnerActor", _dying_rank(method))
    config = build_config({})
    with pytest.raises(LearnerDied, match=r"^learner rank \d+ died during start-up$"):
        LearnerGroup.start(config, [{"num_cpus": 0}], ["path"], ["0" * 8], None)


@pytest.mark.slow
def test_a_learner_rank_dying_in_adapter_config_is_learner_died(local_ray):
    """adapter_config, the first call of a session after start-up, was a bare ray.get too."""
    from mint.train.learner_group import LearnerDied, LearnerGroup

    group = LearnerGroup([local_ray.remote(_dying_rank("adapter_config")).options(num_cpus=0).remote()])
    group.where = ["(pid 1 on 127.0.0.1, node 00000000)"]
    with pytest.raises(LearnerDied, match=r"learner rank 0 \(pid 1 .*\) died during adapter_config"):
        group.adapter_config("path")
