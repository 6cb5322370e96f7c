"""The catalog index (SQLite, WAL): queries, refs, tags and names, retention, rollout records, trainer, CLI."""

import json
import os
import threading
import time

import pytest
import torch

from mint.cli import main
from mint.config import build_config
from mint.errors import MintError
from mint.hub.catalog import ORPHAN_GRACE_S, Catalog
from mint.hub.records import read_step, write_step
from mint.hub.revisions import ADAPTER_FILE, META_FILE, RevisionMeta, revision_id
from mint.rl.tasks import Example
from mint.rollout.engine import Completion, GroupRollout
from mint.train.rollout_actor import GroupResult
from mint.train.step import Revision, save_revision

CONFIG = {"r": 2, "lora_alpha": 4.0, "peft_type": "LORA"}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x.lora_A.weight": torch.randn(2, 3, generator=g), "x.lora_B.weight": torch.randn(3, 2, generator=g)}


def _chain(
    cat: Catalog, run: str, n: int, seed0: int = 0, parent: str | None = None, step0: int = 0
) -> list[RevisionMeta]:
    out = []
    for step in range(step0, step0 + n):
        meta = cat.put(
            _tensors(seed0 + step), CONFIG, run=run, step=step, parent=parent, metrics={"reward_mean": step / 10}
        )
        out.append(meta)
        parent = meta.id
    return out


def test_put_get_latest_lineage_and_refs(tmp_path):
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 5)
    assert chain[3].id == revision_id(_tensors(3)) and chain[3].parent == chain[2].id
    assert cat.get(chain[3].id) == chain[3] and chain[3].nbytes > 0 and chain[3].stored
    assert cat.latest("a") == chain[-1] and cat.latest("nope") is None
    assert [m.step for m in cat.lineage(chain[-1].id)] == [4, 3, 2, 1, 0]
    assert [m.step for m in cat.lineage(chain[-1].id, limit=2)] == [4, 3]
    assert [m.id for m in cat.children(chain[1].id)] == [chain[2].id]
    # refs: full id, unique prefix, RUN@STEP, RUN@latest; unknown and too-short refs fail in one line
    assert cat.resolve(chain[2].id[:8]) == cat.resolve("a@2") == chain[2].id
    assert cat.resolve("a@latest") == chain[-1].id
    for bad in ("a@9", "zz", "abc", "0" * 64):
        with pytest.raises(MintError):
            cat.resolve(bad)
    # publishing the same tensors again is the same revision, first metadata stands
    again = cat.put(_tensors(3), CONFIG, run="other", step=99, parent=chain[2].id)
    assert again == chain[3] and cat.count() == 5
    with pytest.raises(MintError, match="parent"):
        cat.put(_tensors(50), CONFIG, run="a", step=5, parent="f" * 64)
    nan = cat.put(_tensors(60), CONFIG, run="n", step=0, metrics={"loss": float("nan"), "reward_mean": 1.0})
    assert nan.metrics == {"loss": None, "reward_mean": 1.0}
    # filters: run, step range, metrics, order
    assert [m.step for m in cat.list("a", min_step=1, max_step=3)] == [3, 2, 1]
    assert [m.step for m in cat.list("a", metrics=[("reward_mean", ">=", 0.3)], newest_first=False)] == [3, 4]
    with pytest.raises(MintError):
        cat.list(metrics=[("x; DROP TABLE revisions", "=", 1)])
    # a second process-like handle (its own connection) sees the same index
    with Catalog(tmp_path / "cat", create=False) as other:
        assert other.latest("a") == chain[-1]
    with pytest.raises(MintError, match="no catalog"):
        Catalog(tmp_path / "missing", create=False)


def test_tags_names_and_labels(tmp_path):
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 3)
    cat.tag(chain[0].id, "best")
    cat.tag("a@1", "best")
    assert sorted(m.step for m in cat.list(tag="best")) == [0, 1]
    cat.untag("a@1", "best")
    assert [m.step for m in cat.list(tag="best")] == [0]
    cat.name("prod", chain[1].id)
    assert cat.resolve("prod") == chain[1].id
    cat.name("prod", chain[2].id)  # a name moves
    assert cat.resolve("prod") == chain[2].id and cat.names() == {"prod": chain[2].id}
    for bad in ("", "1abc", "deadbeef12", "has space", "a@b"):
        with pytest.raises(MintError):
            cat.tag(chain[0].id, bad)


def test_corrupt_payload_is_refused(tmp_path):
    cat = Catalog(tmp_path / "cat")
    meta = _chain(cat, "a", 1)[0]
    path = cat.revision_dir(meta.id) / ADAPTER_FILE
    path.chmod(0o644)  # catalog files are read-only; root writes them anyway, a non-root run needs this
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(MintError, match="refusing to load"):
        cat.load(meta.id)


def test_gc_keeps_latest_tagged_and_every_ancestor_entry(tmp_path):
    cat = Catalog(tmp_path / "cat")
    main_line = _chain(cat, "a", 6)  # steps 0..5
    dead = _chain(cat, "a", 2, seed0=100, parent=main_line[2].id, step0=3)  # a branch off step 2, abandoned
    resumed = _chain(cat, "a", 2, seed0=200, parent=main_line[5].id, step0=6)  # the run goes on from step 5
    other = _chain(cat, "b", 3, seed0=300)
    cat.tag(main_line[1].id, "keep-me")

    plan = cat.plan_gc(keep_last=2, run="a")
    assert set(plan.keep) == {resumed[0].id, resumed[1].id, main_line[1].id}
    assert set(plan.prune) == {m.id for m in (main_line[0], *main_line[2:], *dead)}
    assert plan.drop == () and plan.bytes_freed > 0
    cat.apply_gc(plan)
    assert not cat.get(main_line[3].id).stored and not cat.revision_dir(main_line[3].id).exists()
    with pytest.raises(MintError, match="reclaimed by gc"):
        cat.load(main_line[3].id)
    cat.load(main_line[1].id)  # tagged: tensors kept
    cat.load(other[0].id)  # another run is untouched by `gc --run a`
    # lineage of the newest revision still walks to the root through reclaimed entries
    assert [m.step for m in cat.lineage(resumed[-1].id)] == [7, 6, 5, 4, 3, 2, 1, 0]

    # dropping entries removes only revisions without a kept descendant: the dead branch
    plan = cat.gc(keep_last=2, run="a", drop_entries=True)
    assert set(plan.drop) == {m.id for m in dead}
    assert cat.find(dead[0].id) is None and cat.find(main_line[2].id) is not None
    assert len(cat.lineage(resumed[-1].id)) == 8

    # keep_last = 0 keeps everything
    assert cat.plan_gc(keep_last=0).prune == ()


def test_gc_removes_old_orphans_only(tmp_path):
    cat = Catalog(tmp_path / "cat")
    _chain(cat, "a", 1)
    old = cat.root / "revisions" / "ff" / ("f" * 64)
    young = cat.root / "revisions" / "ee" / ("e" * 64)
    for d in (old, young):
        d.mkdir(parents=True)
        (d / META_FILE).write_text("{}")
    stamp = time.time() - ORPHAN_GRACE_S - 10
    os.utime(old, (stamp, stamp))
    plan = cat.gc(keep_last=1)
    assert plan.orphans == (str(old.relative_to(cat.root)),)
    assert not old.exists() and young.exists()


def test_concurrent_readers_and_a_writer(tmp_path):
    cat = Catalog(tmp_path / "cat")
    first = _chain(cat, "a", 1)[0]
    errors = []

    def read():
        try:
            for _ in range(50):
                assert cat.get(first.id).id == first.id
                cat.latest("a")
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    _chain(cat, "a", 5, seed0=10, parent=first.id)
    for t in threads:
        t.join()
    assert not errors and cat.count() == 6


def _group(prompt: list[int], lengths: list[int], rewards: list[float], routes: bool) -> GroupResult:
    comps = [
        Completion(
            tokens_R=torch.arange(n) + 5,
            logprobs_R=-torch.rand(n),
            routes_R_L_K=torch.randint(0, 4, (n, 2, 2), dtype=torch.uint8) if routes else None,
            finish_reason="stop" if n < 4 else "length",
        )
        for n in lengths
    ]
    p_routes = torch.randint(0, 4, (len(prompt) - 1, 2, 2), dtype=torch.uint8) if routes else None
    rollout = GroupRollout(torch.tensor(prompt), p_routes, comps)
    texts = [f"resp{n}" for n in lengths]
    return GroupResult(Example("What?", "7"), rollout, texts, rewards, 0, None)


def test_rollout_records_round_trip_linked_by_revision(tmp_path):
    cat = Catalog(tmp_path / "cat")
    rev = _chain(cat, "a", 1)[0]
    groups = [_group([1, 2, 3], [2, 4], [1.0, 0.0], True), _group([4, 5], [1, 3], [0.5, 0.25], True)]
    shard = write_step(cat, "a", 1, rev.id, groups)
    assert cat.records(revision=rev.id[:10]) == [shard] and cat.records(run="a", step=1) == [shard]
    records = list(read_step(cat, shard).responses())
    assert len(records) == 4 and shard.responses == 4
    flat = [(g, c) for g in groups for c in g.rollout.completions]
    for rec, (g, c) in zip(records, flat, strict=True):
        assert rec.revision == rev.id and rec.step == 1 and rec.answer == "7"
        assert torch.equal(rec.prompt_tokens_P, g.rollout.prompt_tokens_P)
        assert torch.equal(rec.tokens_R, c.tokens_R) and torch.equal(rec.logprobs_R, c.logprobs_R)
        assert torch.equal(rec.routes_R_L_K, c.routes_R_L_K)
        assert torch.equal(rec.prompt_routes_P1_L_K, g.rollout.prompt_routes_P1_L_K)
        assert rec.finished == (c.finish_reason == "stop")
    assert [r.reward for r in records] == [1.0, 0.0, 0.5, 0.25]

    light = write_step(cat, "a", 2, rev.id, groups, mode="no_routes")
    assert all(r.routes_R_L_K is None for r in read_step(cat, light).responses())
    assert write_step(cat, "a", 3, rev.id, groups, mode="off") is None

    path = cat.root / shard.path
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(MintError, match="checksum"):
        read_step(cat, shard)


def test_trainer_retention_exports_peft_dirs_and_reclaims_old_tensors(tmp_path):
    config = build_config({}, [f"logging.root={tmp_path}", "logging.name=r", "catalog.keep_last=2"])
    out = tmp_path / "r"
    cat = Catalog(out / "catalog")
    metas = []
    for step in range(4):  # as the trainer does: publish, then save (which applies retention)
        metas.append(_chain(cat, "r", 1, step0=step, parent=metas[-1].id if metas else None)[0])
        save_revision(config, out, cat, Revision(metas[-1].id, step, None, metas[-1].parent))
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["step_000002", "step_000003"]
    exported = json.loads((out / "adapters/step_000003" / META_FILE).read_text())
    assert exported["id"] == metas[3].id and exported["step"] == 3 and exported["parent"] == metas[2].id
    # The trainer's adapter directories are copies, never hard links to the catalog's file
    copy = (out / "adapters/step_000003" / ADAPTER_FILE).stat()
    original = (cat.revision_dir(metas[3].id) / ADAPTER_FILE).stat()
    assert copy.st_ino != original.st_ino and copy.st_nlink == original.st_nlink == 1
    assert [m.stored for m in cat.lineage(metas[3].id)] == [True, True, False, False]


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_revisions_commands(tmp_path, capsys):
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 3)
    cat.close()
    c = ["--catalog", str(tmp_path / "cat")]
    code, out, _ = _cli(capsys, "revisions", "list", *c, "--json", "--where", "reward_mean>0.05")
    assert code == 0 and [json.loads(line)["step"] for line in out.splitlines()] == [2, 1]
    code, out, _ = _cli(capsys, "revisions", "list", *c)
    assert code == 0 and chain[0].id[:12] in out
    code, out, _ = _cli(capsys, "revisions", "show", *c, "a@1", "--json")
    shown = json.loads(out)
    assert shown["id"] == chain[1].id and shown["children"] == [chain[2].id]
    code, out, _ = _cli(capsys, "revisions", "lineage", *c, chain[2].id[:8], "--json")
    assert [json.loads(line)["step"] for line in out.splitlines()] == [2, 1, 0]
    assert _cli(capsys, "revisions", "tag", *c, "a@0", "golden")[0] == 0
    assert _cli(capsys, "revisions", "tag", *c, "a@1", "prod", "--name")[0] == 0
    code, out, _ = _cli(capsys, "revisions", "gc", *c, "--keep-last", "1", "--dry-run")
    assert json.loads(out) == {
        "dry_run": True,
        "kept": 3,
        "reclaimed": 0,
        "dropped_entries": 0,
        "orphans": 0,
        "bytes_freed": 0,
    }
    code, out, _ = _cli(capsys, "revisions", "gc", *c, "--keep-last", "1")
    assert code == 0 and json.loads(out)["reclaimed"] == 0  # golden (tag), prod (name), latest: all kept
    code, out, err = _cli(capsys, "revisions", "show", *c, "nope")
    assert code == 1 and err.startswith("mint: error: revision nope") and err.count("\n") == 1
    code, _, err = _cli(capsys, "revisions", "list", "--catalog", str(tmp_path / "absent"))
    assert code == 1 and "no catalog" in err
