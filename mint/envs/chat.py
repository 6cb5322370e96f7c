"""Chat messages as token deltas: what an environment appends after an action, rendered by the family's template.

An environment that talks in chat messages never re-renders the conversation into ids: the action's ids stay as
sampled, and the next observation is the text the chat template adds after the assistant's turn, encoded alone.

    action      the sampled ids: "...answer<|im_end|>" (the end-of-turn id is the stop token, sampled and kept)
    observation the template's text after that end-of-turn marker, up to and including the next generation prompt:
                "\\n<|im_start|>user\\nwrong, try again<|im_end|>\\n<|im_start|>assistant\\n"

The delta is found by rendering the conversation with and without the new messages. That only works for a template
that is append-only: rendering one more message must leave the text before it unchanged. Templates that rewrite the
past are not (Qwen3's drops earlier turns' reasoning blocks); their episodes would train on a context the model never
saw at sampling time, so `check_append_only` refuses them in preflight with one line.
"""

from __future__ import annotations

from collections.abc import Sequence

Message = dict[str, str]

# A conversation that touches every role an environment appends, with text no template rewrites.
_PROBE: list[Message] = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "first answer"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "second answer"},
]


class TemplateNotAppendOnly(ValueError):
    """The tokenizer's chat template rewrites earlier text when a message is added."""


def _render(tokenizer, messages: Sequence[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def check_append_only(tokenizer) -> None:
    """Raise TemplateNotAppendOnly (one line) unless each message the probe conversation adds leaves the text before
    it as it was, and the generation prompt is a pure suffix."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateNotAppendOnly("the tokenizer has no chat template; a chat environment renders through one")
    for n in range(1, len(_PROBE)):
        before, after = _render(tokenizer, _PROBE[:n], False), _render(tokenizer, _PROBE[: n + 1], False)
        prompted = _render(tokenizer, _PROBE[:n], True)
        if not after.startswith(before) or not prompted.startswith(before):
            raise TemplateNotAppendOnly(
                f"the chat template rewrites earlier text when message {n + 1} ({_PROBE[n]['role']}) is added, so an "
                "episode's later turns would see a context its earlier ones did not; use an append-only template"
            )


def observation_delta(
    tokenizer, history: Sequence[Message], new: Sequence[Message], end_of_turn: str, closed: bool = True
) -> list[int]:
    """The ids to append after an assistant action that ended with `end_of_turn` (its text, e.g. "<|im_end|>"):
    whatever the template puts after that marker, then `new` rendered, then the generation prompt. `closed=False`:
    the action was cut by its token budget before the marker, so the delta starts with the marker (the template
    never shows a turn without one).

    history: the conversation so far, ending with the assistant's message (its text as decoded: only the template's
    text after its end-of-turn marker is used, so a decode that does not round-trip changes nothing here)."""
    if not history or history[-1]["role"] != "assistant":
        raise ValueError("observation_delta: history must end with the assistant's message")
    before = _render(tokenizer, history, False)
    after = _render(tokenizer, [*history, *new], True)
    if not after.startswith(before):
        raise TemplateNotAppendOnly("the chat template rewrote the conversation when a message was added")
    cut = before.rfind(end_of_turn)
    if cut < 0:
        raise ValueError(f"observation_delta: the template does not end an assistant turn with {end_of_turn!r}")
    text = ("" if closed else end_of_turn) + before[cut + len(end_of_turn) :] + after[len(before) :]
    return tokenizer.encode(text, add_special_tokens=False)
