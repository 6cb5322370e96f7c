"""Datasets: a prompt/answer source turned into an endless, reproducible stream of batches.

A source is `synthetic:<task>` (an infinite generator from `mint.rl.tasks`) or a local path: a `.jsonl`, `.json`,
`.parquet` or `.csv` file, or a directory written by Hugging Face `Dataset.save_to_disk`. Nothing is ever downloaded:
a source that is neither `synthetic:` nor an existing path is refused. A record holds a prompt (a string, or a list
of chat messages `{"role", "content"}`) and an answer; its other fields travel with the Example (`Example.extra`) to
the reward functions. A source is read and checked whole at load, so a bad record fails at startup with its file,
line (or row) and key, never mid-run, and no record is ever skipped.

The stream is a pure function of (dataset, seed): example position p never depends on the batch size, and batch k
of `batches(B, seed)` is positions [k*B, (k+1)*B). So `batches(B, seed, start=k)` yields exactly what an
uninterrupted stream yields after its first k batches, which is how a resumed run sees the data it would have seen.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from mint.errors import DataError
from mint.rl.tasks import ROLES, Example, FirstLastTask, get_task

SYNTHETIC_PREFIX = "synthetic:"
# .jsonl keeps its own reader (line numbers in errors, and answers of mixed types across lines, which Arrow's one
# type per column refuses); .parquet is read with pyarrow directly, which is what `datasets` would do, minus the
# cached Arrow copy of the file. .json (an array or JSON lines) and .csv go through `datasets`.
EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")


class Dataset:
    """An endless stream of Examples; `size` is the number of distinct examples, None for a synthetic task."""

    size: int | None

    def _stream(self, seed: int, position: int) -> Iterator[Example]:
        """The examples of the stream for `seed`, from `position` on."""
        raise NotImplementedError

    def batches(self, batch_size: int, seed: int, start: int = 0) -> Iterator[list[Example]]:
        """Endless batches of `batch_size` examples, starting at batch index `start` (0 for a fresh run).

        Deterministic given `seed`; skipping k batches equals `start=k`. Every batch is full: a file dataset's
        batches run on across epoch boundaries rather than ending an epoch with a short batch.
        """
        if batch_size < 1 or start < 0:
            raise ValueError(f"need batch_size >= 1 and start >= 0, got batch_size={batch_size}, start={start}")
        return self._batches(self._stream(seed, start * batch_size), batch_size)

    @staticmethod
    def _batches(stream: Iterator[Example], batch_size: int) -> Iterator[list[Example]]:
        while True:
            yield list(islice(stream, batch_size))

    def take(self, n: int, seed: int) -> list[Example]:
        """The first `n` examples of the stream for `seed`: an evaluation set.

        Use a seed other than the training seed: with the same seed these are the first training examples.
        """
        return list(islice(self._stream(seed, 0), n))


@dataclass(frozen=True)
class FileDataset(Dataset):
    """The records of a local file or saved dataset, reshuffled every epoch."""

    source: str
    examples: tuple[Example, ...] = field(repr=False)

    @property
    def size(self) -> int:
        return len(self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    def _order(self, seed: int, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        # Seeded by the string "seed/epoch", not seed + epoch: with seed + epoch a run at seed 1 would replay the
        # epochs of a run at seed 0, shifted by one. String seeds hash through sha512, so they are stable across
        # processes and PYTHONHASHSEED.
        random.Random(f"{seed}/{epoch}").shuffle(order)
        return order

    def _stream(self, seed: int, position: int) -> Iterator[Example]:
        # Only the epoch that holds `position` is shuffled to get there: skipped batches are never built.
        epoch, offset = divmod(position, len(self.examples))
        while True:
            for i in self._order(seed, epoch)[offset:]:
                yield self.examples[i]
            epoch, offset = epoch + 1, 0

    def take(self, n: int, seed: int) -> list[Example]:
        """`n` distinct examples in shuffled order; DataError if the file has fewer than `n`."""
        if n > len(self.examples):
            raise DataError(f"{self.source}: asked for {n} evaluation examples but it has only {len(self.examples)}")
        return super().take(n, seed)


@dataclass(frozen=True)
class SyntheticDataset(Dataset):
    """An infinite task: example p of the stream is the p-th draw from `random.Random(seed)`."""

    source: str
    task: FirstLastTask = field(compare=False, repr=False)  # a function of `source`; tasks compare by identity

    size = None

    def _stream(self, seed: int, position: int) -> Iterator[Example]:
        rng = random.Random(seed)
        # A sample consumes a variable number of RNG draws, so advancing means sampling: ~7 µs per example on one
        # CPU core, 0.7 s per 100k examples skipped.
        for _ in range(position):
            self.task.sample(rng)
        while True:
            yield self.task.sample(rng)


def load_dataset(source: str, prompt_key: str = "prompt", answer_key: str = "answer") -> Dataset:
    """The dataset named by `source`: `synthetic:<task>`, or a local file (.jsonl, .json, .parquet, .csv) or
    `save_to_disk` directory. Never the Hugging Face hub: save a hub dataset to disk first.

    Records need `prompt_key` (a string, or a non-empty list of {"role", "content"} messages with roles in
    system/user/assistant, string contents, the last one the user's) and `answer_key` (a string or a number;
    numbers become strings, and an integral float such as 72.0 becomes "72", since parquet often stores integer
    answers as doubles). Every other field must be a JSON value; it lands in `Example.extra`.
    """
    if source.startswith(SYNTHETIC_PREFIX):
        name = source[len(SYNTHETIC_PREFIX) :]
        return SyntheticDataset(source, get_task(name))
    path = Path(source)
    if not path.exists():
        raise DataError(
            f"{source}: no such dataset file or directory (datasets are read from local paths only, never downloaded; "
            f"for a hub dataset, save_to_disk it first, or use {SYNTHETIC_PREFIX}<task>)"
        )
    if path.is_dir():
        read = _read_saved
    else:
        suffix = path.suffix.lower()
        if suffix not in EXTENSIONS:
            raise DataError(
                f"{source}: unknown dataset extension {suffix or '(none)'!r}; expected {', '.join(EXTENSIONS)}, "
                f"a save_to_disk directory or {SYNTHETIC_PREFIX}<task>"
            )
        read = {".jsonl": _read_jsonl, ".parquet": _read_parquet}.get(suffix, _read_with_datasets)
    try:
        examples = read(source, prompt_key, answer_key)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{source}: cannot read dataset: {type(e).__name__}: {e}") from None
    if not examples:
        raise DataError(f"{source}: dataset has no records")
    return FileDataset(source, tuple(examples))


def _read_jsonl(source: str, prompt_key: str, answer_key: str) -> list[Example]:
    examples = []
    with open(source, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():  # blank lines (a trailing newline) hold no record
                continue
            where = f"{source}: line {line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
            examples.append(_to_example(record, where, prompt_key, answer_key))
    return examples


def _read_parquet(source: str, prompt_key: str, answer_key: str) -> list[Example]:
    import pyarrow as pa  # imported here: synthetic-only runs never pay for pyarrow
    import pyarrow.parquet as pq

    try:
        _check_columns(source, pq.read_schema(source).names, prompt_key, answer_key)
        rows = pq.read_table(source).to_pylist()
    except pa.ArrowException as e:
        raise DataError(f"{source}: not a readable parquet file: {_one_line(e)}") from None
    return _rows_to_examples(source, rows, prompt_key, answer_key)


def _read_with_datasets(source: str, prompt_key: str, answer_key: str) -> list[Example]:
    """A .json or .csv file through `datasets`' packaged builders (local, no hub access)."""
    import datasets  # imported here: it takes about a second

    builder = Path(source).suffix.lower().lstrip(".")
    # A throwaway cache: the rows are copied out below, so the Arrow copy `datasets` writes is not kept on disk.
    with tempfile.TemporaryDirectory(prefix="mint-data-") as cache:
        try:
            table = datasets.load_dataset(builder, data_files=source, split="train", cache_dir=cache)
        except Exception as e:  # datasets wraps parse errors in many types (DatasetGenerationError, ArrowInvalid...)
            raise DataError(f"{source}: not a readable {builder} dataset: {_one_line(e)}") from None
        _check_columns(source, table.column_names, prompt_key, answer_key)
        rows = table.to_list()
    return _rows_to_examples(source, rows, prompt_key, answer_key)


def _read_saved(source: str, prompt_key: str, answer_key: str) -> list[Example]:
    """A directory written by `Dataset.save_to_disk` (a DatasetDict's split is its subdirectory)."""
    import datasets

    try:
        table = datasets.load_from_disk(source)
    except Exception as e:  # FileNotFoundError for a directory that is not a saved dataset, and others
        raise DataError(f"{source}: not a dataset directory written by save_to_disk: {_one_line(e)}") from None
    if isinstance(table, datasets.DatasetDict):
        splits = ", ".join(f"{source.rstrip('/')}/{name}" for name in table)
        raise DataError(f"{source}: holds several splits; name one: {splits}")
    _check_columns(source, table.column_names, prompt_key, answer_key)
    return _rows_to_examples(source, table.to_list(), prompt_key, answer_key)


def _check_columns(source: str, columns: list[str], prompt_key: str, answer_key: str) -> None:
    for key in (prompt_key, answer_key):
        if key not in columns:
            raise DataError(f"{source}: no {key!r} column (columns: {', '.join(columns)})")


def _rows_to_examples(source: str, rows: list[dict], prompt_key: str, answer_key: str) -> list[Example]:
    return [_to_example(row, f"{source}: row {i} (0-based)", prompt_key, answer_key) for i, row in enumerate(rows)]


def _to_example(record: Any, where: str, prompt_key: str, answer_key: str) -> Example:
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected an object with {prompt_key!r} and {answer_key!r}, got {type(record).__name__}"
        )
    for key in (prompt_key, answer_key):
        if key not in record:
            raise DataError(f"{where}: record has no {key!r} key (keys: {', '.join(map(str, record))})")
        if record[key] is None:
            raise DataError(f"{where}: {key!r} is null")
    prompt, messages = _prompt(record[prompt_key], where, prompt_key)
    extra = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
    for key, value in extra.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise DataError(f"{where}: {key!r} is not a JSON value ({e}); drop the column or convert it") from None
    return Example(prompt, _answer_str(record[answer_key], where, answer_key), messages, extra)


def _prompt(value: Any, where: str, key: str) -> tuple[str, tuple[tuple[str, str], ...] | None]:
    """(the user message, the conversation or None) of a prompt that is a string or a list of chat messages."""
    if isinstance(value, str):
        return value, None
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} must be a string or a non-empty list of chat messages, got {_kind(value)}")
    turns = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: {key!r} message {i} must be an object with 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise DataError(f"{where}: {key!r} message {i} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: {key!r} message {i} content must be a string, got {type(content).__name__}")
        turns.append((role, content))
    if turns[-1][0] != "user":
        raise DataError(f"{where}: {key!r} must end with a user message (the model answers it), not {turns[-1][0]!r}")
    return turns[-1][1], tuple(turns)


def _kind(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _answer_str(value: Any, where: str, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):  # NaN is how pandas writes a missing value
            raise DataError(f"{where}: {key!r} is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    raise DataError(f"{where}: {key!r} must be a string or a number, got {type(value).__name__}")


# The held-out draw of a synthetic eval task: far from grpo.seed + step, the training draws; 64 prompts when
# eval.max_prompts is 0.
EVAL_SEED = 7_000_003
SYNTHETIC_EVAL_PROMPTS = 64


def eval_examples(source: str, max_prompts: int, prompt_key: str = "prompt", answer_key: str = "answer"):
    """(the held-out prompts a run evaluates, whether they are draws of an endless synthetic task): the first
    `max_prompts` of a file dataset (all when 0), or a draw with EVAL_SEED from a synthetic one. ([], False) without
    a source. Raises DataError as load_dataset does."""
    if not source:
        return [], False
    dataset = load_dataset(source, prompt_key, answer_key)
    if isinstance(dataset, FileDataset):
        return list(dataset.examples[:max_prompts] if max_prompts else dataset.examples), False
    return dataset.take(max_prompts or SYNTHETIC_EVAL_PROMPTS, EVAL_SEED), True
