"""The embedded tiny bases behind `tiny:<family>`: a local tokenizer, a tiny MoE (or dense) model, a brief pretrain.

RL post-training starts from a pretrained base, and a frozen *random* tiny MoE barely learns the synthetic task by
GRPO with LoRA. So `build_tiny` first trains the full model, supervised, on chat-formatted examples of the built-in
tasks (`first_last` and `arithmetic`, half each) to a *partial* skill: its answer distribution is the optimum of
cross-entropy against noisy labels, where the target is the correct digit with probability q (`label_accuracy`) and a
uniform random digit otherwise:

    p(correct) = q + (1 - q) / 10,    p(each wrong digit) = (1 - q) / 10.

With q = 0.3 the correct digit is the mode (0.37 against 0.07 each), so greedy decoding is right while sampling at T=1
is right about a third of the time: a base that "knows but is unreliable", which RL can sharpen. (The build stops
short of that optimum: measured p(correct) is 0.25-0.28, see TinyRecipe.)

Two phases, because plain noisy labels are too slow (measured on qwen3_moe, 1 CPU thread, batch 64): after 600 steps
(41 s) greedy accuracy was 0.55 and p(correct) 0.18, short of both the skill and the calibration. The expected
noisy-label loss alone got there but needed 400 steps (23-25 s per family), and at 300 steps greedy was still 0.74-0.79.

1. Skill: clean labels until the running loss falls below `skill_loss` (first_last alone: 145-225 steps of batch 32,
   5-8 s; with arithmetic in the mix: 591 steps on qwen3_moe, 974 on qwen2_moe).
2. Calibrate: `calibrate_steps` steps on the *expected* noisy-label loss: the answer position's target is the
   distribution above rather than one sampled digit. Same optimum, no label noise in the gradient. The digit fed back
   as input before `<|im_end|>` is still sampled noisily, so the model learns to stop after any digit. The readout
   (final norm and lm_head) is frozen in this phase; see `_pretrain` for the measured reason.

Why arithmetic is in the mix: recipes/arithmetic_cpu.toml trains on held-out arithmetic problems, and RL needs a base
with a partial skill there too. All 990 arithmetic problems occur in pretraining (with noisy labels); what the recipe
holds out is problems from GRPO, not from the base.

Loss covers only the answer token and `<|im_end|>`. Nothing here downloads anything. A build is deterministic given
the seed and the CPU's float kernels, not across kernels, so the default builds are shipped in the package
(`tiny_ship`); `ensure_tiny` copies one into `$MINT_CACHE/tiny/` (default `~/.cache/mint/tiny/`), in a folder keyed
by a hash of the recipe, written atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from mint.errors import ConfigError
from mint.models import tiny_ship
from mint.models.specs import MLA_FAMILIES, TINY_FAMILIES, TINY_PREFIX, tiny_config
from mint.rl.tasks import Example, get_task

log = logging.getLogger(__name__)

# Bump when anything that changes a build's bytes changes (tokenizer corpus, training loop, saved files): the cache
# key includes it, so a stale cached base is never reused.
BUILD_VERSION = 3

ENDOFTEXT = "<|endoftext|>"  # pad
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # eos: ends an assistant turn
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2's pre-tokenizer split: every digit is its own piece, so each answer "0".."9" is one token whatever follows.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen's ChatML template without Qwen's default system prompt (it would triple every prompt's length).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

VOCAB_SIZE = 384
TASKS = ("first_last", "arithmetic")  # the pretraining mix: each example from one, uniformly
MLA_RECIPE = {"steps": 3000, "calibrate_steps": 1000}  # MLA_FAMILIES' departures from the default: decisions.md
MANIFEST = "mint_tiny.json"
# A cache entry is valid only when all of these exist; the manifest is written last.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MANIFEST)
# Temp build folders older than this are leftovers of a crashed build (a build takes seconds) and are removed.
STALE_TEMP_SECONDS = 3600

# Generic text for the tokenizer, so that ordinary English and arithmetic get a few merges too.
_GENERIC_TEXT = (
    "What is the sum of two numbers? The answer is one number, not a question.",
    "Count from zero to nine: one, two, three, four, five, six, seven, eight.",
    "A model with experts routes each token to a layer; the router picks which expert.",
    "Train the policy with a reward, then test it. Please say yes or no, true or false.",
    "Hello world! Thanks for asking how, why and when: add, plus, minus, times, equals.",
)


def _corpus() -> Iterator[str]:
    """Tokenizer training text: chat-formatted task examples plus generic words, arithmetic and a system turn."""
    rng = random.Random("mint-tiny-tokenizer")
    task = _Mix()
    for _ in range(4000):
        ex = task.sample(rng)
        yield f"{IM_START}user\n{ex.prompt}{IM_END}\n{IM_START}assistant\n{ex.answer}{IM_END}\n"
    words = " ".join(_GENERIC_TEXT).split()
    for _ in range(1000):
        a, b = rng.randrange(100), rng.randrange(100)
        yield f"{a} + {b} = {a + b}. {a} - {b} = {a - b}. {a} * {b} = {a * b}."
        yield " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize() + "."
    for _ in range(200):
        yield f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A Qwen-style byte-level BPE of 384 tokens, trained locally on task text; any text still tokenizes.

    The ByteLevel alphabet (all 256 bytes) is in the initial vocabulary, so unseen text falls back to byte tokens.
    The corpus is fixed, so every call returns the same vocabulary and merges.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
    )


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines a tiny base's bytes; its hash (with BUILD_VERSION) keys the cache folder."""

    family: str  # one of TINY_FAMILIES
    seed: int = 0  # seeds the init, the training stream, and the held-out evaluation
    # q: probability that a noisy target is the correct digit, so p(correct) = q + (1 - q)/10 = 0.37 at the optimum.
    # With two tasks sharing the body, calibration ends below it: measured p(correct) on first_last 0.28 (qwen3_moe)
    # and 0.25 (qwen2_moe), greedy still right 0.95 / 0.94 of the time. At q = 0.2 (the first_last-only build's
    # value) the mix ended at 0.17 / 0.14 with greedy 0.78 / 0.56: too blurred to keep the skill.
    label_accuracy: float = 0.3
    steps: int = 1500  # skill-phase cap; seed 0 stops at 591 (qwen3_moe), 974 (qwen2_moe); MLA: MLA_RECIPE
    # Steps on the expected noisy-label loss, lr decaying linearly from calibrate_lr to 0. At the skill phase's
    # lr (3e-3, 200 steps) the mix lost its greedy skill (first_last 0.78 on qwen3_moe); at 1e-3 and 300 steps, 0.89.
    calibrate_steps: int = 300
    calibrate_lr: float = 1e-3
    skill_loss: float = 0.1  # skill phase ends when the loss EMA (decay 0.9) falls below this
    batch_size: int = 32  # examples per step, both phases
    lr: float = 3e-3  # 5e-3 stalled qwen2_moe for 2 of 3 seeds within 400 steps
    init_std: float = 0.02  # initializer_range of the random init

    def __post_init__(self) -> None:  # a field left at the class default takes the family's value
        for name, value in MLA_RECIPE.items() if self.family in MLA_FAMILIES else ():
            if getattr(self, name) == getattr(TinyRecipe, name):
                object.__setattr__(self, name, value)

    def key(self) -> str:
        blob = json.dumps({"version": BUILD_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def build(self, directory: str) -> None:
        """Build this recipe's base into `directory` on this machine (`build_tiny`)."""
        build_tiny(
            self.family, directory, seed=self.seed, label_accuracy=self.label_accuracy, steps=self.steps,
            calibrate_steps=self.calibrate_steps,
        )  # fmt: skip


@contextlib.contextmanager
def _deterministic(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator (restored after) and use one thread: splitting reductions changes the last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(threads)


def _chat_prompts(tokenizer: PreTrainedTokenizerFast, examples: list[Example]) -> list[str]:
    conversations = [[{"role": "user", "content": ex.prompt}] for ex in examples]
    return tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)


def _noisy_digit(ex: Example, q: float, rng: random.Random) -> str:
    """The correct answer with probability q, else a uniform digit (possibly the correct one)."""
    return ex.answer if rng.random() < q else str(rng.randrange(10))


def _answer_loss(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, examples: list[Example], q: float, rng: random.Random
) -> torch.Tensor:
    """Mean over the B examples of (CE(answer) + CE(<|im_end|>)) / 2 under the expected noisy-label target.

    The answer position's target puts q + (1 - q)/10 on the correct digit and (1 - q)/10 on each other digit; q = 1
    is plain cross-entropy. Rows are [prompt, digit, <|im_end|>], right-padded, with the digit drawn noisily.
    """
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    digit_ids = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    prompts = tokenizer(_chat_prompts(tokenizer, examples), add_special_tokens=False)["input_ids"]
    inputs = tokenizer.convert_tokens_to_ids([_noisy_digit(ex, q, rng) for ex in examples])
    B, T = len(examples), max(len(p) for p in prompts) + 2
    ids_B_T = torch.full((B, T), tokenizer.pad_token_id, dtype=torch.long)
    mask_B_T = torch.zeros((B, T), dtype=torch.long)
    for i, (p, digit) in enumerate(zip(prompts, inputs, strict=True)):
        ids_B_T[i, : len(p) + 2] = torch.tensor([*p, digit, im_end])
        mask_B_T[i, : len(p) + 2] = 1
    answer_pos_B = torch.tensor([len(p) - 1 for p in prompts])  # the position whose logits predict the answer
    rows_B = torch.arange(B)
    logp_B_T_V = model(input_ids=ids_B_T, attention_mask=mask_B_T).logits.float().log_softmax(-1)
    target_B_V = torch.zeros(B, logp_B_T_V.shape[-1])
    target_B_V[:, digit_ids] = (1.0 - q) / 10
    target_B_V[rows_B, torch.tensor(tokenizer.convert_tokens_to_ids([ex.answer for ex in examples]))] += q
    answer_ce_B = -(target_B_V * logp_B_T_V[rows_B, answer_pos_B]).sum(-1)
    end_ce_B = -logp_B_T_V[rows_B, answer_pos_B + 1, im_end]
    return (answer_ce_B + end_ce_B).mean() / 2


class _Mix:
    """The pretraining stream: each example from one of TASKS, chosen uniformly."""

    def __init__(self):
        self.tasks = [get_task(name) for name in TASKS]

    def sample(self, rng: random.Random) -> Example:
        return self.tasks[rng.randrange(len(self.tasks))].sample(rng)


def heldout_examples(
    n: int, seed: int = 0, exclude: set[str] | frozenset[str] = frozenset(), task: str = TASKS[0]
) -> list[Example]:
    """n examples of `task` from a stream independent of pretraining's, skipping prompts in `exclude`."""
    rng = random.Random(f"mint-tiny-eval-{seed}-{task}")
    task = get_task(task)
    out: list[Example] = []
    while len(out) < n:
        ex = task.sample(rng)
        if ex.prompt not in exclude:
            out.append(ex)
    return out


@torch.no_grad()
def answer_accuracy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, examples: list[Example], *, seed: int = 0
) -> dict[str, float]:
    """Exact-match accuracy of generated answers: `greedy`, and `sampled` at T=1 (one sample per prompt, seeded).

    Also `expected`: mean p(correct answer token | prompt), the T=1 accuracy that `sampled` estimates.
    """
    was_training = model.training
    model.eval()
    batch = tokenizer(
        _chat_prompts(tokenizer, examples),
        add_special_tokens=False,
        padding=True,
        padding_side="left",
        return_tensors="pt",
    )
    width = batch["input_ids"].shape[1]
    answer_ids_B = torch.tensor(tokenizer.convert_tokens_to_ids([ex.answer for ex in examples]))
    probs_B_V = model(**batch).logits[:, -1].float().softmax(-1)
    out = {"expected": probs_B_V.gather(1, answer_ids_B[:, None]).mean().item()}
    for name, sampling in (("greedy", {"do_sample": False}), ("sampled", {"do_sample": True, "temperature": 1.0})):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            tokens_B_N = model.generate(
                **batch,
                **sampling,
                top_k=None,
                top_p=None,
                max_new_tokens=4,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        texts = tokenizer.batch_decode(tokens_B_N[:, width:], skip_special_tokens=True)
        out[name] = sum(t.strip() == ex.answer for t, ex in zip(texts, examples, strict=True)) / len(examples)
    model.train(was_training)
    return out


def _pretrain(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, recipe: TinyRecipe) -> dict:
    """Skill phase, then calibration phase (module docstring). Returns the training facts for the manifest."""
    rng = random.Random(f"mint-tiny-train-{recipe.seed}")
    task = _Mix()
    seen: set[str] = set()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()

    def step(q: float, lr: float) -> float:
        examples = [task.sample(rng) for _ in range(recipe.batch_size)]
        seen.update(ex.prompt for ex in examples)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = _answer_loss(model, tokenizer, examples, q, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    start = time.perf_counter()
    ema, skill_steps = None, 0
    while skill_steps < recipe.steps and (ema is None or ema >= recipe.skill_loss):
        loss = step(1.0, recipe.lr * min((skill_steps + 1) / 20, 1.0))  # 20-step warmup
        ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        skill_steps += 1
    if ema is not None and ema >= recipe.skill_loss:
        msg = "tiny %s: skill loss %.3f still above %.3f after %d steps"
        log.warning(msg, recipe.family, ema, recipe.skill_loss, skill_steps)
    loss = ema
    # The readout (final norm + lm_head) keeps the sharp scale the skill phase gave it; calibration has to blur the
    # answer inside the body, which LoRA can reach. Calibrating the readout too capped what LoRA could recover:
    # supervised LoRA on the correct answers plateaued at p(correct) 0.94 (qwen3_moe, seed 0).
    for p in [*model.get_output_embeddings().parameters(), *model.model.norm.parameters()]:
        p.requires_grad_(False)
    for i in range(recipe.calibrate_steps):
        loss = step(recipe.label_accuracy, recipe.calibrate_lr * (1.0 - i / recipe.calibrate_steps))
    return {
        "pretrain_seconds": round(time.perf_counter() - start, 3),
        "skill_steps": skill_steps,
        "skill_loss": None if ema is None else round(ema, 4),
        "final_loss": None if loss is None else round(loss, 4),
        "seen_prompts": seen,
    }


def build_tiny(
    family: str,
    directory: str,
    *,
    seed: int = 0,
    label_accuracy: float = TinyRecipe.label_accuracy,
    steps: int = TinyRecipe.steps,
    calibrate_steps: int = TinyRecipe.calibrate_steps,
    eval_examples: int = 400,
) -> str:
    """Build, pretrain and save a tiny base of `family` into `directory` (created if needed); return `directory`.

    Saves the model (safetensors, eos = <|im_end|>, pad = <|endoftext|>), the tokenizer with its chat template, and
    `mint_tiny.json`: the recipe, measured pretraining seconds, and accuracies on `eval_examples` held-out prompts of
    each task (`accuracy_by_task`; `accuracy` is first_last's).
    """
    if family not in TINY_FAMILIES:
        raise ConfigError(f"model.path: unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    if not 0.0 <= label_accuracy <= 1.0:
        raise ConfigError(f"tiny label_accuracy must be in [0, 1], got {label_accuracy}")
    recipe = TinyRecipe(family, seed=seed, label_accuracy=label_accuracy, steps=steps, calibrate_steps=calibrate_steps)
    tokenizer = build_tokenizer()
    im_end, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.pad_token_id
    with _deterministic(seed):
        config = tiny_config(
            family,
            vocab_size=len(tokenizer),
            initializer_range=recipe.init_std,
            eos_token_id=im_end,
            pad_token_id=pad,
            bos_token_id=None,
        )
        model = AutoModelForCausalLM.from_config(config)
        facts = _pretrain(model, tokenizer, recipe)
        model.eval()
        seen = facts.pop("seen_prompts")
        accuracy = {
            # arithmetic has 990 problems and pretraining draws each several times: nothing is unseen there.
            name: answer_accuracy(
                model,
                tokenizer,
                heldout_examples(eval_examples, seed, seen if name == "first_last" else set(), name),
                seed=seed,
            )
            for name in TASKS
        }
    model.generation_config.eos_token_id = im_end
    model.generation_config.pad_token_id = pad
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    manifest = {
        "version": BUILD_VERSION,
        "recipe": dataclasses.asdict(recipe),
        "tasks": list(TASKS),
        "vocab_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        **facts,
        "heldout_examples": eval_examples,
        "accuracy": {k: round(v, 4) for k, v in accuracy[TASKS[0]].items()},
        "accuracy_by_task": {name: {k: round(v, 4) for k, v in acc.items()} for name, acc in accuracy.items()},
    }
    log.info("tiny %s built in %s: %s", family, directory, manifest)
    with open(os.path.join(directory, MANIFEST), "w") as f:  # last: its presence marks a complete build
        json.dump(manifest, f, indent=2)
    return directory


def default_cache_dir() -> str:
    return os.environ.get("MINT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mint")


def is_complete(directory: str) -> bool:
    """Whether `directory` holds a finished build: every required file present and non-empty."""
    return all(
        os.path.isfile(p) and os.path.getsize(p) > 0 for p in (os.path.join(directory, f) for f in REQUIRED_FILES)
    )


def _remove_stale_temps(parent: str, name: str) -> None:
    now = time.time()
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        with contextlib.suppress(OSError):  # another process may remove it first
            if entry.startswith(f".{name}.tmp-") and now - os.path.getmtime(path) > STALE_TEMP_SECONDS:
                shutil.rmtree(path)


def _is_valid(directory: str, shipped: str | None) -> bool:
    """A complete build that, when a base is shipped for its key, holds the shipped bytes (not a local build's)."""
    return is_complete(directory) and (
        shipped is None or tiny_ship.matches(directory, tiny_ship.read_manifest(shipped)["sha256"])
    )


def ensure_tiny(family: str, cache_dir: str | None = None) -> str:
    """Path of the cached default base of `family`: the shipped one copied in (ms), or built here (seconds) if absent.

    The folder is `<cache_dir>/tiny/<family>-<recipe hash>`, with cache_dir defaulting to $MINT_CACHE, else
    ~/.cache/mint. When `mint/models/tiny_bases/` ships a base for the recipe key (tiny_ship says why), that is copied
    and its digests checked, and a cached folder holding other bytes (built here before the base was shipped) is
    replaced; otherwise the base is built on this machine, and its bytes are this machine's CPU kernels'. Either way
    the files go into a temp folder beside the target and are renamed into place, so readers never see a partial
    base; when two processes race, the first rename wins and the other uses it. An incomplete folder is replaced.
    """
    if family not in TINY_FAMILIES:
        raise ConfigError(f"model.path: unknown tiny family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    recipe = TinyRecipe(family)
    parent = os.path.join(cache_dir or default_cache_dir(), "tiny")
    name = f"{family}-{recipe.key()}"
    target = os.path.join(parent, name)
    shipped = tiny_ship.shipped_path(name)
    if _is_valid(target, shipped):
        return target
    os.makedirs(parent, exist_ok=True)
    _remove_stale_temps(parent, name)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        if shipped is not None:
            tiny_ship.copy_verified(shipped, tmp)
        else:
            log.warning(
                "tiny %s: no shipped base for recipe key %s; building it here, so its bytes (and starting skill) are "
                "this machine's (CPU capability %s). `make tiny-bases` ships it.",
                family,
                recipe.key(),
                torch.backends.cpu.get_cpu_capability(),
            )
            recipe.build(tmp)
        for _ in range(3):
            try:
                os.rename(tmp, target)  # atomic; fails if target exists and is not empty
                return target
            except OSError:
                if _is_valid(target, shipped):  # another process won the race: use theirs
                    return target
                if os.path.isdir(target):  # incomplete leftover, or a local build of a shipped key: move it aside
                    trash = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
                    with contextlib.suppress(OSError):
                        os.rename(target, os.path.join(trash, "old"))
                    shutil.rmtree(trash, ignore_errors=True)
        raise OSError(f"could not move the tiny base {tmp} into place at {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(spec: str, cache_dir: str | None = None) -> str:
    """`tiny:<family>` -> the cached embedded base (built if absent); a hub id or local path is returned unchanged."""
    if spec.startswith(TINY_PREFIX):
        return ensure_tiny(spec[len(TINY_PREFIX) :], cache_dir)
    return spec
