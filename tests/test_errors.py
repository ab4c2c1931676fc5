"""Errors a user can act on: each names the dataset, row or flag, and no library traceback leaks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_file import load_run_file
from sftmix.config.run_options import RunOptions
from sftmix.errors import (
    BadRowError,
    ConfigError,
    DatasetError,
    OutputConflictError,
    TemplateError,
    TokenDtypeError,
)
from sftmix.output.publish import publish_local, staging_dir
from sftmix.planning.plan import build_plan
from sftmix.tokenizing.slices import tokenize_slice
from tokenize_mixer.cli import main

TINY = Path(__file__).parent / "golden" / "tokenizers" / "tiny"


def mixer(
    tmp_path: Path, *datasets: tuple[str, object], template: str | None = "tulu", tokenizer: Path = TINY
):
    return MixerConfig(
        datasets=[DatasetEntry(path=p, amount=a) for p, a in datasets],
        tokenizer=TokenizerSpec(name_or_path=str(tokenizer), chat_template=template),
        max_seq_length=128,
        output=OutputSpec(path=str(tmp_path / "out")),
    )


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def run_slices(tmp_path: Path, m: MixerConfig) -> None:
    plan = build_plan(m, RunOptions(work_dir=str(tmp_path / "work")))
    for spec in plan.slices:
        tokenize_slice(spec, plan.context)


def test_missing_dataset_file(tmp_path):
    with pytest.raises(DatasetError, match=r"^dataset '.*nope.jsonl': no such local file$"):
        build_plan(mixer(tmp_path, (str(tmp_path / "nope.jsonl"), 1.0)), RunOptions(work_dir=str(tmp_path)))


def test_odd_length_mixer_list_and_bad_amount(capsys):
    assert (
        main(
            [
                "convert",
                "--dataset_mixer_list",
                "a.jsonl",
                "1.0",
                "b.jsonl",
                "--tokenizer_name_or_path",
                "t",
                "--output_dir",
                "o",
            ]
        )
        == 2
    )
    assert "NAME AMOUNT pairs" in capsys.readouterr().err
    assert (
        main(
            [
                "convert",
                "--dataset_mixer_list",
                "a.jsonl",
                "lots",
                "--tokenizer_name_or_path",
                "t",
                "--output_dir",
                "o",
            ]
        )
        == 2
    )
    assert "amount 'lots' is not a number" in capsys.readouterr().err


def test_config_errors_name_the_field(tmp_path):
    cfg = tmp_path / "mixer.yaml"
    cfg.write_text(
        "datasets:\n  - path: a.jsonl\n    amount: 0\ntokenizer: {name_or_path: t}\noutput: {path: o}\n"
    )
    with pytest.raises(ConfigError, match=r"datasets\.0\.amount"):
        load_run_file(cfg)
    cfg.write_text("datasets: []\ntokenizer: {name_or_path: t}\noutput: {path: o}\nmax_seq_length: -5\n")
    with pytest.raises(ConfigError, match="max_seq_length") as exc:
        load_run_file(cfg)
    assert "mixer.datasets" in str(exc.value)


def test_unknown_template_is_refused_in_our_configs(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(TemplateError, match="unknown chat template 'olmo123'"):
        build_plan(mixer(tmp_path, (data, 1.0), template="olmo123"), RunOptions(work_dir=str(tmp_path)))


def test_tokenizer_without_chat_template(tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(TINY, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(TemplateError, match="has no chat_template"):
        build_plan(
            mixer(tmp_path, (data, 1.0), template=None, tokenizer=tok), RunOptions(work_dir=str(tmp_path))
        )


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"messages": []}, "'messages' is empty"),
        ({"messages": [{"role": None, "content": "x"}]}, "message 0 has no 'role' string"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "{not json"}, "'tools' is not valid JSON"),
        ({"messages": {"role": "user", "content": "x"}}, "'messages' must be a list of messages, got dict"),
        ({"messages": ["hello"]}, "message 0 must be an object with 'role' and 'content', got str"),
        ({"messages": [{"role": "user", "content": 7}]}, r"message 0 \(user\) has content of type int"),
    ],
)
def test_malformed_rows_name_dataset_and_row(tmp_path, bad, reason):
    data = write_jsonl(tmp_path / "d.jsonl", [bad, bad] if _type_differs(bad) else [GOOD, GOOD, bad, GOOD])
    row = (
        "row 0 \\(0-based; line 1 of the file\\)"
        if _type_differs(bad)
        else "row 2 \\(0-based; line 3 of the file\\)"
    )
    with pytest.raises(BadRowError, match=rf"d\.jsonl', {row}: {reason}"):
        run_slices(tmp_path, mixer(tmp_path, (data, 1.0)))


def _type_differs(row: dict) -> bool:
    """Rows whose fields have other JSON types than a good row's: a file mixing the two does not load
    (see the next test), so those rows are tested in a file of their own."""
    messages = row["messages"]
    return not isinstance(messages, list) or any(
        not isinstance(m, dict) or not isinstance(m.get("content", ""), str | None) for m in messages
    )


def test_a_field_with_two_types_is_one_clear_error(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, {"messages": {"role": "user", "content": "x"}}])
    with pytest.raises(
        DatasetError,
        match=r"d\.jsonl:2: field '/messages' holds an object here and arrays in the rows before",
    ):
        run_slices(tmp_path, mixer(tmp_path, (data, 1.0)))


def test_missing_messages_column(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}])
    with pytest.raises(DatasetError, match="no 'messages' column"):
        build_plan(mixer(tmp_path, (data, 1.0)), RunOptions(work_dir=str(tmp_path)))


def test_invalid_json_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{oops\n")
    with pytest.raises(DatasetError, match="d.jsonl"):
        build_plan(mixer(tmp_path, (str(path), 1.0)), RunOptions(work_dir=str(tmp_path)))


def test_output_with_different_shards_is_not_clobbered(tmp_path):
    out = tmp_path / "out"
    with staging_dir(out, tmp_path) as first:
        (first / "token_ids_part_0000.npy").write_bytes(b"\x01\x00")
        assert publish_local(first, out, overwrite=False) == "created"
    with staging_dir(out, tmp_path) as staging:
        (staging / "token_ids_part_0000.npy").write_bytes(b"\x02\x00")
        with pytest.raises(OutputConflictError, match="already holds different shards"):
            publish_local(staging, out, overwrite=False)
        assert (out / "token_ids_part_0000.npy").read_bytes() == b"\x01\x00"
        assert publish_local(staging, out, overwrite=True) == "overwritten"
    assert (out / "token_ids_part_0000.npy").read_bytes() == b"\x02\x00"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock file left beside it


def test_the_publish_lock_serialises_and_leaves_nothing_but_a_users_file(tmp_path):
    """Processes that publish into one output wait on each other (a lock file removed by its holder is
    not shared by two at once), no lock file stays, and a file of that name we did not write stays."""
    import multiprocessing

    from sftmix.output.publish import _publish_lock

    out = tmp_path / "out"
    ctx = multiprocessing.get_context("spawn")
    log = tmp_path / "log"
    procs = [ctx.Process(target=_hold_lock, args=(str(out), str(log), k)) for k in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    events = log.read_text().split()
    assert len(events) == 8 and all(events[i][1:] == events[i + 1][1:] for i in range(0, 8, 2)), events
    assert [p.name for p in tmp_path.iterdir()] == ["log"]
    theirs = tmp_path / ".out.tokenize-mixer-lock"
    theirs.write_text("a user's notes")
    with _publish_lock(out):
        pass
    assert theirs.read_text() == "a user's notes"


def _hold_lock(out: str, log: str, k: int) -> None:
    import time

    from sftmix.output.publish import _publish_lock

    with _publish_lock(Path(out)):
        with open(log, "a") as fh:
            fh.write(f"+{k}\n")
        time.sleep(0.2)
        with open(log, "a") as fh:
            fh.write(f"-{k}\n")


def test_an_output_made_from_another_recipe_is_refused_before_any_work(tmp_path):
    from sftmix.output.output_dir import refuse_different_output

    recipe = {
        "mixer": {"datasets": [{"path": "a.jsonl", "amount": "1.0"}], "max_seq_length": 4096},
        "data": ["f0"],
        "tokenizer": "t0",
    }
    out = tmp_path / "out"
    with staging_dir(out, tmp_path) as first:
        (first / "token_ids_part_0000.npy").write_bytes(b"\x01\x00")
        assert publish_local(first, out, overwrite=False, recipe=recipe) == "created"
    refuse_different_output(str(out), False, recipe)  # the same recipe: the same shards, go on
    changed = {
        "mixer": {"datasets": [{"path": "a.jsonl", "amount": "2.0"}], "max_seq_length": 2048},
        "data": ["f1"],
        "tokenizer": "t1",
    }
    with pytest.raises(OutputConflictError) as refused:
        refuse_different_output(str(out), False, changed)
    assert (
        "made with other settings or data (the data of dataset 0 changed; mixer.datasets[0].amount: 1.0 -> 2.0; "
        "mixer.max_seq_length: 4096 -> 2048; 1 more)" in str(refused.value)
    )
    refuse_different_output(str(out), True, changed)  # overwrite: publishing replaces it
    refuse_different_output(str(tmp_path / "absent"), False, changed)
    # data fingerprinted another way (an older version: a file's sha256, now its batches): not refused
    # here; publishing compares the shards' digests
    with staging_dir(tmp_path / "old", tmp_path) as staged:
        (staged / "token_ids_part_0000.npy").write_bytes(b"\x01\x00")
        publish_local(staged, tmp_path / "old", overwrite=False, recipe={**recipe, "data": ["sha256:ab"]})
    refuse_different_output(str(tmp_path / "old"), False, {**recipe, "data": ["jsonl-batches:cd"]})


def test_other_settings_are_refused_from_the_config_alone(tmp_path):
    """The command's check before a Prefect API starts: the recipe's mixer part, made from the config,
    against the output's; other data, a tokenizer or a recipe of another format are the plan's to find."""
    from sftmix.output.output_dir import refuse_different_settings

    mixer = {"datasets": [{"path": "a.jsonl", "amount": "1.0"}], "max_seq_length": 4096}
    recipe = {"format": "3", "mixer": mixer, "data": ["f0"], "tokenizer": "t0"}
    out = tmp_path / "out"
    with staging_dir(out, tmp_path) as first:
        (first / "token_ids_part_0000.npy").write_bytes(b"\x01\x00")
        assert publish_local(first, out, overwrite=False, recipe=recipe) == "created"
    refuse_different_settings(str(out), False, mixer, "3")  # the same settings: the plan decides
    changed = {**mixer, "max_seq_length": 2048}
    with pytest.raises(OutputConflictError, match=r"\(mixer.max_seq_length: 4096 -> 2048\): this run would"):
        refuse_different_settings(str(out), False, changed, "3")
    refuse_different_settings(str(out), True, changed, "3")  # overwrite
    refuse_different_settings(str(out), False, changed, "4")  # a recipe of another format
    refuse_different_settings(str(tmp_path / "absent"), False, changed, "3")


def test_on_bad_row_skip_counts_each_skip_with_its_reason(tmp_path):
    rows = [
        GOOD,
        {"messages": [{"role": None, "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": "{not json"},
        {
            "messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]
        },  # template error
        GOOD,
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    m = mixer(tmp_path, (data, 1.0)).model_copy(update={"on_bad_row": "skip"})
    plan = build_plan(m, RunOptions(work_dir=str(tmp_path / "work")))
    manifest = tokenize_slice(plan.slices[0], plan.context)
    assert manifest.kept == 2 and manifest.dropped == {"bad_row": 3}
    assert [(e["row"], e["reason"]) for e in manifest.findings.drop_examples] == [
        (1, "bad_row"),
        (2, "bad_row"),
        (3, "bad_row"),
    ]
    assert "no 'role' string" in manifest.findings.drop_examples[0]["detail"]
    assert "chat template failed" in manifest.findings.drop_examples[2]["detail"]
    with pytest.raises(BadRowError, match=r"row 1 \(0-based; line 2 of the file\): message 0 has no 'role'"):
        build_plan(mixer(tmp_path, (data, 1.0)), RunOptions(work_dir=str(tmp_path / "work")))  # (before work)
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD, GOOD])
    skipping = build_plan(
        m.model_copy(update={"datasets": mixer(tmp_path, (good, 1.0)).datasets}),
        plan_run := RunOptions(work_dir=str(tmp_path / "work")),
    )
    strict = build_plan(mixer(tmp_path, (good, 1.0)), plan_run)
    assert (
        strict.slices[0].key != skipping.slices[0].key
    )  # a skipped row never leaks into an 'error' run's cache


def test_more_bad_inputs_get_a_clear_answer(tmp_path):
    bad_utf8 = tmp_path / "latin1.jsonl"
    bad_utf8.write_bytes(
        json.dumps(GOOD).encode()
        + b"\n"
        + '{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1")
        + b"\n"
    )
    with pytest.raises(DatasetError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte 139 of the file\)"):
        build_plan(mixer(tmp_path, (str(bad_utf8), 1.0)), RunOptions(work_dir=str(tmp_path / "w1")))

    data = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    m = mixer(tmp_path, (data, 1.0))
    m.datasets[0].split = "test"
    with pytest.raises(DatasetError, match="only the 'train' split"):
        build_plan(m, RunOptions(work_dir=str(tmp_path / "w2")))


def test_the_utf8_check_names_the_first_bad_byte_wherever_the_blocks_are_cut():
    """The check sees a file in blocks; the first invalid byte, its line, and a file that ends inside a
    character are found as a decode of the whole file finds them, however the blocks cut characters."""
    import random
    import re

    from sftmix.sources.hashing import _Utf8Check

    def whole(text: bytes) -> str:
        try:
            text.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.end == len(text) and exc.reason == "unexpected end of data":
                return "ends"
            line = text.count(b"\n", 0, exc.start) + 1
            return f"line {line} byte {exc.start}"
        return "ok"

    def in_blocks(blocks: list[bytes]) -> str:
        check = _Utf8Check("f")
        try:
            for block in blocks:
                check(block)
            check.finish()
        except DatasetError as exc:
            if "ends inside a UTF-8 character" in str(exc):
                return "ends"
            found = re.search(r"line (\d+) is not valid UTF-8 \(byte (\d+) of the file\)", str(exc))
            assert found, str(exc)
            return f"line {found[1]} byte {found[2]}"
        return "ok"

    rng = random.Random(7)
    pieces = ["a", "\n", "é", "😀", "€", "x\n"]
    seen = set()
    for _ in range(4000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30))).encode()
        if rng.random() < 0.5:  # a stray byte: continuation, lead, never-valid, surrogate or overlong start
            at = rng.randrange(len(text) + 1)
            text = (
                text[:at] + bytes([rng.choice([0x80, 0xC3, 0xE2, 0xF0, 0xFF, 0xED, 0xC0, 0xF4])]) + text[at:]
            )
        if rng.random() < 0.2:
            text = text[:-1]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 4))))
        blocks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        expected = whole(text)
        assert in_blocks(blocks) == expected, (text, blocks)
        seen.add(expected.split()[0])
    assert seen == {"ok", "ends", "line"}


def test_a_file_hashed_ahead_gives_every_caller_the_same_hash_or_the_same_error(tmp_path):
    """The plan hashes data files on a thread beside their Arrow conversion (sources.hash_ahead): a
    caller that comes while it runs waits for that hash or its error; later callers get them too."""
    import hashlib
    import threading

    from sftmix.sources.hashing import file_sha256, hash_ahead

    big = tmp_path / "big.jsonl"
    big.write_text((json.dumps(GOOD) + "\n") * 200_000)  # 17 MB: still being hashed when the callers come
    hash_ahead([str(big)])
    digests: list[str] = []
    callers = [threading.Thread(target=lambda: digests.append(file_sha256(str(big), True))) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert digests == [hashlib.sha256(big.read_bytes()).hexdigest()] * 3

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(big.read_bytes() + '{"messages": "caf\xe9"}\n'.encode("latin-1"))
    hash_ahead([str(bad)])
    for _ in range(2):
        with pytest.raises(DatasetError, match="bad.jsonl': line 200001 is not valid UTF-8"):
            file_sha256(str(bad), True)

    lists = write_jsonl(tmp_path / "lists.jsonl", [{"messages": [{"role": "user", "content": ["a", "b"]}]}])
    with pytest.raises(  # (the plan's sample holds the row: refused before work)
        BadRowError,
        match=r"row 0 \(0-based; line 1 of the file\): message 0 \(user\) has content of type list",
    ):
        build_plan(mixer(tmp_path, (lists, 1.0)), RunOptions(work_dir=str(tmp_path / "w3")))


@pytest.mark.full  # (the quick loop: tests/tiers.py)
def test_a_10_mb_row_is_truncated_not_dropped(tmp_path):
    huge = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 2_000_000}]
    }
    data = write_jsonl(tmp_path / "huge.jsonl", [GOOD, huge])
    plan = build_plan(mixer(tmp_path, (data, 1.0)), RunOptions(work_dir=str(tmp_path / "w")))
    manifests = [tokenize_slice(s, plan.context) for s in plan.slices]
    assert sum(m.kept for m in manifests) == 2 and max(m.tokens for m in manifests) == 128


@pytest.mark.parametrize(
    "tools",
    [None, "", json.dumps([{"name": "f"}]), {"name": "f"}, [{"name": "f"}, {"name": "g"}]],
)
def test_tools_of_each_accepted_type_reach_the_template(tmp_path, tools):
    template = tmp_path / "tools.jinja"
    template.write_text(
        "{% if tools %}{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    row = dict(GOOD, tools=tools) if tools is not None else GOOD
    data = write_jsonl(tmp_path / "t.jsonl", [row])
    plan = build_plan(
        mixer(tmp_path, (data, 1.0), template=str(template)), RunOptions(work_dir=str(tmp_path / "w"))
    )
    manifest = tokenize_slice(plan.slices[0], plan.context)
    assert manifest.kept == 1


def test_rows_without_trainable_text_are_counted_drops(tmp_path):
    """A chat with no assistant turn has nothing to learn: dropped as the reference drops it, and counted."""
    no_assistant = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, no_assistant, GOOD])
    plan = build_plan(mixer(tmp_path, (data, 1.0)), RunOptions(work_dir=str(tmp_path / "work")))
    manifest = tokenize_slice(plan.slices[0], plan.context)
    assert (manifest.kept, manifest.dropped) == (2, {"no_trainable_tokens": 1})
    assert [e["row"] for e in manifest.findings.drop_examples] == [1]


def test_token_ids_that_do_not_fit_the_dtype_fail_loudly(tmp_path):
    """The reference picks the dtype from vocab_size and would wrap an id that does not fit; we name the
    dataset and row, and token_dtype_rule: largest_id fixes it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "[EOS]", "user", "assistant", ":", "hi", "hello", "far"]
    vocab = {w: i for i, w in enumerate(words)}
    vocab["far"] = 70_000  # 8 entries (vocab_size 8 -> uint8), one id far beyond any small dtype
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "[EOS]", "unk_token": "[UNK]"})
    )
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' [EOS] ' }}{% endfor %}"
    )
    far = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello far"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, far])
    m = mixer(tmp_path, (data, 1.0), template=str(template), tokenizer=tok_dir)
    plan = build_plan(m, RunOptions(work_dir=str(tmp_path / "w1")))
    with pytest.raises(
        TokenDtypeError, match=r"d\.jsonl', row 1 \(0-based\): token id 70000 does not fit uint8.*largest_id"
    ):
        tokenize_slice(plan.slices[0], plan.context)
    fixed = m.model_copy(update={"output": m.output.model_copy(update={"token_dtype_rule": "largest_id"})})
    plan = build_plan(fixed, RunOptions(work_dir=str(tmp_path / "w2")))
    assert plan.context.output.token_dtype == "uint32"
    assert tokenize_slice(plan.slices[0], plan.context).kept == 2
