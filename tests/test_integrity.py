"""Runs that survive damage: `mint revisions verify` finds exactly the damaged revisions and record shards,
`show` refuses a corrupt revision, catalog files are read-only yet gc deletes them, and non-finite tensors are never
published. Real files, real SQLite, the CLI through `mint.cli.main`."""

import dataclasses
import json
import stat

import pytest
import torch
from safetensors.torch import load_file

from mint.cli import main
from mint.errors import MintError
from mint.hub import verify_catalog
from mint.hub.catalog import Catalog
from mint.hub.records import write_step
from mint.hub.revisions import ADAPTER_FILE, CONFIG_FILE, META_FILE, RevisionMeta, revision_id, write_revision_dir
from mint.rl.tasks import Example
from mint.rollout.engine import Completion, GroupRollout
from mint.train.rollout_actor import GroupResult

CONFIG = {"r": 2, "lora_alpha": 4.0, "peft_type": "LORA"}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x.lora_A.weight": torch.randn(2, 3, generator=g), "x.lora_B.weight": torch.randn(3, 2, generator=g)}


def _chain(cat: Catalog, run: str, n: int) -> list[RevisionMeta]:
    out, parent = [], None
    for step in range(n):
        out.append(cat.put(_tensors(step), CONFIG, run=run, step=step, parent=parent, metrics={"reward_mean": 0.5}))
        parent = out[-1].id
    return out


def _group() -> GroupResult:
    comps = [Completion(torch.arange(n) + 5, -torch.rand(n), None, "stop") for n in (2, 3)]
    return GroupResult(
        Example("What?", "7"), GroupRollout(torch.tensor([1, 2, 3]), None, comps), ["a", "b"], [1.0, 0.0], 0, None
    )


# Catalog files are 0o444; the tests run as root, which writes them anyway, but a non-root run needs the chmod.
def _flip(path, offset: int = -2) -> None:
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01  # one bit of the last weight: the file still parses, the hash does not match
    path.write_bytes(bytes(data))


def _truncate(path) -> None:
    path.chmod(0o644)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _cli(capsys, *argv) -> tuple[int, list[str], list[str]]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def test_a_whole_catalog_verifies_clean(tmp_path, capsys):
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 3)
    write_step(cat, "a", 1, chain[0].id, [_group()])
    report = verify_catalog(cat)
    assert report.ok and report.problems == () and (report.revisions, report.shards) == (3, 1)
    c = ["--catalog", str(cat.root)]
    code, out, err = _cli(capsys, "revisions", "verify", "--all", *c)
    assert (
        code == 0
        and err == []
        and out == ["verified 3 revisions (3 ok, 0 bad, 0 pruned) and 1 record shards (1 ok, 0 bad): all good"]
    )
    code, out, _ = _cli(capsys, "revisions", "verify", "a@0", chain[1].id[:8], "a@0", *c)
    assert code == 0 and out[-1].startswith("verified 2 revisions") and "1 record shards" in out[-1]


def test_verify_reports_exactly_the_flipped_and_truncated_revisions(tmp_path, capsys):
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 4)
    _flip(cat.revision_dir(chain[1].id) / ADAPTER_FILE)
    _truncate(cat.revision_dir(chain[2].id) / ADAPTER_FILE)
    report = verify_catalog(cat)
    assert not report.ok and [p.revision for p in report.problems] == [chain[1].id, chain[2].id]
    flipped, truncated = report.problems
    actual = revision_id(load_file(str(cat.revision_dir(chain[1].id) / ADAPTER_FILE)))
    assert flipped.what == f"tensors hash to {actual[:12]}, not to the id"
    assert "does not parse" in truncated.what and "the index says" in truncated.what

    c = ["--catalog", str(cat.root)]
    code, out, err = _cli(capsys, "revisions", "verify", "--all", *c)
    assert code == 1 and err == [] and len(out) == 3
    assert out[0].startswith(f"{chain[1].id[:12]}  bad") and out[1].startswith(f"{chain[2].id[:12]}  bad")
    assert out[2] == "verified 4 revisions (2 ok, 2 bad, 0 pruned) and 0 record shards (0 ok, 0 bad): CORRUPT"
    assert _cli(capsys, "revisions", "verify", "a@3", *c)[0] == 0  # only what is named is checked
    code, out, _ = _cli(capsys, "revisions", "verify", "a@1", "--json", *c)
    assert code == 1 and json.loads(out[0])["revision"] == chain[1].id and json.loads(out[-1])["ok"] is False


def test_show_refuses_a_corrupt_revision(tmp_path, capsys):
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 2)
    c = ["--catalog", str(cat.root)]
    assert _cli(capsys, "revisions", "show", "a@1", "--json", *c)[0] == 0
    for damage in (_flip, _truncate):
        path = cat.revision_dir(chain[1].id) / ADAPTER_FILE
        original = path.read_bytes()
        damage(path)
        code, out, err = _cli(capsys, "revisions", "show", "a@1", "--json", *c)
        assert code == 1 and json.loads(out[0])["id"] == chain[1].id  # the entry is shown, then refused
        assert len(err) == 1 and err[0].startswith(f"mint: error: revision {chain[1].id[:12]}: ")
        path.write_bytes(original)


def test_pruned_entries_are_labelled_not_bad(tmp_path, capsys):
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 3)
    cat.gc(keep_last=1)
    report = verify_catalog(cat)
    assert report.ok and [(p.revision, p.status) for p in report.problems] == [
        (chain[0].id, "pruned"),
        (chain[1].id, "pruned"),
    ]
    code, out, _ = _cli(capsys, "revisions", "verify", "--all", "--catalog", str(cat.root))
    assert code == 0 and [line.split()[1] for line in out[:2]] == ["pruned", "pruned"]
    assert out[2].startswith("verified 3 revisions (1 ok, 0 bad, 2 pruned)") and out[2].endswith("all good")
    assert _cli(capsys, "revisions", "show", "a@0", "--catalog", str(cat.root))[0] == 0


def test_record_shards_must_match_their_recorded_sha256(tmp_path, capsys):
    cat = Catalog(tmp_path / "cat")
    rev = _chain(cat, "a", 1)[0]
    shards = [write_step(cat, "a", step, rev.id, [_group()]) for step in (1, 2, 3)]
    _flip(cat.root / shards[0].path, offset=-1)
    _truncate(cat.root / shards[1].path)
    report = verify_catalog(cat, [rev.id])
    assert report.shards == 3 and [p.kind for p in report.problems] == ["records", "records"]
    assert [shards[0].path in report.problems[0].what, shards[1].path in report.problems[1].what] == [True, True]
    assert "hashes to" in report.problems[0].what and "the index says" in report.problems[1].what
    (cat.root / shards[2].path).unlink()
    code, out, _ = _cli(capsys, "revisions", "verify", "--all", "--catalog", str(cat.root))
    assert code == 1 and "unreadable" in out[2] and out[-1].endswith("3 record shards (0 ok, 3 bad): CORRUPT")


def test_metadata_that_disagrees_with_the_index_is_bad(tmp_path):
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 3)
    meta_path = cat.revision_dir(chain[0].id) / META_FILE
    record = json.loads(meta_path.read_text())
    meta_path.chmod(0o644)
    meta_path.write_text(json.dumps({**record, "step": 7, "parent": "f" * 64}))
    config_path = cat.revision_dir(chain[1].id) / CONFIG_FILE
    config_path.chmod(0o644)
    config_path.write_text("{not json")
    (cat.revision_dir(chain[2].id) / ADAPTER_FILE).unlink()
    report = verify_catalog(cat)
    assert [p.what for p in report.problems] == [
        f"{META_FILE} differs from the index in step, parent",
        f"{CONFIG_FILE} does not parse (JSONDecodeError: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))",
        f"{ADAPTER_FILE} missing",
    ]


def test_a_non_finite_revision_published_before_the_rule_is_bad(tmp_path):
    """The drill found a revision with 27,648 non-finite values in a catalog; verify names it."""
    cat = Catalog(tmp_path / "cat")
    tensors = _tensors(0)
    tensors["x.lora_B.weight"][0, :] = float("nan")
    rid = revision_id(tensors)
    meta = RevisionMeta(rid, "old", 0, None, 1.0, lora_config=CONFIG)
    record = {k: v for k, v in meta.to_dict().items() if k not in ("nbytes", "stored")}
    write_revision_dir(cat.revision_dir(rid), tensors, CONFIG, record)
    nbytes = (cat.revision_dir(rid) / ADAPTER_FILE).stat().st_size
    cat.index_many([dataclasses.replace(meta, nbytes=nbytes)])
    (problem,) = verify_catalog(cat).problems
    assert problem.what == "2 non-finite values (NaN or inf), first in x.lora_B.weight (2)"


def test_put_refuses_non_finite_tensors_and_writes_nothing(tmp_path):
    cat = Catalog(tmp_path / "cat")
    parent = _chain(cat, "a", 1)[0]
    before = sorted(p.relative_to(cat.root) for p in cat.root.rglob("*") if "sqlite" not in p.name)
    for dtype in (torch.float32, torch.bfloat16):
        tensors = {k: v.to(dtype) for k, v in _tensors(5).items()}
        tensors["x.lora_A.weight"][1, :] = float("inf")
        tensors["x.lora_B.weight"][:, 0] = float("nan")
        with pytest.raises(MintError) as err:
            cat.put(tensors, CONFIG, run="a", step=1, parent=parent.id)
        assert str(err.value) == (
            "run a step 1: refusing to publish 6 non-finite values (NaN or inf), first in x.lora_A.weight (3); "
            "nothing written"
        )
    after = sorted(p.relative_to(cat.root) for p in cat.root.rglob("*") if "sqlite" not in p.name)
    assert after == before and cat.count() == 1 and verify_catalog(cat).ok


def test_catalog_files_are_read_only_and_gc_still_deletes_them(tmp_path):
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 2)
    shard = write_step(cat, "a", 1, chain[0].id, [_group()])
    directory = cat.revision_dir(chain[0].id)
    for path in (directory / ADAPTER_FILE, directory / CONFIG_FILE, directory / META_FILE, cat.root / shard.path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o444, path
    assert directory.stat().st_mode & stat.S_IWUSR, "a revision directory must stay writable so gc can empty it"
    assert (cat.root / shard.path).parent.stat().st_mode & stat.S_IWUSR
    write_step(cat, "a", 1, chain[0].id, [_group()])  # rewriting a step's shard replaces the read-only file
    cat.gc(keep_last=1)
    assert not directory.exists() and not cat.get(chain[0].id).stored
    assert verify_catalog(cat).ok


def test_republishing_reclaimed_tensors_keeps_the_first_metadata(tmp_path):
    """Tensors reclaimed by gc and published again come back under the entry's metadata, so the files agree with
    the index (first publish wins) and verify stays clean."""
    cat = Catalog(tmp_path / "cat")
    chain = _chain(cat, "a", 2)
    cat.gc(keep_last=1)
    again = cat.put(_tensors(0), {"r": 8}, run="b", step=9)
    assert again.stored and (again.run, again.step) == ("a", 0)
    assert json.loads((cat.revision_dir(chain[0].id) / META_FILE).read_text())["run"] == "a"
    assert json.loads((cat.revision_dir(chain[0].id) / CONFIG_FILE).read_text()) == CONFIG
    assert verify_catalog(cat).problems == ()


def test_verify_usage_errors_exit_2_and_a_damaged_index_exits_1(tmp_path, capsys):
    cat = Catalog(tmp_path / "cat")
    _chain(cat, "a", 1)
    cat.close()
    c = ["--catalog", str(tmp_path / "cat")]
    for argv in (["nope", *c], [*c], ["a@0", "--all", *c], ["--all", "--catalog", str(tmp_path / "absent")]):
        code, out, err = _cli(capsys, "revisions", "verify", *argv)
        assert code == 2 and out == [] and len(err) == 1 and err[0].startswith("mint: error: "), argv
    (tmp_path / "cat" / "catalog.sqlite").write_bytes(b"not a database" * 512)
    for name in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
        (tmp_path / "cat" / name).unlink(missing_ok=True)
    code, out, err = _cli(capsys, "revisions", "verify", "--all", *c)
    assert code == 1 and len(err) == 1 and "catalog index unreadable" in err[0]
