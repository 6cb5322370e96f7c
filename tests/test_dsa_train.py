"""DSA indexer replay end to end, through real local Ray and 2 learner ranks on DeepSpeed (gloo): the tiny pretrained
GLM-5 with its index_topk cut to 8, so that every prompt and response runs past it and each query attends to a
selection. The built-in rollout engine records each response token's selection per indexer layer; the learner's
response forwards attend to those records and count where its own selection differed."""

import json
import shutil
from pathlib import Path

import pytest

from mint.config import load_config
from mint.models.tiny import resolve_model_path
from mint.train.driver import train

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
STEPS = 3


def test_indexer_replay_runs_end_to_end_past_index_topk(tmp_path):
    base = tmp_path / "glm_moe_dsa-topk8"
    shutil.copytree(resolve_model_path("tiny:glm_moe_dsa"), base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "index_topk": 8}))
    overrides = [
        f"model.path={base}", f"grpo.steps={STEPS}", f"logging.root={tmp_path}", "logging.name=replay",
        "logging.progress=false", "learner.num_ranks=2", "grpo.indexer_replay=true",
    ]  # fmt: skip
    summary = train(load_config(ROOT / "recipes/smoke.toml", overrides))
    lines = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for m in lines:
        # present only when selections were replayed; a fraction of the replayed query x layer pairs
        assert 0.0 <= m["mismatch_indexer_ratio"] <= 1.0, m
        print(m["step"], m["mismatch_indexer_ratio"], m["logp_diff_max"])
