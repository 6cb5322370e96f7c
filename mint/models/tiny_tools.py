"""The tiny tool base: `tiny:qwen3_moe` further pretrained to call the `lookup` tool (mint.envs.lookup), partly.

GRPO on the lookup environment needs a base that already writes a readable call and copies the tool's answer, but
does not yet call every time: then episodes that call score 1, direct guesses score 0.1, and the group advantage
raises the calling rate. So this continues the shipped qwen3_moe base (its tokenizer and weights), full model,
supervised, on lookup episodes tokenized exactly as the environment builds them (the prompt, each action's ids with
<|im_end|>, the observation delta of `mint.envs.chat`):

    with probability CALL_RATE  "What is the value of q?" -> call lookup(q) -> <tool_response> 7 -> "7"
    otherwise                   "What is the value of q?" -> a uniform digit (a guess)

Loss is on the actions' tokens only. The first action token (call or digit) takes the *expected* target (CALL_RATE on
the call's first token, (1 - CALL_RATE) / 10 on each digit) rather than the sampled branch, as `tiny._answer_loss`
does for noisy labels: the same optimum without the label noise, so the calling rate lands near CALL_RATE.

Build: `python -m mint.models.tiny_tools` writes `mint/models/tiny_tool_bases/qwen3_moe-lookup/` (recipes point
`model.path` at it) with `mint_tiny.json`: the recipe, measured skill, and every file's sha256 (`tiny_ship`). It is
shipped, not built on first use, for tiny_ship's reason: the bytes follow the CPU's float kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from mint.models import tiny_ship
from mint.models.tiny import _deterministic, ensure_tiny

BASE = "qwen3_moe"
# qwen3_moe for the built-in engine; qwen3 (dense) for vLLM's CPU build, which serves LoRA on dense bases only.
BASES = ("qwen3_moe", "qwen3")


def shipped_dir(base: str = BASE) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_tool_bases", f"{base}-lookup")


SHIPPED = shipped_dir()
CALL_RATE = 0.35  # start of RL: about 0.35 * 1 + 0.65 * 0.1 = 0.42 expected reward, headroom 0.58
# 400 steps at lr 2e-3 left the key half-copied (measured: calls 0.29, key right in 0.54 of them, 5% unreadable);
# 1200 at 3e-3 (160-230 s on 1 thread) gave calls 0.345, key and value right in every one, none unreadable.
STEPS = 1200
BATCH = 32
LR = 3e-3
SEED = 0

# The lookup environment's text, spelled out here because mint.models sits below mint.envs (tests/test_layers.py);
# tests/test_lookup_env.py checks that `episode` gives the ids the environment gives, token for token.
KEYS = "abcdefghijklmnopqrstuvwxyz"


def question(key: str) -> str:
    return f"What is the value of {key}?"


def call_text(key: str) -> str:
    """A Hermes tool call of lookup(key), as `mint.envs.tool_calls.render_turn` writes it."""
    return "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"key": key}}) + "\n</tool_call>"


def _observation(tokenizer, key: str, value: str) -> list[int]:
    """The ids after the call's <|im_end|>: a user turn with the <tool_response>, then the generation prompt (the
    template's delta, as `mint.envs.chat.observation_delta` renders it)."""
    history = [{"role": "user", "content": question(key)}, {"role": "assistant", "content": call_text(key)}]
    response = {"role": "user", "content": f"<tool_response>\n{value}\n</tool_response>"}
    before = tokenizer.apply_chat_template(history, tokenize=False)
    after = tokenizer.apply_chat_template([*history, response], tokenize=False, add_generation_prompt=True)
    text = before[before.rfind(tokenizer.eos_token) + len(tokenizer.eos_token) :] + after[len(before) :]
    return tokenizer.encode(text, add_special_tokens=False)


def _prompt(tokenizer, key: str) -> list[int]:
    messages = [{"role": "user", "content": question(key)}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def episode(tokenizer: PreTrainedTokenizerFast, key: str, value: str, guess: str | None) -> tuple[list[int], list[int]]:
    """One episode's ids and loss mask (1 on action tokens): a call then `value`, or, with `guess`, a direct answer."""
    eos = tokenizer.eos_token_id
    ids = _prompt(tokenizer, key)
    mask = [0] * len(ids)

    def act(text: str) -> None:
        action = [*tokenizer.encode(text, add_special_tokens=False), eos]
        ids.extend(action)
        mask.extend([1] * len(action))

    if guess is not None:
        act(guess)
        return ids, mask
    act(call_text(key))
    obs = _observation(tokenizer, key, value)
    ids.extend(obs)
    mask.extend([0] * len(obs))
    act(value)
    return ids, mask


def _loss(model: PreTrainedModel, tokenizer, rng: random.Random) -> torch.Tensor:
    """Hard cross-entropy on the action tokens after the first, plus the first token's expected-target CE."""
    digit_ids = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    call_first = tokenizer.encode(call_text("a"), add_special_tokens=False)[0]
    rows = []
    for _ in range(BATCH):
        key, value = rng.choice(KEYS), str(rng.randrange(10))
        guess = None if rng.random() < CALL_RATE else str(rng.randrange(10))
        rows.append(episode(tokenizer, key, value, guess))
    B, T = len(rows), max(len(ids) for ids, _ in rows)
    ids_B_T = torch.full((B, T), tokenizer.pad_token_id, dtype=torch.long)
    attn_B_T = torch.zeros((B, T), dtype=torch.long)
    mask_B_T = torch.zeros((B, T))
    for i, (ids, mask) in enumerate(rows):
        ids_B_T[i, : len(ids)] = torch.tensor(ids)
        attn_B_T[i, : len(ids)] = 1
        mask_B_T[i, : len(ids)] = torch.tensor(mask, dtype=torch.float)
    first_B = mask_B_T.argmax(1)  # the first action token's position
    logp_B_T_V = model(input_ids=ids_B_T, attention_mask=attn_B_T).logits.float().log_softmax(-1)
    # Position t predicts token t + 1.
    target_logp_B_T = logp_B_T_V[:, :-1].gather(2, ids_B_T[:, 1:, None])[..., 0]
    rest_B_T = mask_B_T[:, 1:].clone()
    rows_B = torch.arange(B)
    rest_B_T[rows_B, first_B - 1] = 0.0
    hard = -(target_logp_B_T * rest_B_T).sum() / rest_B_T.sum()
    target_B_V = torch.zeros(B, logp_B_T_V.shape[-1])
    target_B_V[:, digit_ids] = (1.0 - CALL_RATE) / 10
    target_B_V[:, call_first] = CALL_RATE
    soft = -(target_B_V * logp_B_T_V[rows_B, first_B - 1]).sum(-1).mean()
    return hard + soft


@torch.no_grad()
def measure(model: PreTrainedModel, tokenizer, n: int = 200, seed: int = 1) -> dict[str, float]:
    """Sampled at T=1, one episode per held-out (key, value): `call_rate` (the first action is a call, written
    exactly as trained), `parse_errors` (neither a call nor a number), `key_copied` (of calls, the asked key),
    `value_copied` (of those, the answer is the value) and `reward` (the environment's, averaged over the n)."""
    model.eval()
    rng = random.Random(f"mint-tiny-tools-eval-{seed}")
    eos, counts = tokenizer.eos_token_id, {"calls": 0, "errors": 0, "key": 0, "value": 0, "reward": 0.0}

    def sample(ids: list[int], max_new: int) -> list[int]:
        out = model.generate(
            torch.tensor([ids]), do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=max_new,
            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        return out[0, len(ids) :].tolist()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(n):
            key, value = rng.choice(KEYS), str(rng.randrange(10))
            ids = _prompt(tokenizer, key)
            action = sample(ids, 80)
            text = tokenizer.decode(action, skip_special_tokens=True)
            called = next((k for k in KEYS if text == call_text(k)), None)  # stricter than the environment's parse
            if called is None and not text.strip().isdigit():
                counts["errors"] += 1
                continue
            if called is None:
                counts["reward"] += float(text.strip() == value)
                continue
            counts["calls"] += 1
            if called != key:
                continue
            counts["key"] += 1
            obs = _observation(tokenizer, key, value)
            answer = tokenizer.decode(sample([*ids, *action, *obs], 4), skip_special_tokens=True)
            counts["value"] += answer.strip() == value
            counts["reward"] += float(answer.strip() == value)
    calls = max(counts["calls"], 1)
    return {
        "call_rate": counts["calls"] / n,
        "parse_errors": counts["errors"] / n,
        "key_copied": counts["key"] / calls,
        "value_copied": counts["value"] / max(counts["key"], 1),
        "reward": counts["reward"] / n,
    }


def build(directory: str, steps: int = STEPS, base: str = BASE) -> dict:
    """Continue the shipped `tiny:<base>` on lookup episodes (module docstring) and save it into `directory`."""
    source = ensure_tiny(base)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    rng = random.Random(f"mint-tiny-tools-{SEED}")
    with _deterministic(SEED):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
        start, ema = time.perf_counter(), None
        for i in range(steps):
            for group in opt.param_groups:  # 20-step warmup, then linear decay to 0
                group["lr"] = LR * min((i + 1) / 20, 1.0 - i / steps)
            loss = _loss(model, tokenizer, rng)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
            if i % 50 == 0:
                print(f"step {i} loss {ema:.4f} {time.perf_counter() - start:.1f}s", flush=True)
        seconds = time.perf_counter() - start
        skill = measure(model, tokenizer)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    for name in os.listdir(source):  # the base's tokenizer files as shipped, byte for byte
        if name.startswith(("tokenizer", "chat_template")):
            shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
    digests = {n: tiny_ship.file_sha256(os.path.join(directory, n)) for n in sorted(os.listdir(directory))}
    manifest = {
        "base": f"tiny:{base}",
        "base_sha256": tiny_ship.read_manifest(source)["sha256"]["model.safetensors"],
        "recipe": {"call_rate": CALL_RATE, "steps": steps, "batch_size": BATCH, "lr": LR, "seed": SEED},
        "pretrain_seconds": round(seconds, 1),
        "final_loss": round(ema, 4),
        "skill": {k: round(v, 4) for k, v in skill.items()},
        "built_with": {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "sha256": digests,
    }
    tiny_ship.write_json(os.path.join(directory, tiny_ship.MANIFEST), manifest)
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mint.models.tiny_tools", description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=BASE, choices=BASES, help="the tiny base to continue")
    parser.add_argument("--out", default=None, help="folder to write (default: the base's shipped one)")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    args.out = args.out or shipped_dir(args.base)
    parent = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-tools.tmp-", dir=parent)
    try:
        print(build(tmp, args.steps, args.base))
        os.chmod(tmp, 0o755)  # mkdtemp's and mkstemp's 0700/0600 would ship as they are
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        tiny_ship.replace_dir(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
