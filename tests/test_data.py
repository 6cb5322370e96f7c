"""mint.rl.data: file and synthetic sources, their errors, and the reproducible batch stream that resume relies on."""

from __future__ import annotations

import json
import pickle
import re
from itertools import islice

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mint.errors import DataError
from mint.rl.data import FileDataset, SyntheticDataset, load_dataset
from mint.rl.tasks import Example


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def numbered(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)]


@pytest.fixture
def ten(tmp_path) -> FileDataset:
    return load_dataset(write_jsonl(tmp_path / "ten.jsonl", numbered(10)))


def first_batches(dataset, batch_size: int, seed: int, count: int, start: int = 0) -> list[list[Example]]:
    return list(islice(dataset.batches(batch_size, seed, start=start), count))


# --- loading ---------------------------------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path):
    records = [{"prompt": "2+2?", "answer": "4", "extra": 1}, {"prompt": "capital of France?", "answer": "Paris"}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n")  # a blank line is not a record
    dataset = load_dataset(str(path))
    assert isinstance(dataset, FileDataset)
    assert len(dataset) == dataset.size == 2
    assert dataset.examples == (Example("2+2?", "4", extra={"extra": 1}), Example("capital of France?", "Paris"))


def test_parquet_round_trip_with_custom_keys_and_numeric_answers(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table({"question": ["a", "b", "c"], "solution": [72.0, 2.5, -3.0], "unused": [1, 2, 3]})
    pq.write_table(table, path)
    dataset = load_dataset(str(path), prompt_key="question", answer_key="solution")
    # Integral doubles read back as integers: parquet often stores integer answers in a double column.
    assert [(e.prompt, e.answer) for e in dataset.examples] == [("a", "72"), ("b", "2.5"), ("c", "-3")]
    assert [e.extra for e in dataset.examples] == [{"unused": 1}, {"unused": 2}, {"unused": 3}]


def test_jsonl_numeric_answers_become_strings(tmp_path):
    records = [{"q": "x", "a": 42}, {"q": "y", "a": 0.125}, {"q": "z", "a": "007"}]
    dataset = load_dataset(write_jsonl(tmp_path / "n.jsonl", records), prompt_key="q", answer_key="a")
    assert [e.answer for e in dataset.examples] == ["42", "0.125", "007"]


def test_missing_key_names_file_line_and_key(tmp_path):
    records = [*numbered(2), {"prompt": "no answer here"}]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError) as info:
        load_dataset(path)
    message = str(info.value)
    assert "bad.jsonl" in message and "line 3" in message and "'answer'" in message
    assert "\n" not in message


def test_missing_custom_key_in_parquet_names_column(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["1"]}), path)
    with pytest.raises(DataError, match=r"p\.parquet.*'question'"):
        load_dataset(str(path), prompt_key="question")


def test_null_answer_in_parquet_names_row(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", None]}), path)
    with pytest.raises(DataError, match=r"p\.parquet: row 1 .*'answer' is null"):
        load_dataset(str(path))


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("{not json", r"line 1: not valid JSON"),
        ('["a", "b"]', r"line 1: expected an object"),
        ('{"prompt": 3, "answer": "1"}', r"'prompt' must be a string"),
        ('{"prompt": "a", "answer": [1]}', r"'answer' must be a string or a number"),
    ],
)
def test_malformed_jsonl_records(tmp_path, line, pattern):
    path = tmp_path / "m.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DataError, match=pattern):
        load_dataset(str(path))


def test_empty_files(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"e\.jsonl: dataset has no records"):
        load_dataset(str(tmp_path / "e.jsonl"))
    pq.write_table(
        pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), tmp_path / "e.parquet"
    )
    with pytest.raises(DataError, match="no records"):
        load_dataset(str(tmp_path / "e.parquet"))


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such dataset file"):
        load_dataset(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.txt").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"unknown dataset extension '\.txt'"):
        load_dataset(str(tmp_path / "d.txt"))
    with pytest.raises(DataError, match="unknown synthetic task 'nope'"):
        load_dataset("synthetic:nope")


def test_corrupt_parquet(tmp_path):
    (tmp_path / "c.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"c\.parquet: not a readable parquet file"):
        load_dataset(str(tmp_path / "c.parquet"))


# --- Hugging Face datasets on local files, chat prompts, extra fields ------------------------------------------------

ROWS = [
    {"prompt": "2+2?", "answer": 4, "level": 1, "tags": ["easy"]},
    {"prompt": "3*3?", "answer": 9, "level": 2, "tags": []},
    {"prompt": "10/4?", "answer": 2.5, "level": 3, "tags": ["frac"]},
]
EXPECTED = (
    Example("2+2?", "4", extra={"level": 1, "tags": ["easy"]}),
    Example("3*3?", "9", extra={"level": 2, "tags": []}),
    Example("10/4?", "2.5", extra={"level": 3, "tags": ["frac"]}),
)


def test_hf_formats_read_the_same_examples(tmp_path):
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_json(str(tmp_path / "d.json"))  # JSON lines under a .json name: the datasets builder reads both
    table.save_to_disk(str(tmp_path / "saved"))
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    for source in ("d.jsonl", "d.parquet", "d.json", "saved"):
        dataset = load_dataset(str(tmp_path / source))
        assert dataset.examples == EXPECTED, source
        assert first_batches(dataset, 2, seed=3, count=4) == first_batches(dataset, 2, seed=3, count=4)


def test_csv_through_datasets(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "d.csv").write_text("question,solution,source\nwhat is 6*7?,42,gsm\nhalf of 5?,2.5,gsm\n")
    dataset = load_dataset(str(tmp_path / "d.csv"), prompt_key="question", answer_key="solution")
    assert dataset.examples == (
        Example("what is 6*7?", "42", extra={"source": "gsm"}),
        Example("half of 5?", "2.5", extra={"source": "gsm"}),
    )


def test_saved_dataset_errors_name_the_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: holds several splits; name one: .*dd/train"):
        load_dataset(str(tmp_path / "dd"))
    assert load_dataset(str(tmp_path / "dd" / "train")).examples == EXPECTED
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=r"empty_dir: not a dataset directory written by save_to_disk"):
        load_dataset(str(tmp_path / "empty_dir"))
    datasets.Dataset.from_list([{"q": "a", "answer": "1"}]).save_to_disk(str(tmp_path / "noprompt"))
    with pytest.raises(DataError, match=r"noprompt: no 'prompt' column \(columns: q, answer\)"):
        load_dataset(str(tmp_path / "noprompt"))


def test_null_answer_in_saved_dataset_names_row(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]).save_to_disk(
        str(tmp_path / "s")
    )
    with pytest.raises(DataError, match=r"s: row 1 \(0-based\): 'answer' is null"):
        load_dataset(str(tmp_path / "s"))


def test_hub_names_are_refused_without_a_download(tmp_path, monkeypatch):
    # No network is touched: the refusal comes before `datasets` is imported at all.
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # importing it would now raise
    for source in ("openai/gsm8k", "gsm8k", "hf://datasets/openai/gsm8k"):
        with pytest.raises(DataError, match=r"no such dataset file or directory \(datasets are read from local paths"):
            load_dataset(source)


CHAT = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def test_chat_message_prompts(tmp_path):
    rows = [{"prompt": CHAT, "answer": "6"}, {"prompt": "plain", "answer": "1"}]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "c.parquet")  # a list<struct<role, content>> column
    chat, plain = load_dataset(write_jsonl(tmp_path / "c.jsonl", rows)).examples
    (from_parquet,) = load_dataset(str(tmp_path / "c.parquet")).examples
    assert from_parquet == chat
    for example in (chat, from_parquet):
        assert example.prompt == "And 3+3?"  # the last user turn: what logs and records show
        assert example.messages == tuple((m["role"], m["content"]) for m in CHAT)
        assert example.chat() == CHAT
        assert example.chat(system_prompt="ignored: the record has its own") == CHAT
    assert plain.messages is None and plain.chat() == [{"role": "user", "content": "plain"}]
    assert plain.chat("Be brief.") == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "plain"}]
    user_only = Example("q", "a", (("user", "q"),))
    assert user_only.chat("S")[0] == {"role": "system", "content": "S"}


@pytest.mark.parametrize(
    "prompt, pattern",
    [
        ([], r"'prompt' must be a string or a non-empty list of chat messages, got an empty list"),
        ([{"role": "user"}], r"'prompt' message 0 must be an object with 'role' and 'content'"),
        (["hi"], r"'prompt' message 0 must be an object"),
        ([{"role": "tool", "content": "x"}], r"message 0 has role 'tool'; roles are system, user, assistant"),
        ([{"role": "user", "content": 3}], r"message 0 content must be a string, got int"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], r"must end with a user message"),
        ({"role": "user", "content": "q"}, r"must be a string or a non-empty list of chat messages, got dict"),
    ],
)
def test_bad_chat_prompts_name_file_line_and_key(tmp_path, prompt, pattern):
    path = write_jsonl(tmp_path / "bad.jsonl", [*numbered(1), {"prompt": prompt, "answer": "1"}])
    with pytest.raises(DataError, match=rf"bad\.jsonl: line 2: .*{pattern}"):
        load_dataset(path)


def test_extra_fields_must_be_json(tmp_path):
    import datetime

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["1"], "when": [datetime.datetime(2024, 1, 1)]}), path)
    with pytest.raises(DataError, match=r"t\.parquet: row 0 \(0-based\): 'when' is not a JSON value"):
        load_dataset(str(path))


def test_examples_with_extra_fields_hash_and_pickle(tmp_path):
    dataset = load_dataset(write_jsonl(tmp_path / "x.jsonl", ROWS))
    assert len(set(dataset.take(3, seed=0))) == 3  # a dict field does not make Example unhashable
    assert pickle.loads(pickle.dumps(dataset)) == dataset
    assert Example("p", "a", extra={"k": 1}) != Example("p", "a", extra={"k": 2})


# --- the batch stream ------------------------------------------------------------------------------------------------


def test_batches_are_deterministic_per_seed(ten):
    assert first_batches(ten, 3, seed=5, count=8) == first_batches(ten, 3, seed=5, count=8)
    assert first_batches(ten, 3, seed=5, count=8) != first_batches(ten, 3, seed=6, count=8)


def test_each_epoch_is_a_fresh_permutation(ten):
    # 10 batches of 3 = 3 epochs of 10: batches run across epoch boundaries and are always full.
    batches = first_batches(ten, 3, seed=0, count=10)
    assert all(len(b) == 3 for b in batches)
    stream = [e for b in batches for e in b]
    epochs = [stream[i : i + 10] for i in range(0, 30, 10)]
    for epoch in epochs:
        assert sorted(epoch, key=lambda e: int(e.answer)) == list(ten.examples)
    assert epochs[0] != epochs[1] != epochs[2]


def test_seeds_do_not_replay_each_other_shifted_by_an_epoch(ten):
    # Seeding epoch e with seed + e would make seed 1's epoch 0 equal seed 0's epoch 1.
    seed0 = [e for b in first_batches(ten, 10, seed=0, count=2) for e in b]
    seed1 = [e for b in first_batches(ten, 10, seed=1, count=1) for e in b]
    assert seed0[10:] != seed1


@pytest.mark.parametrize("start", [0, 1, 3, 4, 7, 23])
def test_start_equals_skipping(ten, start):
    fresh = list(islice(ten.batches(3, 11), start, start + 5))
    assert first_batches(ten, 3, seed=11, count=5, start=start) == fresh


@pytest.mark.parametrize("start", [0, 2, 9])
def test_synthetic_start_equals_skipping(start):
    dataset = load_dataset("synthetic:first_last")
    fresh = list(islice(dataset.batches(4, 3), start, start + 3))
    assert first_batches(dataset, 4, seed=3, count=3, start=start) == fresh


def test_stream_does_not_depend_on_batch_size(ten):
    by_2 = [e for b in first_batches(ten, 2, seed=4, count=12) for e in b]
    by_3 = [e for b in first_batches(ten, 3, seed=4, count=8) for e in b]
    assert by_2 == by_3


def test_batch_larger_than_dataset_spans_epochs(ten):
    (batch,) = first_batches(ten, 25, seed=0, count=1)
    assert len(batch) == 25


def test_bad_batch_arguments(ten):
    with pytest.raises(ValueError, match="batch_size"):
        ten.batches(0, 0)  # at the call, not at the first batch
    with pytest.raises(ValueError, match="start"):
        ten.batches(2, 0, start=-1)


def test_take(ten):
    taken = ten.take(6, seed=9)
    assert len(set(taken)) == 6
    assert taken == [e for b in first_batches(ten, 6, seed=9, count=1) for e in b]
    assert ten.take(6, seed=9) == taken
    with pytest.raises(DataError, match=r"ten\.jsonl: asked for 11 evaluation examples but it has only 10"):
        ten.take(11, seed=0)


def test_datasets_pickle(ten):
    synthetic = load_dataset("synthetic:first_last")
    for dataset in (ten, synthetic):
        clone = pickle.loads(pickle.dumps(dataset))
        assert clone == dataset
        assert first_batches(clone, 4, 1, 3) == first_batches(dataset, 4, 1, 3)


# --- synthetic -------------------------------------------------------------------------------------------------------

PROMPT_RE = re.compile(r"What is the (first|last) digit of ((?:\d )*\d)\?")


def test_synthetic_answers_follow_from_the_prompt():
    dataset = load_dataset("synthetic:first_last")
    assert isinstance(dataset, SyntheticDataset) and dataset.size is None
    with pytest.raises(TypeError):
        len(dataset)
    examples = dataset.take(500, seed=0)
    for example in examples:
        which, digits = PROMPT_RE.fullmatch(example.prompt).groups()
        digits = digits.split()
        assert example.answer == (digits[0] if which == "first" else digits[-1])
    assert len({e.prompt for e in examples}) > 400  # draws, not one prompt repeated
    assert dataset.take(500, seed=0) == examples
    assert dataset.take(500, seed=1) != examples
