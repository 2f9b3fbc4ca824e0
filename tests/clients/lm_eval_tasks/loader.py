"""The tasks' datasets: the JSONL files beside this module, loaded without the Hugging Face Hub."""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset, DatasetDict

HERE = Path(__file__).resolve().parent


def _jsonl(name: str) -> DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return DatasetDict({"test": Dataset.from_list(rows)})


def stories_cloze(**_: object) -> DatasetDict:
    return _jsonl("stories_cloze.jsonl")


def stories_continue(**_: object) -> DatasetDict:
    return _jsonl("stories_continue.jsonl")
