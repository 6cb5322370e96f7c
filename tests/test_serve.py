"""`mint serve` as a real process over real HTTP: revisions hot-loaded from the catalog, several resident over one
base, logprobs equal to the learner's scoring of the same tokens, safe under concurrent requests."""

import json
import os
import queue
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import build_random_tiny
from peft import PeftModel

from longstraw.scoring import token_logprobs
from mint.config import LoraConfig
from mint.hub.catalog import Catalog
from mint.hub.revisions import ADAPTER_FILE, base_fingerprint
from mint.models.lora import adapter_config_dict, add_lora, load_lora_state, lora_state
from mint.models.specs import load_model
from mint.models.tiny import VOCAB_SIZE, build_tokenizer
from mint.rl.tasks import Example
from mint.rollout.prompts import prompt_tokens

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60  # seconds per HTTP request; tiny-model requests take well under one


def _publish(cat: Catalog, base: str, seed: int, step: int, parent: str | None) -> str:
    model = add_lora(load_model(base), LoraConfig(), seed=0)
    g = torch.Generator().manual_seed(seed)
    load_lora_state(model, {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in lora_state(model).items()})
    config = json.loads(json.dumps(adapter_config_dict(model, base)))
    fp = base_fingerprint(base)
    return cat.put(lora_state(model), config, run="s", step=step, parent=parent, base_fingerprint=fp).id


def start_server(base: str, catalog: str, log: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`python -m mint.cli serve` on 127.0.0.1 with a free port; returns (process, url) once it listens."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mint.cli", "serve", "--base", base, "--catalog", catalog, "--port", "0", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)  # noqa: SIM115
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        ready = json.loads(lines.get(timeout=120))
    except (queue.Empty, ValueError):
        stop_server(proc)
        raise AssertionError(f"server did not start: {log.read_text()[-2000:]}") from None
    return proc, ready["url"]


def stop_server(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=30)


def call(url: str, path: str, body: dict | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A random tiny Qwen3-MoE with the embedded tokenizer, a catalog with revisions a, b and a corrupt one, and a
    running server over them."""
    root = tmp_path_factory.mktemp("serve")
    base = build_random_tiny("qwen3_moe", str(root / "base"), vocab_size=VOCAB_SIZE)
    build_tokenizer().save_pretrained(base)
    cat = Catalog(root / "catalog")
    a = _publish(cat, base, seed=1, step=1, parent=None)
    b = _publish(cat, base, seed=2, step=2, parent=a)
    bad = _publish(cat, base, seed=3, step=3, parent=b)
    cat.name("best-b", b)
    path = cat.revision_dir(bad) / ADAPTER_FILE
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10
    path.write_bytes(bytes(data))
    cat.close()
    proc, url = start_server(base, str(root / "catalog"), root / "server.log")
    yield dict(url=url, base=base, catalog=root / "catalog", a=a, b=b, bad=bad, root=root)
    assert stop_server(proc) == 0, (root / "server.log").read_text()[-2000:]


def _learner(served: dict, rid: str | None):
    """The learner-side model for a revision: plain PEFT from the exported adapter (the base for None)."""
    base = load_model(served["base"])
    if rid is None:
        return base
    from mint.hub.export import export_peft

    out = served["root"] / f"peft-{rid[:12]}"
    if not out.exists():
        with Catalog(served["catalog"], create=False) as cat:
            export_peft(cat, rid, out)
    return PeftModel.from_pretrained(base, str(out)).eval()


def _score(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :]
    return token_logprobs(logits, torch.tensor(tokens), temperature)


def test_load_generate_and_match_the_learners_logprobs(served):
    url = served["url"]
    status, models = call(url, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [served["base"]]
    assert call(url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": served["a"][:10]})[0] == 200
    status, loaded = call(url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "best-b"})
    assert status == 200 and loaded["revision"] == served["b"]
    status, models = call(url, "/v1/models")
    assert {m["id"]: m["root"] for m in models["data"][1:]} == {"a": served["a"], "b": served["b"]}

    prompt = [5, 77, 131, 12, 300, 41]
    seen = {}
    for model, rid in (("a", served["a"]), ("b", served["b"]), ("base", None)):
        body = dict(model=model, prompt=prompt, max_tokens=6, temperature=0.7, n=3, seed=11, logprobs=1)
        status, out = call(url, "/v1/completions", body)
        assert status == 200 and out["mint"]["revision"] == rid and len(out["choices"]) == 3
        learner = _learner(served, rid)
        for choice in out["choices"]:
            assert choice["prompt_token_ids"] == prompt
            served_lp = torch.tensor(choice["logprobs"]["token_logprobs"])
            learner_lp = _score(learner, prompt, choice["token_ids"], 0.7)
            assert (served_lp - learner_lp).abs().max() < 1e-4, (model, served_lp, learner_lp)
        seen[model] = [c["logprobs"]["token_logprobs"] for c in out["choices"]]
    assert seen["a"] != seen["b"] != seen["base"], "revisions must change the served policy"


def test_chat_completions_use_the_chat_template(served):
    url = served["url"]
    call(url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": served["a"]})
    question = "What is the last digit of 3 7 1 4?"
    body = dict(model="a", messages=[{"role": "user", "content": question}], max_tokens=4, temperature=0, logprobs=True)
    status, out = call(url, "/v1/chat/completions", body)
    assert status == 200
    choice = out["choices"][0]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served["base"])
    assert choice["prompt_token_ids"] == prompt_tokens(tokenizer, Example(question, ""))
    assert isinstance(choice["message"]["content"], str) and choice["message"]["role"] == "assistant"
    lps = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])
    learner = _learner(served, served["a"])
    expected = _score(learner, choice["prompt_token_ids"], choice["token_ids"], 1.0)  # greedy is scored at T = 1
    assert (lps - expected).abs().max() < 1e-4


def test_concurrent_requests_match_sequential_ones(served):
    """Concurrent requests are decoded in shared batches; each still gets what it gets alone."""
    url = served["url"]
    for name, ref in (("a", served["a"]), ("b", "best-b")):
        call(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": ref})
    bodies = [
        dict(model=m, prompt=[9, 8, 7, 6 + i], max_tokens=5, temperature=1.0, seed=i, logprobs=1)
        for i, m in enumerate(["a", "b", "base", "a", "b", "base"])
    ]
    sequential = [call(url, "/v1/completions", b)[1]["choices"][0]["token_ids"] for b in bodies]
    results: list = [None] * len(bodies)

    def run(i: int) -> None:
        results[i] = call(url, "/v1/completions", bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert [r[0] for r in results] == [200] * len(bodies)
    assert [r[1]["choices"][0]["token_ids"] for r in results] == sequential


def test_refusals_and_unload(served):
    url = served["url"]
    call(url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": served["b"]})
    status, err = call(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc/passwd"})
    assert status == 400 and "only from its catalog" in err["error"]["message"]
    status, err = call(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "s@99"})
    assert status == 404
    status, err = call(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": served["bad"]})
    assert status == 400 and "refusing to load" in err["error"]["message"]
    status, err = call(url, "/v1/completions", {"model": "nope", "prompt": [1, 2]})
    assert status == 404
    assert call(url, "/v1/completions", raw=b"{not json")[0] == 400
    status, err = call(url, "/v1/completions", {"model": "b", "prompt": [1, 2], "tools": [{"type": "function"}]})
    assert status == 400 and "tools" in err["error"]["message"]  # refused by name, never silently ignored
    assert call(url, "/v1/completions", {"model": "b", "prompt": [1, 2], "max_tokens": 0})[0] == 400
    assert call(url, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200
    assert "b" not in [m["id"] for m in call(url, "/v1/models")[1]["data"]]
    assert call(url, "/v1/completions", {"model": "b", "prompt": [1, 2]})[0] == 404
    assert call(url, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 404
    for name in [m["id"] for m in call(url, "/v1/models")[1]["data"][1:]]:  # back to the bare base, then reload
        assert call(url, "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
    assert call(url, "/v1/completions", {"model": "base", "prompt": [1, 2], "seed": 1})[0] == 200
    assert call(url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "best-b"})[0] == 200
    assert call(url, "/v1/completions", {"model": "b", "prompt": [1, 2], "seed": 1})[0] == 200


@pytest.mark.slow
def test_serve_the_revision_a_training_run_published(tmp_path):
    """Train 2 steps through Ray + DeepSpeed, then serve the run's latest revision from its catalog. The rollout
    records of step 2 link to the revision that sampled them, and rescoring them under it gives their logprobs."""
    from mint.config import load_config
    from mint.hub.records import read_step
    from mint.models.tiny import resolve_model_path
    from mint.train.driver import train

    overrides = ["grpo.steps=2", "learner.num_ranks=1", "rollout.prompts_per_step=4"]
    overrides += [f"logging.root={tmp_path}", "logging.name=pub", "logging.progress=false"]
    config = load_config(ROOT / "recipes/smoke.toml", overrides)
    summary = train(config)
    catalog = Path(summary["run_dir"]) / "catalog"
    base = resolve_model_path(config.model.path)
    with Catalog(catalog, create=False) as cat:
        latest = cat.latest("pub")
        lineage = cat.lineage(latest.id)
        # a step whose groups all had equal rewards leaves the adapter unchanged: no new revision for it
        assert latest.id == summary["revision"] and lineage[-1].step == 0 and lineage[0].step == 2
        sampler = next(m.id for m in lineage if m.step < 2)  # the revision rollouts of step 2 were sampled with
        shard = cat.records(run="pub", step=2)[0]
        assert shard.revision == sampler
        records = list(read_step(cat, shard).responses())
    served = dict(base=base, catalog=catalog, root=tmp_path)
    learner = _learner(served, sampler)
    for rec in records[:4]:
        rescored = _score(learner, rec.prompt_tokens_P.tolist(), rec.tokens_R.tolist(), config.rollout.temperature)
        assert (rescored - rec.logprobs_R).abs().max() < 1e-4

    proc, url = start_server(base, str(catalog), tmp_path / "server.log")
    try:
        status, loaded = call(url, "/v1/load_lora_adapter", {"lora_name": "trained", "lora_path": "pub@latest"})
        assert status == 200 and loaded["revision"] == summary["revision"]
        prompt = records[0].prompt_tokens_P.tolist()
        body = dict(model="trained", prompt=prompt, max_tokens=4, temperature=1.0, n=4, seed=5, logprobs=1)
        status, out = call(url, "/v1/completions", body)
        assert status == 200
        learner = _learner(served, summary["revision"])
        for choice in out["choices"]:
            expected = _score(learner, prompt, choice["token_ids"], 1.0)
            assert (torch.tensor(choice["logprobs"]["token_logprobs"]) - expected).abs().max() < 1e-4
    finally:
        assert stop_server(proc) == 0


def test_batched_decode_equals_the_engine_alone(served):
    """Batching, in process: a request decoded alone is `RolloutEngine.generate` bit for bit (tokens,
    logprobs, routes); decoded in one batch with others of other prompt lengths and sampling settings, it keeps its
    tokens and routes, and its logprobs move only by float reassociation."""
    from transformers import AutoTokenizer

    from mint.rollout import RolloutEngine, SamplingParams
    from mint.serve._decode import BatchDecoder, Job

    model = load_model(served["base"])
    tokenizer = AutoTokenizer.from_pretrained(served["base"])
    eos = (tokenizer.eos_token_id,)
    engine = RolloutEngine(model, eos)
    prompts = [[5, 77, 131, 12, 300, 41], [9, 8, 7], list(range(20, 45)), [3]]
    params = [
        SamplingParams(temperature=0.7, max_tokens=12),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=1.3, max_tokens=20),
    ]

    def jobs() -> list[Job]:
        return [
            Job(None, [p], 3, sp, seed=100 + i, want_routes=True)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]

    def decode(batch: list[Job]) -> list[list]:
        events: dict[int, list] = {}
        for job in batch:
            job.emit = lambda event, key=id(job): events.setdefault(key, []).append(event)
        with BatchDecoder(model, eos, tokenizer) as decoder:
            for job in batch:
                decoder.admit(job)
            while not decoder.empty:
                decoder.step()
        return [events[id(job)][-1][1] for job in batch]  # ("done", choices, Done)

    alone = [decode([job])[0] for job in jobs()]
    for i, choices in enumerate(alone):
        group = engine.generate([prompts[i]], 3, params[i], seed=100 + i)[0]
        for choice, completion in zip(choices, group.completions, strict=True):
            assert choice.token_ids == completion.tokens_R.tolist()
            assert choice.logprobs == completion.logprobs_R.tolist()
            assert choice.routes == completion.routes_R_L_K.tolist()
            assert choice.finish_reason == completion.finish_reason
    batched = decode(jobs())
    for together, apart in zip(batched, alone, strict=True):
        for a, b in zip(together, apart, strict=True):
            assert a.token_ids == b.token_ids and a.routes == b.routes
            assert (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max() < 1e-5
