"""A record's prompt as the token ids every engine samples from, and the stop tokens as ids: one rendering for the
rollout actors, preflight's length checks and `mint serve`, so what preflight measures is what the engines see."""

from __future__ import annotations

from mint.errors import ConfigError
from mint.rl.tasks import Example


def prompt_tokens(tokenizer, example: Example, system_prompt: str = "") -> list[int]:
    """The chat-templated prompt (a record's own messages, or its prompt as the user turn), ending with the assistant
    header, as token ids."""
    text = tokenizer.apply_chat_template(example.chat(system_prompt), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, stop_tokens: list[str]) -> tuple[int, ...]:
    ids = []
    for tok in stop_tokens:
        enc = tokenizer(tok, add_special_tokens=False)["input_ids"]
        if len(enc) != 1:
            raise ConfigError(f"rollout.stop_tokens: {tok!r} is {len(enc)} tokens for this tokenizer, not one")
        ids.append(enc[0])
    return tuple(ids)
