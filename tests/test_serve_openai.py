"""`mint serve` driven by the official `openai` client and by raw HTTP, as a real process on 127.0.0.1.

A drill with the openai client found dropped connections under load, a `Content-Length: -1` that hung a handler,
500s without tracebacks, no streaming, empty top_logprobs, single-token stops, refused content parts, no
/v1/models/{id}, silently ignored tools/response_format, and no vLLM `load_inplace`. Each test below guards one or
more of those.
"""

import base64
import http.client
import io
import json
import shutil
import socket
import threading

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import build_random_tiny
from test_serve import TIMEOUT, _learner, _publish, start_server, stop_server

from mint.hub.catalog import Catalog
from mint.hub.export import export_peft, export_per_expert
from mint.hub.revisions import ADAPTER_FILE
from mint.models.expert_lora import factor_experts
from mint.models.tiny import VOCAB_SIZE, build_tokenizer
from mint.rollout import RolloutEngine, SamplingParams

PROMPT = "What is the last digit of 3 7 1 4?"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Qwen3-MoE base, a catalog with revisions a and b, peft and per-expert exports of a, and two servers:
    `url` (served name "tiny", exported adapters allowed under `adapters/`) and `tight` (queue of 1, one request at
    a time, 0.2 s request timeout, 1 s body timeout)."""
    root = tmp_path_factory.mktemp("serve_openai")
    base = build_random_tiny("qwen3_moe", str(root / "base"), vocab_size=VOCAB_SIZE)
    build_tokenizer().save_pretrained(base)
    with Catalog(root / "catalog") as cat:
        a = _publish(cat, base, seed=1, step=1, parent=None)
        b = _publish(cat, base, seed=2, step=2, parent=a)
        export_peft(cat, a, root / "adapters" / "exp-a")
        export_per_expert(cat, a, root / "adapters" / "per-expert-a")
        export_peft(cat, b, root / "outside-b")
    (root / "adapters" / "link-out").symlink_to(root / "outside-b")
    shutil.copytree(root / "adapters" / "exp-a", root / "adapters" / "bad-a")
    bad = root / "adapters" / "bad-a" / ADAPTER_FILE
    bad.chmod(0o644)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x10
    bad.write_bytes(bytes(data))
    main_args = ("--served-model-name", "tiny", "--adapter-root", str(root / "adapters"))
    proc, url = start_server(base, str(root / "catalog"), root / "server.log", main_args)
    tight_args = ("--served-model-name", "tiny", "--max-queue", "1", "--max-batch", "1")
    tight_args += ("--request-timeout", "0.2", "--read-timeout", "1")
    try:
        tight_proc, tight = start_server(base, str(root / "catalog"), root / "tight.log", tight_args)
    except AssertionError:
        stop_server(proc)
        raise
    yield dict(url=url, tight=tight, base=base, catalog=root / "catalog", a=a, b=b, root=root)
    assert stop_server(tight_proc) == 0, (root / "tight.log").read_text()[-2000:]
    assert stop_server(proc) == 0, (root / "server.log").read_text()[-2000:]
    assert "Traceback" not in (root / "tight.log").read_text(), "a malformed request reached a 500"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TIMEOUT)


def load(url: str, name: str, path: str, inplace: bool | None = None) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path}
    if inplace is not None:
        body["load_inplace"] = inplace
    return post(url, "/v1/load_lora_adapter", body)


def test_chat_completions_n_and_content_parts(world):
    c = client(world["url"])
    assert load(world["url"], "a", world["a"]).status_code == 200
    parts = [{"type": "text", "text": "What is the last digit"}, {"type": "text", "text": "of 3 7 1 4?"}]
    kwargs = dict(model="a", max_tokens=6, temperature=1.0, seed=7, n=3)
    by_parts = c.chat.completions.create(messages=[{"role": "user", "content": parts}], **kwargs)
    joined = c.chat.completions.create(
        messages=[{"role": "user", "content": "\n".join(p["text"] for p in parts)}], **kwargs
    )
    assert len(by_parts.choices) == 3 and [ch.index for ch in by_parts.choices] == [0, 1, 2]
    assert [ch.message.content for ch in by_parts.choices] == [ch.message.content for ch in joined.choices]
    assert by_parts.usage.completion_tokens == sum(len(ch.model_extra["token_ids"]) for ch in by_parts.choices)
    again = c.chat.completions.create(messages=[{"role": "user", "content": parts}], **kwargs)
    assert [ch.model_extra["token_ids"] for ch in again.choices] == [
        ch.model_extra["token_ids"] for ch in by_parts.choices
    ]
    completion = c.completions.create(model="tiny", prompt=[PROMPT, "2 + 2 ="], max_tokens=5, n=2, seed=3)
    assert [ch.index for ch in completion.choices] == [0, 1, 2, 3]
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
    with pytest.raises(openai.BadRequestError, match="image_url"):
        c.chat.completions.create(model="a", messages=[{"role": "user", "content": [image]}], max_tokens=2)


def test_streaming_equals_the_whole_response(world):
    c = client(world["url"])
    messages = [{"role": "user", "content": PROMPT}]
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=5, n=2, logprobs=True)
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            seed=5,
            n=2,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for choice in whole.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(x.delta.content or "" for x in mine) == choice.message.content
        assert [t for x in mine for t in (x.model_extra.get("token_ids") or [])] == choice.model_extra["token_ids"]
        streamed_lps = [e.logprob for x in mine if x.logprobs for e in x.logprobs.content]
        assert streamed_lps == [e.logprob for e in choice.logprobs.content]
        assert mine[-1].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, seed=2, logprobs=2)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, seed=2, logprobs=2, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    streamed = [lp for ch in chunks if ch.choices[0].logprobs for lp in ch.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs


def _log_softmax_rows(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)  # T = 1


def test_top_logprobs_are_the_top_k_of_the_learners_distribution(world):
    c = client(world["url"])
    load(world["url"], "b", world["b"])
    out = c.chat.completions.create(
        model="b", messages=[{"role": "user", "content": PROMPT}], max_tokens=6, seed=1, logprobs=True, top_logprobs=5
    )
    choice = out.choices[0]
    logp = _log_softmax_rows(
        _learner(world, world["b"]), choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    )
    pieces = build_tokenizer()
    for j, entry in enumerate(choice.logprobs.content):
        values, ids = logp[j].topk(5)
        assert len(entry.top_logprobs) == 5
        assert [a.token for a in entry.top_logprobs] == [pieces.decode([i]) for i in ids.tolist()]
        assert torch.allclose(torch.tensor([a.logprob for a in entry.top_logprobs]), values, atol=1e-4)
    completion = c.completions.create(model="b", prompt=[5, 77, 131, 12], max_tokens=6, seed=4, logprobs=3)
    lp = completion.choices[0].logprobs
    logp = _log_softmax_rows(
        _learner(world, world["b"]), [5, 77, 131, 12], completion.choices[0].model_extra["token_ids"]
    )
    for j, top in enumerate(lp.top_logprobs):
        # the sampled token is always listed; pieces that decode alike (lone bytes) share one key, as in OpenAI's format
        assert 1 <= len(top) <= 4 and top[lp.tokens[j]] == lp.token_logprobs[j]
        assert max(top.values()) == pytest.approx(float(logp[j].max()), abs=1e-4)


def test_stop_strings_of_any_length(world):
    c = client(world["url"])
    tok = build_tokenizer()
    found = None
    for seed in range(40):  # a completion with two printable tokens in a row that tokenize back to >= 2 tokens
        whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, seed=seed)
        ids = whole.choices[0].model_extra["token_ids"]
        for j in range(1, len(ids) - 1):
            pieces = [tok.decode([t]) for t in ids[j : j + 2]]
            stop = "".join(pieces)
            if (
                all(p.strip() and p.isprintable() for p in pieces)
                and len(tok(stop, add_special_tokens=False)["input_ids"]) >= 2
            ):
                found = stop
                break
        if found:
            break
    if found is None:
        pytest.skip("no completion with two printable tokens in a row")
    stop = found
    text = whole.choices[0].text
    cut = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, seed=seed, stop=[stop, "never-there"])
    choice = cut.choices[0]
    assert choice.text == text[: text.index(stop)] and stop not in choice.text
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert ids[: len(choice.model_extra["token_ids"])] == choice.model_extra["token_ids"]
    streamed = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, seed=seed, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks) == choice.text  # no part of the stop string is ever sent
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_list_and_get(world):
    c = client(world["url"])
    load(world["url"], "a", world["a"])
    listed = {m.id: m for m in c.models.list().data}
    assert (
        "tiny" in listed
        and listed["a"].model_extra["parent"] == "tiny"
        and listed["a"].model_extra["root"] == world["a"]
    )
    assert c.models.retrieve("a").model_extra["root"] == world["a"]
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")


def test_adapters_load_inplace_and_from_directories(world):
    url, c = world["url"], client(world["url"])
    assert load(url, "x", world["a"]).json()["revision"] == world["a"]
    refused = load(url, "x", world["b"])
    assert refused.status_code == 400 and "load_inplace" in refused.json()["error"]["message"]
    assert load(url, "x", world["b"], inplace=True).json()["status"] == "replaced"
    out = c.completions.create(model="x", prompt=PROMPT, max_tokens=3, seed=1)
    assert out.model_extra["mint"]["revision"] == world["b"]
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 200
    exported = world["root"] / "adapters" / "exp-a"
    assert load(url, "dir-a", str(exported)).json()["revision"] == world["a"]
    assert load(url, "dir-a2", "./exp-a").json()["revision"] == world["a"]  # relative to --adapter-root
    for path in (str(world["root"] / "outside-b"), "../outside-b", "./link-out", "/etc"):
        r = load(url, "evil", path)
        assert r.status_code == 403 and "outside --adapter-root" in r.json()["error"]["message"], path
    r = load(url, "evil", "./bad-a")
    assert r.status_code == 400 and "refusing to load" in r.json()["error"]["message"]
    assert "evil" not in [m.id for m in c.models.list().data]
    # A per-expert export (the layout vLLM loads) is fused back and hash-checked: it is revision a.
    assert load(url, "dir-pe", "./per-expert-a").json()["revision"] == world["a"]
    for name in ("dir-a", "dir-a2", "dir-pe"):
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_unsupported_parameters_are_named(world):
    c = client(world["url"])
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            tools=[tool],
            tool_choice="auto",
            response_format={"type": "json_object"},
            logit_bias={"5": 1.0},
            frequency_penalty=0.5,
            extra_body={"made_up": 1},
        )
    message = err.value.body["message"]
    for name in ("tools", "tool_choice", "response_format", "logit_bias", "frequency_penalty", "made_up"):
        assert name in message
    ok = c.completions.create(model="tiny", prompt="hi", max_tokens=2, frequency_penalty=0, presence_penalty=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_routed_experts_are_the_rollout_engines(world):
    c = client(world["url"])
    load(world["url"], "a", world["a"])
    prompt = [5, 77, 131, 12, 300, 41]
    out = c.completions.create(
        model="a", prompt=prompt, max_tokens=5, n=2, seed=9, extra_body={"return_routed_experts": True}
    )
    learner = _learner(world, world["a"])
    factor_experts(learner)  # the experts' LoRA computed as the rollout actors (and the server) compute it
    engine = RolloutEngine(learner, [build_tokenizer().eos_token_id])
    group = engine.generate([prompt], 2, SamplingParams(temperature=1.0, max_tokens=5), seed=9)[0]
    for choice, completion in zip(out.choices, group.completions, strict=True):
        assert choice.model_extra["token_ids"] == completion.tokens_R.tolist()
        # vLLM's encoding (docs/rollout.md): base64 .npy [P+R-1, L, k], prompt rows then one row per token
        rows = np.load(io.BytesIO(base64.b64decode(choice.model_extra["routed_experts"])), allow_pickle=False)
        want = torch.cat([group.prompt_routes_P1_L_K, completion.routes_R_L_K])
        assert rows.dtype == np.uint8 and rows.tolist() == want.tolist()
        assert "prompt_routed_experts" not in choice.model_extra


def _raw(port: int, data: bytes, wait: float = 10.0) -> bytes:
    """Send bytes on a fresh connection; return the status line, headers and body that come back."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
        head, _, body = out.partition(b"\r\n\r\n")
        lengths = [
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        ]
        while lengths and len(body) < lengths[0]:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    return head + b"\r\n\r\n" + body


def test_malformed_requests_get_4xx_and_the_server_stays_up(world):
    url = world["tight"]
    port = int(url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    for length in (b"abc", b"-1"):  # the drill's dropped connection and hung handler
        assert _raw(port, head + b"Content-Length: " + length + b"\r\n\r\n" + body).startswith(b"HTTP/1.1 400")
    short = _raw(port, head + b"Content-Length: 500\r\n\r\n" + body)  # promises more than it sends
    # Cut by the server's --read-timeout (1 s), which names itself: not left to the client's socket timeout.
    assert short.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in short, short
    assert _raw(port, head + b"Content-Length: 99999999\r\n\r\n").startswith(b"HTTP/1.1 413")
    assert _raw(port, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400")
    bad_bodies = [
        b"{not json",
        b"[1, 2]",
        b'{"model": {"a": 1}, "prompt": "hi"}',
        b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
        b'{"model": "tiny", "prompt": "hi", "n": "2"}',
        b'{"model": "tiny", "prompt": "hi", "max_tokens": true}',
        b'{"model": "tiny", "prompt": [1, 99999]}',
        b'{"model": "tiny", "prompt": "hi", "stop": ""}',
        b'{"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": true}}',
        b'{"model": "tiny"}',
    ]
    for raw in bad_bodies:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        conn.request("POST", "/v1/completions", body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        assert resp.status == 400 and error["message"], (raw, error)
        conn.close()
    assert httpx.get(url + "/health", timeout=TIMEOUT).json()["status"] == "ok"
    assert client(url).completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def test_a_full_queue_gets_429_and_a_slow_request_504(world):
    """The tight server runs one request at a time with one waiting: of a burst of 6 long requests, the rest are
    refused at once (429) and the one or two admitted time out (504, 0.2 s) instead of holding the server."""
    port = int(world["tight"].rsplit(":", 1)[1])
    body = json.dumps(dict(model="tiny", prompt="hi", max_tokens=240, n=64, ignore_eos=True))
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT) for _ in range(6)]
    for conn in conns:
        conn.connect()
    barrier, results = threading.Barrier(len(conns)), [None] * len(conns)

    def fire(i: int) -> None:
        barrier.wait()
        conns[i].request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conns[i].getresponse()
        results[i] = (resp.status, json.loads(resp.read())["error"]["message"])

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(len(conns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    statuses = sorted(status for status, _ in results)
    assert statuses.count(429) >= 3 and set(statuses) <= {429, 504}, results
    assert any("queue is full" in msg for status, msg in results if status == 429)
    health = httpx.get(world["tight"] + "/health", timeout=TIMEOUT).json()
    assert health["status"] == "ok" and health["waiting"] == 0


def test_a_5xx_is_logged_with_its_traceback(caplog):
    """The drill's dict `model` got a 500 with nothing in the log: any exception in a handler now answers a 500
    and logs its traceback."""
    import asyncio

    from mint.serve._http import _guarded

    async def broken():
        raise ZeroDivisionError("a bug")

    with caplog.at_level("ERROR", logger="mint.serve"):
        response = asyncio.run(_guarded(broken)())
    assert response.status_code == 500 and json.loads(response.body)["error"]["code"] == 500
    assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)
