"""The revision file format: content ids, atomic directories, refusing corrupt or partial files, base fingerprints."""

import json
import os
import pickle
import shutil
import stat

import pytest
import torch
from safetensors.torch import save_file

from mint.errors import MintError
from mint.hub.revisions import (
    ADAPTER_FILE,
    META_FILE,
    RevisionMeta,
    base_fingerprint,
    from_bytes,
    read_revision_dir,
    revision_id,
    to_bytes,
    write_revision_dir,
)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 8, generator=g),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(8, 4, generator=g),
    }


def test_id_is_canonical_over_tensors_not_file_layout(tmp_path):
    t = _tensors()
    reordered = dict(reversed(list(t.items())))
    assert revision_id(t) == revision_id(reordered) == revision_id(from_bytes(to_bytes(reordered)))
    changed = {
        **t,
        "base_model.model.layers.0.q_proj.lora_B.weight": t["base_model.model.layers.0.q_proj.lora_B.weight"] + 1e-7,
    }
    assert revision_id(changed) != revision_id(t)
    # dtype and shape are part of the id, not just the bytes
    assert revision_id({"a": torch.zeros(4, dtype=torch.float32)}) != revision_id(
        {"a": torch.zeros(2, dtype=torch.float64)}
    )
    assert revision_id({"a": torch.zeros(2, 2)}) != revision_id({"a": torch.zeros(4)})


def test_write_is_atomic_and_read_verifies(tmp_path):
    t = _tensors()
    target = tmp_path / "rev"
    rid = write_revision_dir(target, t, {"r": 4}, {"step": 3, "parent": None})
    assert rid == revision_id(t)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp directory left behind"
    # files are read-only once in place; the directory is not, so gc can delete them
    assert {stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()} == {0o444}
    assert target.stat().st_mode & stat.S_IWUSR
    tensors, config, meta = read_revision_dir(target)
    assert config == {"r": 4} and meta["id"] == rid and meta["step"] == 3
    assert all(torch.equal(tensors[k], t[k]) for k in t)
    # an existing revision directory is never rewritten
    assert write_revision_dir(target, _tensors(1), {"r": 4}, {}) == revision_id(_tensors(1))
    assert read_revision_dir(target)[2]["id"] == rid


def test_corrupt_truncated_or_missing_files_are_refused_in_one_line(tmp_path):
    t = _tensors()
    good = tmp_path / "good"
    rid = write_revision_dir(good, t, {"r": 4}, {})

    flipped = tmp_path / "flipped"
    shutil.copytree(good, flipped)
    (flipped / ADAPTER_FILE).chmod(0o644)  # written read-only; root writes it anyway, a non-root run needs this
    data = bytearray((flipped / ADAPTER_FILE).read_bytes())
    data[-1] ^= 0x01  # one bit of one weight
    (flipped / ADAPTER_FILE).write_bytes(bytes(data))
    with pytest.raises(MintError, match="corrupt, refusing to load") as err:
        read_revision_dir(flipped)
    assert "\n" not in str(err.value)

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    (truncated / ADAPTER_FILE).chmod(0o644)
    data = (truncated / ADAPTER_FILE).read_bytes()
    (truncated / ADAPTER_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(MintError, match="partial or corrupt write") as err:
        read_revision_dir(truncated)
    assert "\n" not in str(err.value)

    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    os.remove(missing / META_FILE)
    with pytest.raises(MintError, match="not a complete revision"):
        read_revision_dir(missing)

    with pytest.raises(MintError, match="not revision"):
        read_revision_dir(good, expect_id="0" * 64)
    assert read_revision_dir(good, expect_id=rid)[2]["id"] == rid


def test_meta_round_trips_through_pickle_and_json():
    meta = RevisionMeta(id="ab" * 32, run="r", step=2, parent=None, created=1.5, metrics={"reward_mean": 0.5})
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert RevisionMeta.from_dict(json.loads(json.dumps(meta.to_dict()))) == meta


def test_base_fingerprint_tracks_config_and_weights(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "x", "hidden_size": 8, "_name_or_path": "/a"}))
    weights = {f"w{i}": torch.randn(16) for i in range(20)}
    save_file(weights, str(base / "model.safetensors"))
    fp = base_fingerprint(str(base))

    moved = tmp_path / "moved"  # same weights and config, different path and _name_or_path: same fingerprint
    shutil.copytree(base, moved)
    (moved / "config.json").write_text(json.dumps({"model_type": "x", "hidden_size": 8, "_name_or_path": "/b"}))
    assert base_fingerprint(str(moved)) == fp

    changed = tmp_path / "changed"  # one selected tensor differs (the first name is always selected)
    changed.mkdir()
    (changed / "config.json").write_text((base / "config.json").read_text())
    save_file({**weights, "w0": weights["w0"] + 1}, str(changed / "model.safetensors"))
    assert base_fingerprint(str(changed)) != fp

    assert base_fingerprint("no/such-model").startswith("unresolved:")
