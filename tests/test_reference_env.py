"""An oracle of the reference's own environment: transformers 5.4.0, tokenizers 0.22.2, datasets 4.5.0 and
Jinja2 3.1.6 (the versions open-instruct e6c3044aa locks), in a virtual environment of their own made once
with pip and cached. There ``tests/consumers/reference_env_oracle.py`` renders and tokenizes seeded random
chats with real public tokenizers of several families, loaded by that transformers' AutoTokenizer; here our
pipeline (``load: reference``) must give the same ids for every row it keeps, the masks the SPEC's rule makes
of the oracle's renders, offsets and prefix token counts, and drop exactly the rows that rule drops. With
``load: files`` our ids are the tokenizer's own ``tokenizer.json``'s. And JSON Lines files whose reading
changed between datasets 4.5 and 5 read as datasets 4.5.0 reads them (or are refused where it refuses)."""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import Plan, build_plan
from sftmix.tokenizing.row_status import DROP_REASONS, RowStatus
from sftmix.tokenizing.templates import ChatRenderer, named_template
from tests.slice_rows import tokenized_rows
from tests.tokenizer_fixtures import (
    deepseek_v3_dir,
    deepseek_v3_llama_dir,
    ensure_dolma2,
    gemma3_dir,
    gpt2_dir,
    llama2_dir,
    llama3_npm_dir,
    mistral_sp_dir,
    qwen3_dir,
    yi_dir,
)
from tests.venvs import cached_venv, venv_env

pytestmark = pytest.mark.slow

ORACLE = Path(__file__).parent / "consumers" / "reference_env_oracle.py"
REQUIREMENTS = ["transformers==5.4.0", "tokenizers==0.22.2", "datasets==4.5.0", "jinja2==3.1.6"]


@pytest.fixture(scope="session")
def reference_python() -> Path:
    """The reference's locked packages (and what pip brings with them) in a virtual environment, cached."""
    return cached_venv("reference-env", REQUIREMENTS)


def run_oracle(python: Path, args: list[str], cwd: Path) -> None:
    env = venv_env(TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(
        [str(python), str(ORACLE), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]


# The tokenizers: name -> (folder, the class 5.4.0's AutoTokenizer builds, whether that build tokenizes
# otherwise than the folder's tokenizer.json). Sources and licenses: tests/tokenizer_fixtures.py.
TOKENIZERS: dict[str, tuple[Callable[[], Path], str, bool]] = {
    "dolma2": (ensure_dolma2, "GPT2Tokenizer", True),  # GPT-2's ByteLevel regex, not dolma2's Splits
    "deepseek-v3": (deepseek_v3_dir, "TokenizersBackend", False),
    "deepseek-v3-llama": (deepseek_v3_llama_dir, "LlamaTokenizer", True),  # Metaspace for its Splits
    "gemma3": (gemma3_dir, "GemmaTokenizer", False),
    "qwen3": (qwen3_dir, "Qwen2Tokenizer", False),
    "llama2": (llama2_dir, "LlamaTokenizer", True),  # Metaspace for its Prepend normalizer
    "yi": (yi_dir, "LlamaTokenizer", True),  # Metaspace adds a prefix space its file does not
    "gpt2": (gpt2_dir, "GPT2Tokenizer", False),
    "llama3": (llama3_npm_dir, "TokenizersBackend", False),
    "mistral-v3": (mistral_sp_dir, "LlamaTokenizer", False),  # (converted by the installed transformers)
}

#: (tokenizer, template): ``tulu`` suits any tokenizer; ``tokenizer`` is the tokenizer's own template.
CASES = [(name, "tulu") for name in TOKENIZERS] + [
    ("dolma2", "olmo"),  # not prefix-stable on multi-turn chats: the token-count spans and their check
    ("dolma2", "tokenizer"),
    ("gemma3", "tokenizer"),
    ("qwen3", "tokenizer"),  # an empty thinking block on the last turn only: token-count spans
    ("llama3", "tokenizer"),  # always ends in the assistant header, trims contents
]

#: Templates that are not prefix-stable on multi-turn chats. There the reference checks each token-count
#: span and drops many of these chats, as we do: a content that starts with whitespace never passes (the
#: check strips the span's leading whitespace, not the content's), nor one the normalizer changes (Qwen's NFC).
FALLBACK_CASES = (("dolma2", "olmo"), ("qwen3", "tokenizer"), ("llama3", "tokenizer"))

WORDS = [
    "hello", "world", "naïve café", "ﬁnal ﬂow", "e\u0301te\u0301", "Ångström", "日本語の文章です", "中文测试",
    "한국어", "😀", "👍🏽", "👨\u200d👩\u200d👧", "שלום עולם", "12345", "3.14159", "1,000,000", "2024-01-01",
    "don't", "it's", "x = y + 1;", "<b>bold</b>", "#!/bin/sh", "```py\nprint(1)\n```", "\u00a0nbsp", "zero\u200bwidth",
    "   ", "  ", "\t", "\n", "\n\n", " \n ", "\r\n", "...", "¿qué?", "Ελληνικά", "Привет", "ﾊﾝｶｸ",
]  # fmt: skip
#: Special tokens of one tokenizer or another, written literally in some chats (never ``<pad>``: the pad
#: token the reference adds is not the tokenizer.json's, so a files-mode comparison would see it).
LITERALS = [
    "<|endoftext|>", "<|im_end|>", "</s>", "<s>", "<end_of_turn>", "<｜end▁of▁sentence｜>", "<|eot_id|>",
    "<|assistant|>", "<|im_start|>",
]  # fmt: skip


def text_of(rng: random.Random, literal: bool) -> str:
    parts = [rng.choice(WORDS) for _ in range(rng.randint(1, 12))]
    if literal:
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(LITERALS))
    text = "".join(p + rng.choice(["", " ", " ", "  ", "\n"]) for p in parts)
    return rng.choice(["", " ", "  ", "\n"]) + text if rng.random() < 0.2 else text


def make_chats(n: int, seed: int) -> list[dict]:
    """Seeded chats that every template here renders: an optional system message, then user and assistant
    turns in alternation, most ending with an answer; one in eight has literal special tokens."""
    rng = random.Random(seed)
    chats = []
    for k in range(n):
        literal = k % 8 == 3
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": text_of(rng, False)})
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": text_of(rng, literal)})
            messages.append({"role": "assistant", "content": text_of(rng, literal)})
        if k % 13 == 5:
            messages.pop()  # ends with a question: its earlier answers are trained on, if any
        if k % 17 == 7:
            messages[-1]["content"] = ""  # an empty answer
        chats.append({"messages": messages})
    chats.append({"messages": [{"role": "user", "content": "a question and no answer"}]})  # nothing to train
    return chats


CHATS = make_chats(40, 20250101)
#: For the named templates only (the tokenizers' own refuse a chat that opens with an answer): the first
#: message an assistant's, whose turn starts at character 0.
EXTRA_CHATS = [
    {"messages": [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}]},
    {
        "messages": [
            {"role": "assistant", "content": " Hi 😀"},
            {"role": "user", "content": "1 2  3"},
            {"role": "assistant", "content": "4\n\n5"},
        ]
    },
]


def chats_for(template: str) -> list[dict]:
    return CHATS + (EXTRA_CHATS if template != "tokenizer" else [])


@pytest.fixture(scope="module")
def oracle(reference_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """The oracle's facts for every case, made by one run of the locked environment: case -> (tokenizer
    folder, facts), or the reason the case's tokenizer could not be fetched (a str)."""
    work = tmp_path_factory.mktemp("oracle")
    found: dict[tuple[str, str], Any] = {}
    folders: dict[str, Path | str] = {}
    for name, (folder_of, _, _) in TOKENIZERS.items():
        try:
            folders[name] = folder_of()
        except pytest.skip.Exception as exc:
            folders[name] = str(exc)
    jobs: list[str] = []
    cases = []
    for name, template in CASES:
        folder = folders[name]
        if isinstance(folder, str):
            found[(name, template)] = folder
            continue
        chats = work / f"chats-{template}.jsonl"
        chats.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats_for(template)))
        if template == "tokenizer":
            template_file = "-"
        else:
            template_file = str(work / f"{template}.jinja")
            Path(template_file).write_text(named_template(template), encoding="utf-8")
        jobs += [str(folder), template_file, str(chats)]
        cases.append((name, template, folder))
    run_oracle(reference_python, ["chats", str(work / "out"), *jobs], work)
    for k, (name, template, folder) in enumerate(cases):
        facts = json.loads((work / "out" / f"{k}.json").read_text(encoding="utf-8"))
        found[(name, template)] = (folder, facts)
    return found


def oracle_case(oracle: dict, name: str, template: str) -> tuple[Path, dict]:
    got = oracle[(name, template)]
    if isinstance(got, str):
        pytest.skip(got)
    return got


# ---- the SPEC's rule (Tokenization and labels), applied to the oracle's facts ----


def span_problem(messages: list[dict], text: str, n: int, turn: dict) -> str | None:
    """The reference's check of one token-count span: it must cover its message's content, start at it (a
    leading space aside), and not run into a later message's content. A turn whose content is not in the
    render is not checked, nor an empty one; a span cut by the end of the tokens passes where what is left of
    it starts the content."""
    content = messages[turn["index"]].get("content")
    if not content or content not in text:
        return None
    start, end = max(0, turn["header_count"]), min(turn["through_count"], n)
    if start >= end:
        return None
    decoded = turn["decoded"]
    if turn["through_count"] >= n and decoded.lstrip() and content.startswith(decoded.lstrip()):
        return None
    if content not in decoded:
        return "does not cover its content"
    if not decoded.lstrip().startswith(content):
        return "starts inside the assistant header"
    tail = decoded[decoded.index(content) + len(content) :]
    for later in messages[turn["index"] + 1 :]:
        if later.get("content") and later["content"] in tail:
            return "runs into a later message"
    return None


def reference_row(messages: list[dict], row: dict) -> tuple[str, list[int] | str]:
    """("kept", mask) or ("dropped", reason) for one chat, by the SPEC's rule on the oracle's facts."""
    assert "error" not in row, row["error"]
    text, offsets, n = row["text"], row["offsets"], len(row["ids"])
    turns = row["turns"]
    assert all("error" not in t for t in turns), turns
    spans = []
    for t in turns:
        header, through = t["header"], t["through"]
        if not (len(header) <= len(through) and text.startswith(header) and text.startswith(through)):
            break
        spans.append((len(header), len(through)))
    else:  # every turn's renders are prefixes: character spans, tokens of non-zero width overlapping them
        mask = [int(s != e and any(s < b and a < e for a, b in spans)) for s, e in offsets]
        return ("kept", mask) if any(mask) else ("dropped", DROP_REASONS[RowStatus.NO_TRAINABLE])
    mask = [0] * n  # token counts of the prefix renders
    for t in turns:
        start, end = max(0, t["header_count"]), min(t["through_count"], n)
        mask[start:end] = [1] * max(0, end - start)
    if any(span_problem(messages, text, n, t) for t in turns):
        return ("dropped", DROP_REASONS[RowStatus.SPAN_UNVERIFIED])
    return ("kept", mask) if any(mask) else ("dropped", DROP_REASONS[RowStatus.NO_TRAINABLE])


# ---- our pipeline ----


def run_ours(
    tmp_path: Path, folder: Path, template: str, load: str, chats: list[dict]
) -> tuple[dict[int, tuple[list[int], list[int]]], dict[int, str], Plan]:
    """Our rows, as the slices keep them: row -> (ids, mask); and row -> why it was dropped."""
    data = tmp_path / f"chats-{load}.jsonl"
    data.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats), encoding="utf-8")
    mixer = MixerConfig(
        datasets=[DatasetEntry(path=str(data))],
        tokenizer=TokenizerSpec(
            name_or_path=str(folder), chat_template=None if template == "tokenizer" else template, load=load
        ),
        max_seq_length=None,
        output=OutputSpec(path=str(tmp_path / f"out-{load}")),
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / f"work-{load}")))
    kept: dict[int, tuple[list[int], list[int]]] = {}
    dropped: dict[int, str] = {}
    for r, tokens, mask in tokenized_rows(plan):
        if tokens is not None and mask is not None:
            kept[int(r["row"])] = (tokens.tolist(), mask.astype(int).tolist())
        else:
            dropped[int(r["row"])] = DROP_REASONS[RowStatus(int(r["status"]))]
    return kept, dropped, plan


def our_renderer(plan: Plan, folder: Path, load: str) -> ChatRenderer:
    from sftmix.tokenizing.tokenizer import TokenizerKey, load_hf_tokenizer, special_tokens

    key = TokenizerKey.of(str(folder), None, load=load)
    return ChatRenderer(plan.context.template.text, special_tokens(load_hf_tokenizer(key)))


@pytest.mark.parametrize(("name", "template"), CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_ids_masks_and_drops_are_the_reference_environments(oracle, tmp_path, name, template):
    folder, facts = oracle_case(oracle, name, template)
    assert facts["versions"] == {
        "transformers": "5.4.0",
        "tokenizers": "0.22.2",
        "datasets": "4.5.0",
        "jinja2": "3.1.6",
    }
    assert facts["tokenizer_class"] == TOKENIZERS[name][1]
    chats = chats_for(template)
    assert len(facts["rows"]) == len(chats)
    kept, dropped, plan = run_ours(tmp_path, folder, template, "reference", chats)
    assert set(kept) | set(dropped) == set(range(len(chats)))

    renderer = our_renderer(plan, folder, "reference")
    assert plan.context.template.text == facts["chat_template"]
    fallbacks = 0
    for r, (chat, row) in enumerate(zip(chats, facts["rows"], strict=True)):
        messages = chat["messages"]
        # the renders: the whole chat and every prefix the mask rule reads
        assert renderer.render(messages, None, False) == row["text"], r
        for t in row["turns"]:
            i = t["index"]
            assert renderer.render(messages[: i + 1], None, False) == t["through"], (r, i)
            if i:
                assert renderer.render(messages[:i], None, True) == t["header"], (r, i)
            # apply_chat_template's token counts are those of the prefix texts tokenized alone
            assert (t["header_count"] if i else 0, t["through_count"]) == (
                t["header_tokens"] if i else 0,
                t["through_tokens"],
            )
        verdict, found = reference_row(messages, row)
        fallbacks += any(not row["text"].startswith(t["through"]) for t in row["turns"])
        if verdict == "kept":
            assert r in kept, (r, dropped.get(r), messages)
            ids, mask = kept[r]
            assert ids == row["ids"], (r, row["text"])
            assert mask == found, (r, row["text"])
        else:
            assert dropped.get(r) == found, (r, found, r in kept, messages)
    if (name, template) in FALLBACK_CASES:
        assert fallbacks > 10  # these cases do test the token-count spans
    else:
        assert len(kept) >= len(chats) - 3  # only the chats with nothing to train on are dropped
    assert len(kept) >= 5
    reasons = sorted(set(dropped.values()))
    print(
        f"{name} {template}: {len(kept)} kept, {len(dropped)} dropped {reasons}, {fallbacks} by token counts"
    )


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_load_files_tokenizes_as_the_tokenizer_json_says(oracle, tmp_path, name):
    """``load: files``: our ids are the folder's tokenizer.json's (the tokenizers library here, as the
    model was trained) on the oracle's renders; and 5.4.0's AutoTokenizer gives other ids than that file on
    these chats exactly for the tokenizers it builds otherwise."""
    from tokenizers import Tokenizer

    folder, facts = oracle_case(oracle, name, "tulu")
    chats = chats_for("tulu")
    kept, dropped, plan = run_ours(tmp_path, folder, "tulu", "files", chats)
    assert set(kept) | set(dropped) == set(range(len(chats)))
    assert len(kept) >= len(chats) // 2
    own = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = [row["text"] for row in facts["rows"]]
    renderer = our_renderer(plan, folder, "files")
    for r, (ids, _) in kept.items():
        assert renderer.render(chats[r]["messages"], None, False) == texts[r], r
        assert ids == own.encode(texts[r], add_special_tokens=False).ids, (r, texts[r])
    differ = [
        r
        for r, row in enumerate(facts["rows"])
        if own.encode(row["text"], add_special_tokens=False).ids != row["ids"]
    ]
    assert bool(differ) == TOKENIZERS[name][2], differ


def _line(i: int, **fields: Any) -> dict:
    return {
        "id": i,
        "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
    } | fields


def _accepted_rows() -> list[dict]:
    """What datasets 4.5 unifies across rows and datasets 5 by default keeps row by row (as JSON cells):
    ints and floats in one field, objects whose keys differ, nulls at every depth, a key only late, an int
    beyond int64 among ints, a null content."""
    rows = []
    for i in range(30):
        row = _line(i, score=[i, i + 0.5, None][i % 3])
        row["meta"] = (
            {"source": "x", "n": i, "tags": ["a", None]}
            if i % 2 == 0
            else {"source": None, "extra": {"deep": None}}
        )
        row["big"] = 2**63 + 5 if i == 11 else i
        if i == 3:
            row["messages"][0]["name"] = None
        if i == 8:
            row["messages"][1]["content"] = None
        if i >= 27:
            row["late"] = {"k": [1, 2.5, None]}
        rows.append(row)
    return rows


#: Files datasets 4.5.0 refuses: (the new type, the row that changes the field's type to it, the field, how
#: our reader names the new type).
REFUSED = [
    ("string", 5, "score", "a string"),
    ("boolean", 4, "flag", "a boolean"),
    ("array", 4, "x", "an array"),
]


def _refused_rows(kind: str, bad: int) -> list[dict]:
    rows = [_line(i) for i in range(10)]
    for i, row in enumerate(rows):
        if kind == "string":
            row["score"] = "five" if i == bad else i + 0.5
        elif kind == "boolean":
            row["flag"] = True if i == bad else i
        else:
            row["x"] = [1] if i == bad else {"a": 1}
    return rows


def _our_jsonl_rows(path: Path) -> list[Any]:
    """Our JSON Lines reader, as slices read a file: batch by batch."""
    from sftmix.sources import jsonl

    layout = jsonl.scan(str(path))
    assert layout is not None
    rows: list[Any] = []
    for batch in layout.batches:
        rows += jsonl.read_rows(
            layout.source([batch]), list(range(batch.first_row, batch.first_row + batch.rows))
        )
    return rows


def test_json_lines_read_as_datasets_4_5_reads_them(reference_python, tmp_path):
    """Mixed types, late keys and nulls: our reader's rows are datasets 4.5.0's, and so are datasets 5's with
    the options the project passes it; a field whose type changes from one row to another is refused by
    datasets 4.5.0 (the whole file) and by us (that line, named; the plan stops on it)."""
    import datasets

    from sftmix.errors import BadLineError
    from sftmix.sources import jsonl
    from sftmix.sources.data_files import reference_json_options

    files = {"accepted": (tmp_path / "accepted.jsonl", _accepted_rows())}
    for kind, bad, _, _ in REFUSED:
        files[kind] = (tmp_path / f"refused-{kind}.jsonl", _refused_rows(kind, bad))
    for path, rows in files.values():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "datasets.json"
    paths = [str(path) for path, _ in files.values()]
    run_oracle(reference_python, ["datasets", str(out), str(tmp_path / "cache-4.5"), *paths], tmp_path)
    theirs = json.loads(out.read_text(encoding="utf-8"))
    assert theirs["versions"]["datasets"] == "4.5.0"

    path, _ = files["accepted"]
    read = theirs[str(path)]
    assert "rows" in read, read
    ours = _our_jsonl_rows(path)
    assert json.loads(json.dumps(ours)) == read["rows"]
    assert read["rows"][1]["messages"][0] == {"role": "user", "content": "q1", "name": None}  # one struct
    assert read["rows"][0]["score"] == 0.0 and isinstance(read["rows"][0]["score"], float)
    datasets.disable_progress_bars()
    five = datasets.load_dataset(
        "json",
        data_files=str(path),
        split="train",
        cache_dir=str(tmp_path / "cache-5"),
        **reference_json_options(),
    )
    assert json.loads(json.dumps(list(five))) == read["rows"]

    for kind, bad, field, named in REFUSED:
        path, _ = files[kind]
        read = theirs[str(path)]
        assert "refused" in read, read
        assert f"Column(/{field}) changed from" in read["refused"], read
        assert f"to {kind} in row {bad}" in read["refused"], read
        ours = _our_jsonl_rows(path)
        faults = [(i, r) for i, r in enumerate(ours) if isinstance(r, jsonl.BadLine)]
        assert [i for i, _ in faults] == [bad]
        assert faults[0][1].line == bad + 1
        assert f"field '/{field}' holds {named} here" in faults[0][1].reason
        mixer = MixerConfig(
            datasets=[DatasetEntry(path=str(path))],
            tokenizer=TokenizerSpec(name_or_path=str(ensure_dolma2()), chat_template="tulu"),
            max_seq_length=None,
            output=OutputSpec(path=str(tmp_path / f"out-{kind}")),
        )
        with pytest.raises(BadLineError, match=rf"refused-{kind}\.jsonl:{bad + 1}: field '/{field}'"):
            build_plan(mixer, RunOptions(work_dir=str(tmp_path / f"work-{kind}")))


def test_the_committed_class_tables_are_transformers_5_4s(reference_python, tmp_path):
    """``sftmix/tokenizing/data/reference_tokenizer_classes.json``, which ``load: reference`` chooses classes by, is
    what the locked transformers prints of its own tables."""
    done = subprocess.run(
        [str(reference_python), str(ORACLE.parent / "reference_tokenizer_table.py")],
        capture_output=True, text=True, env=venv_env(TRANSFORMERS_VERBOSITY="error"), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    committed = (
        Path(__file__).parent.parent / "sftmix" / "tokenizing" / "data" / "reference_tokenizer_classes.json"
    )
    assert json.loads(done.stdout) == json.loads(committed.read_text(encoding="utf-8"))
