"""What the reference's locked environment makes of chats and JSON Lines files (run by
tests/test_reference_env.py in a virtual environment with exactly the reference's transformers 5.4.0,
tokenizers 0.22.2, datasets 4.5.0 and Jinja2 3.1.6; it imports nothing of tokenize-mixer).

    reference_env_oracle.py chats OUT_DIR TOKENIZER_DIR TEMPLATE CHATS [TOKENIZER_DIR TEMPLATE CHATS ...]

For each triple (numbered k from 0) writes ``OUT_DIR/k.json``. TEMPLATE is a file holding a chat template's
text, or ``-`` for the tokenizer's own; CHATS is a JSON Lines file of ``{"messages": [...]}``. The tokenizer
is ``AutoTokenizer.from_pretrained(TOKENIZER_DIR, use_fast=True)`` followed by the reference's pad rule (a
``<pad>`` special token added where pad is missing or is eos). Per chat: the full render (``tokenize=False``)
and its tokens (``add_special_tokens=False``: ids and character offsets), and for each assistant message
``i``: the render of ``messages[:i]`` with the generation prompt (``""`` for ``i == 0``), the render of
``messages[:i+1]``, the token counts of both as ``apply_chat_template(tokenize=True)`` gives them, and the
decoding of the full render's tokens between those counts: all the inputs of the assistant mask rule and of
the check of a token-count span. Measures nothing itself: the test applies the rules.

    reference_env_oracle.py datasets OUT.json CACHE_DIR FILE [FILE ...]

Reads each JSON Lines FILE with ``datasets.load_dataset("json", data_files=FILE, split="train")`` and
writes ``{FILE: {"rows": [...], "features": "..."}}`` or ``{FILE: {"refused": "..."}}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def versions() -> dict[str, str]:
    import datasets
    import jinja2
    import tokenizers
    import transformers

    return {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "datasets": datasets.__version__,
        "jinja2": jinja2.__version__,
    }


def load(folder: str):
    """The tokenizer as the reference loads it, pad rule included."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, use_fast=True)
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        if type(tok).__name__.startswith("GPTNeoXTokenizer") and tok.bos_token is None:
            tok.bos_token = tok.eos_token
        else:
            tok.add_special_tokens({"pad_token": "<pad>"})
    return tok


def count(tok, messages: list[dict], template: str | None, generation_prompt: bool) -> int:
    ids = tok.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=True,
        add_generation_prompt=generation_prompt,
        return_dict=False,
    )
    return len(ids)


def chat_facts(tok, messages: list[dict], template: str | None) -> dict:
    def render(part: list[dict], generation_prompt: bool) -> str:
        return tok.apply_chat_template(
            part, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
        )

    try:
        text = render(messages, False)
    except Exception as exc:  # the template refuses the chat
        return {"error": f"{type(exc).__name__}: {exc}"}
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = [list(pair) for pair in enc["offset_mapping"]]
    turns = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        turn: dict = {"index": i}
        try:
            header = "" if i == 0 else render(messages[:i], True)
            through = render(messages[: i + 1], False)
        except Exception as exc:
            turn["error"] = f"{type(exc).__name__}: {exc}"
            turns.append(turn)
            continue
        header_count = 0 if i == 0 else count(tok, messages[:i], template, True)
        through_count = count(tok, messages[: i + 1], template, False)
        start, end = min(header_count, len(ids)), min(through_count, len(ids))
        turn.update(
            header=header,
            through=through,
            header_count=header_count,
            through_count=through_count,
            header_tokens=len(tok(header, add_special_tokens=False)["input_ids"]),
            through_tokens=len(tok(through, add_special_tokens=False)["input_ids"]),
            decoded=tok.decode(ids[start:end], clean_up_tokenization_spaces=False) if start < end else "",
        )
        turns.append(turn)
    return {"text": text, "ids": ids, "offsets": offsets, "turns": turns}


def chats(out_dir: Path, jobs: list[str]) -> None:
    if len(jobs) % 3:
        raise SystemExit("chats: give TOKENIZER_DIR TEMPLATE CHATS triples")
    out_dir.mkdir(parents=True, exist_ok=True)
    for k in range(0, len(jobs), 3):
        folder, template_file, chats_file = jobs[k : k + 3]
        template = None if template_file == "-" else Path(template_file).read_text(encoding="utf-8")
        tok = load(folder)
        rows = []
        with open(chats_file, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    rows.append(chat_facts(tok, json.loads(line)["messages"], template))
        result = {
            "versions": versions(),
            "tokenizer": folder,
            "tokenizer_class": type(tok).__name__,
            "special_tokens": {name: str(value) for name, value in tok.special_tokens_map.items()},
            "pad_token": tok.pad_token,
            "chat_template": template if template is not None else tok.chat_template,
            "rows": rows,
        }
        (out_dir / f"{k // 3}.json").write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")


def read_datasets(out: Path, cache: str, files: list[str]) -> None:
    import datasets

    datasets.disable_progress_bars()
    result: dict = {"versions": versions()}
    for file in files:
        try:
            ds = datasets.load_dataset("json", data_files=file, split="train", cache_dir=cache)
        except Exception as exc:
            cause = exc.__cause__ or exc
            result[file] = {"refused": f"{type(cause).__name__}: {cause}"}
            continue
        result[file] = {"rows": [dict(row) for row in ds], "features": str(ds.features)}
    out.write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "chats":
        chats(Path(argv[1]), argv[2:])
    elif len(argv) >= 3 and argv[0] == "datasets":
        read_datasets(Path(argv[1]), argv[2], argv[3:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
