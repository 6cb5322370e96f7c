"""Datasets: a prompt/answer source turned into an endless, reproducible stream of batches.

A source is `synthetic:<task>` (an infinite generator from `mint.rl.tasks`) or a `.jsonl` / `.parquet` file whose
records hold a prompt field and an answer field. A file is read and checked whole at load, so a bad record fails at
startup with its file, line (or row) and key, never mid-run, and no record is ever skipped.

The stream is a pure function of (dataset, seed): example position p never depends on the batch size, and batch k
of `batches(B, seed)` is positions [k*B, (k+1)*B). So `batches(B, seed, start=k)` yields exactly what an
uninterrupted stream yields after its first k batches, which is how a resumed run sees the data it would have seen.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from mint.errors import DataError
from mint.rl.tasks import Example, FirstLastTask, get_task

SYNTHETIC_PREFIX = "synthetic:"
EXTENSIONS = (".jsonl", ".parquet")


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
    """The records of a .jsonl or .parquet file, reshuffled every epoch."""

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
    """The dataset named by `source`: `synthetic:<task>`, or a path to a .jsonl or .parquet file.

    File records need `prompt_key` (a string) and `answer_key` (a string or a number; numbers become strings, and an
    integral float such as 72.0 becomes "72", since parquet often stores integer answers as doubles).
    """
    if source.startswith(SYNTHETIC_PREFIX):
        name = source[len(SYNTHETIC_PREFIX) :]
        return SyntheticDataset(source, get_task(name))
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix not in EXTENSIONS:
        raise DataError(
            f"{source}: unknown dataset extension {suffix or '(none)'!r}; expected .jsonl, .parquet or "
            f"{SYNTHETIC_PREFIX}<task>"
        )
    if not path.is_file():
        raise DataError(f"{source}: no such dataset file")
    read = _read_jsonl if suffix == ".jsonl" else _read_parquet
    try:
        examples = read(source, prompt_key, answer_key)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{source}: cannot read dataset: {type(e).__name__}: {e}") from None
    if not examples:
        raise DataError(f"{source}: dataset file has no records")
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
        columns = pq.read_schema(source).names
        for key in (prompt_key, answer_key):
            if key not in columns:
                raise DataError(f"{source}: no {key!r} column (columns: {', '.join(columns)})")
        table = pq.read_table(source, columns=list(dict.fromkeys((prompt_key, answer_key))))
    except pa.ArrowException as e:
        raise DataError(f"{source}: not a readable parquet file: {e}") from None
    prompts, answers = table.column(prompt_key).to_pylist(), table.column(answer_key).to_pylist()
    return [
        _to_example({prompt_key: p, answer_key: a}, f"{source}: row {row} (0-based)", prompt_key, answer_key)
        for row, (p, a) in enumerate(zip(prompts, answers, strict=True))
    ]


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
    prompt, answer = record[prompt_key], record[answer_key]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: {prompt_key!r} must be a string, got {type(prompt).__name__}")
    return Example(prompt, _answer_str(answer, where, answer_key))


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
