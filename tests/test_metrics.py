"""Run logging: one JSON line per step, and wandb in offline mode when the recipe enables it."""

import json
import math

from mint.config import build_config
from mint.train.metrics import RunLogger


def test_jsonl_lines_and_non_finite_values(tmp_path):
    config = build_config({}, ["logging.progress=false"])
    logger = RunLogger(config, tmp_path)
    logger.log({"step": 1, "reward_mean": 0.5, "grad_norm": math.nan})
    logger.log({"step": 2, "reward_mean": 0.75, "grad_norm": 1.0})
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 1, "reward_mean": 0.5, "grad_norm": None},
        {"step": 2, "reward_mean": 0.75, "grad_norm": 1.0},
    ]


def test_wandb_runs_offline_without_an_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = build_config({}, ["logging.wandb=true", "logging.progress=false", "logging.name=offline-test"])
    logger = RunLogger(config, tmp_path)
    logger.log({"step": 1, "reward_mean": 0.25, "revision": "abc"})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    assert any(runs[0].glob("*.wandb")), "wandb wrote no offline run file"
