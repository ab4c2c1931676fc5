"""``tokenize-mixer check``: a clean output is clean; each kind of finding, made on purpose, is found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sftmix.check.findings import check_output
from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from tokenize_mixer.cli import main
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

EXAMPLES = Path(__file__).parent.parent / "examples"


def run(
    tmp: Path,
    rows: list[dict],
    name: str,
    slice_rows: int | None = None,
    template: str | None = "olmo",
    output_options: dict | None = None,
    **mixer,
) -> Path:
    data = tmp / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = MixerConfig.model_validate(
        {
            "datasets": [{"path": str(data), "amount": "1.0"}],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": template},
            "output": {"path": str(tmp / name), **(output_options or {})},
            **mixer,
        }
    )
    options = RunOptions(work_dir=str(tmp / "work"), runner="thread", slice_rows=slice_rows)
    tokenize_mixer(mixer=config, run=options)
    return tmp / name


def chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


@pytest.fixture(scope="module")
def clean(prefect_api, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("check")
    return run(tmp, [chat(f"question {i}?", f"answer number {i}.") for i in range(30)], "clean")


def kinds(out: Path, **kw) -> dict[str, int]:
    return {f.what: f.count for f in check_output(out, **kw).findings}


def test_a_clean_output_is_clean_and_exit_0(clean, capsys):
    assert main(["check", str(clean), "--sequence_length", "4096"]) == 0
    assert "clean: nothing broken, nothing that changes training" in capsys.readouterr().out


@pytest.mark.parametrize("length", ["0", "-4", "4k"])
def test_a_sequence_length_that_is_not_a_length_is_refused_by_its_flag(tmp_path, capsys, length):
    """``check --sequence_length 0`` once divided by zero deep in the fit's simulation: now argparse's
    one line, naming the flag, before any part is read."""
    with pytest.raises(SystemExit) as stop:
        main(["check", str(tmp_path), "--sequence_length", length])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"argument --sequence_length/--sequence-length: must be a whole number above 0, not '{length}'" in err
    )


def test_integrity_findings(clean, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(clean, broken)
    tokens = broken / "token_ids_part_0000.npy"
    data = bytearray(tokens.read_bytes())
    data[10] ^= 0xFF
    tokens.write_bytes(bytes(data))
    mask = broken / "labels_mask_part_0000.npy"
    mask.write_bytes(mask.read_bytes()[:-3])
    found = kinds(broken)
    assert found["files whose digest differs from run_report.json"] >= 1
    assert found["parts whose token and mask files differ in length"] == 1
    report = tmp_path / "report.json"
    assert main(["check", str(broken), "--json", str(report)]) == 3  # broken: the worst kind
    assert json.loads(report.read_text())["clean"] is False
    assert {f.severity for f in check_output(broken).findings if f.kind == "integrity"} == {"broken"}


def test_fit_and_mask_findings(prefect_api, tmp_path):
    rows = [
        chat("short?", "yes."),
        chat("long? " * 200, "ok " * 200),
        chat("eos inside?", "a <|endoftext|> b"),
    ]
    rows += [chat("header?", "here: <|im_start|>user hello")]
    out = run(tmp_path, rows, "odd", max_seq_length=300, drop_untrainable=False)
    report = check_output(out, sequence_length=100)
    found = {f.what: f.count for f in report.findings}
    severity = {f.what: f.severity for f in report.findings}
    assert found["documents longer than sequence length 100"] >= 1
    assert found["documents with an EOS token before their end"] == 1
    untrainable = "documents with no trainable token (kept: drop_untrainable is off)"
    assert found[untrainable] == 1  # the long one: its answer was truncated away
    assert any("special token" in what for what in found)
    # the long one lost its EOS to truncation at max_seq_length 300: the user's setting, so information
    truncated = "documents truncated at max_seq_length 300"
    assert [n for what, n in found.items() if what.startswith(truncated)] == [1]
    assert not any(what.startswith("documents that do not end with EOS") for what in found)
    # what changes training, and what follows from the user's settings
    assert severity["documents with an EOS token before their end"] == "changes training"
    assert all(severity[w] == "changes training" for w in found if "special token" in w)
    assert severity["documents longer than sequence length 100"] == "information"
    assert severity[untrainable] == "information"
    assert all(severity[w] == "information" for w in found if w.startswith(truncated))
    assert report.exit_code == 1 and not report.clean


def test_the_flow_checks_before_publishing(prefect_api, tmp_path):
    """run.check report: findings in run_report.json and the output published; strict: the run fails
    naming the first finding, and nothing is published."""
    from prefect.states import State

    from sftmix.config.config import MixerConfig
    from sftmix.config.run_options import RunOptions

    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps(r) + "\n" for r in [chat("q?", "a <|endoftext|> b"), chat("q2?", "fine.")])
    )

    def flow(check: str, name: str) -> State:
        mixer = MixerConfig.model_validate(
            {
                "datasets": [{"path": str(data), "amount": "1.0"}],
                "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
                "output": {"path": str(tmp_path / name)},
            }
        )
        run = RunOptions(work_dir=str(tmp_path / "work"), runner="thread", check=check)
        return tokenize_mixer(mixer=mixer, run=run, return_state=True)

    assert flow("report", "reported").is_completed()
    report = json.loads((tmp_path / "reported" / "run_report.json").read_text())
    assert [f["what"] for f in report["check_findings"]] == ["documents with an EOS token before their end"]
    assert report["check_findings"][0]["severity"] == "changes training"
    assert report["template_drift"]["shipped"] == "differs"  # and the UI's report shows it
    assert any("DIFFERS from the tokenizer's own chat_template" in line for line in report["check_notes"])
    assert not any(line.lstrip().startswith(("---", "+++", "@@")) for line in report["check_notes"])
    strict = flow("strict", "strict")
    assert strict.is_failed() and "run.check is strict" in strict.message and "EOS" in strict.message
    assert "that change training" in strict.message and "--check report" in strict.message
    # the refused output is not published: its example is the source row, no document number
    assert f"(e.g. {data} row 0)" in strict.message, strict.message
    assert not (tmp_path / "strict").exists()


def test_strict_publishes_what_follows_from_the_users_own_settings(prefect_api, tmp_path):
    """Documents truncated by max_seq_length (their EOS with them) and documents left untrainable by it are
    information, not warnings: a strict check publishes them, the findings logged at INFO with their kind."""
    data = tmp_path / "d.jsonl"
    rows = [chat("long? " * 200, "ok " * 200), chat("q?", "fine " * 300)] + [
        chat(f"q{i}?", "a.") for i in range(5)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mixer = MixerConfig.model_validate(
        {
            "datasets": [{"path": str(data), "amount": "1.0"}],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
            "max_seq_length": 300,
            "output": {"path": str(tmp_path / "out")},
        }
    )
    run = RunOptions(work_dir=str(tmp_path / "work"), runner="thread", check="strict")
    assert tokenize_mixer(mixer=mixer, run=run, return_state=True).is_completed()
    report = json.loads((tmp_path / "out" / "run_report.json").read_text())
    assert report["check_findings"] and {f["severity"] for f in report["check_findings"]} == {"information"}
    assert any(
        f["what"].startswith("documents truncated at max_seq_length 300") for f in report["check_findings"]
    )
    assert main(["check", str(tmp_path / "out")]) == 0


@pytest.mark.full  # (the quick loop: tests/tiers.py)
def test_parts_checked_at_once_find_what_one_at_a_time_finds(prefect_api, tmp_path, monkeypatch):
    """An output of many parts (256-token parts here) is checked part by part on threads, each read in
    bounded chunks; the findings, their document numbers and the totals are those of checking the parts
    one after another in one chunk each."""
    import sftmix.assembly.assemble
    import sftmix.check.parts
    from sftmix.output.digest import output_digests

    rows = [
        chat(f"question {i}?", f"answer <|im_start|>user number {i}." if i % 7 == 0 else f"answer {i}.")
        for i in range(60)
    ]
    rows += [{"messages": [{"role": "user", "content": "no answer"}]}] * 3
    options = {"part_bytes": 1024}
    out = run(tmp_path, rows, "parts", 8, output_options=options, drop_untrainable=False, shuffle_seed=3)
    assert (out / "token_ids_part_0005.npy").exists()
    threaded = check_output(out, 16)
    monkeypatch.setattr(sftmix.check.parts, "MAX_PART_THREADS", 1)
    one_by_one = check_output(out, 16)
    assert threaded.findings and threaded.to_json() == one_by_one.to_json()
    # and read in chunks that cut documents and parts anywhere: the same again
    for chunk in (1, 7, 100):
        monkeypatch.setattr(sftmix.check.parts, "CHUNK", chunk)
        assert check_output(out, 16).to_json() == one_by_one.to_json()

    # and the digests hashed in the check's one read are output_digests'
    assert threaded.digests == output_digests(out)

    # the parts were written by window or by slice, on threads or worker processes: the same bytes as
    # one job after another, whatever the windows (which cut documents anywhere, and never cross a part)
    for by, threads, window, processes_from in (
        ("window", 1, 1 << 22, 16),
        ("window", 1, 5, 16),
        ("window", 4, 7, 10**9),
        ("window", 3, 256, 16),
        ("window", 2, 64, 1),
        ("slice", 1, 1 << 22, 16),
        ("slice", 3, 1 << 22, 10**9),
        ("slice", 2, 64, 1),
        (None, 2, 64, 1),  # by what the page cache holds
    ):
        monkeypatch.setattr(sftmix.assembly.assemble, "ASSEMBLE_BY", by)
        monkeypatch.setattr(sftmix.assembly.assemble, "ASSEMBLE_THREADS", threads)
        monkeypatch.setattr(sftmix.assembly.assemble, "WINDOW", window)
        monkeypatch.setattr(sftmix.assembly.assemble, "PROCESSES_FROM_TOKENS", processes_from)
        again_dir = tmp_path / f"again-{by}-{threads}-{window}-{processes_from}"
        again_dir.mkdir()
        again = run(
            again_dir, rows, "parts", 8, output_options=options, drop_untrainable=False, shuffle_seed=3
        )
        differ = {k for k, v in output_digests(again).items() if output_digests(out)[k] != v}
        assert differ == {"dataset_statistics.json"}  # which names the dataset file: another path here


@pytest.mark.full
def test_chunks_of_one_part_checked_at_once_find_what_one_chunk_finds(prefect_api, tmp_path, monkeypatch):
    """An output of one part is read in chunks on threads (as many as the check may use): the same
    findings, document numbers and totals as one chunk, and as the chunks one after another."""
    import sftmix.check.parts

    rows = [
        chat(f"question {i}?", f"answer <|im_start|>user number {i}." if i % 7 == 0 else f"answer {i}.")
        for i in range(60)
    ]
    rows += [{"messages": [{"role": "user", "content": "no answer"}]}] * 3
    out = run(tmp_path, rows, "one-part", slice_rows=8, drop_untrainable=False, shuffle_seed=3)
    assert not (out / "token_ids_part_0001.npy").exists()
    one_chunk = check_output(out, 16)
    assert one_chunk.findings
    for chunk in (1, 7, 100):
        monkeypatch.setattr(sftmix.check.parts, "CHUNK", chunk)
        monkeypatch.setattr(sftmix.check.parts, "available_cpus", lambda: 4)  # chunks on threads here too
        assert check_output(out, 16).to_json() == one_chunk.to_json()
        monkeypatch.setattr(sftmix.check.parts, "MAX_PART_THREADS", 1)
        assert check_output(out, 16).to_json() == one_chunk.to_json()
        monkeypatch.undo()


def test_template_drift_against_the_tokenizers_own_template(clean, prefect_api, tmp_path):
    """The template used is compared with the one the tokenizer ships for the model: the bundled
    tokenizer ships a ChatML template, so `olmo` differs (with a diff) and the tokenizer's own is the same."""
    drift = check_output(clean).template
    assert drift is not None and drift["shipped"] == "differs" and drift["source"] == "tokenize-mixer:olmo"
    assert drift["diff"][0].startswith("--- tokenizer's chat_template") and any(
        line.startswith("+") for line in drift["diff"][2:]
    )
    assert "DIFFERS from the tokenizer's own chat_template" in check_output(clean).render()
    own = run(tmp_path, [chat("q?", "a.")], "own", template=None)
    drift = check_output(own).template
    assert drift is not None and drift["shipped"] == "same" and "diff" not in drift


def test_template_drift_when_the_tokenizer_ships_none():
    from sftmix.tokenizing.templates import named_template, template_drift

    drift = template_drift(named_template("tulu"), "tokenize-mixer:tulu", None)
    assert drift["shipped"] == "none" and "shipped_sha256" not in drift
    assert template_drift("a", "file:x.jinja", {"default": "a", "tool_use": "b"})["shipped"] == "same"


def test_a_document_whose_trainable_share_is_far_from_its_datasets_is_found(prefect_api, tmp_path):
    """40 alike chats and one whose user turn dwarfs its answer: that one, named with its dataset; the
    alike ones are not (the clean fixture shows no such finding either)."""
    rows = [chat(f"question {i}?", f"a fairly long answer number {i}, with some words.") for i in range(40)]
    rows.append(chat("a very long question " * 60, "ok."))
    out = run(tmp_path, rows, "outlier")
    findings = {f.what: f for f in check_output(out).findings}
    outlier = findings["documents whose trainable share is an outlier for their dataset"]
    assert outlier.count == 1 and "outlier.jsonl" in outlier.examples[0], outlier.examples


def test_a_finding_counts_in_words_and_names_its_documents(prefect_api, tmp_path, capsys):
    """Three role markers trained mid-answer in two documents: one finding of 2 documents that names
    the token, said the same way in the report and in the flow's log line (``Finding.line``)."""
    rows = [
        chat("q1?", "a <|im_start|>user b <|im_start|>user c"),
        chat("q2?", "fine."),
        chat("q3?", "x <|im_start|>user y"),
    ]
    out = run(tmp_path, rows, "markers")
    [found] = [f for f in check_output(out).findings if "special token" in f.what]
    assert (found.count, found.unit, len(found.examples)) == (2, "documents", 2)
    assert "<|im_start|> (id 1)" in found.what
    # each example names the dataset and source row (what `inspect --dataset D --row R` opens), then the
    # document of the published output
    assert found.line().startswith(f"[masks] {found.what}: 2 documents (e.g. {out}.jsonl row ")
    named = sorted(e.split(" (document ")[0] for e in found.examples)
    assert named == [f"{out}.jsonl row 0", f"{out}.jsonl row 2"] and all(
        "(document " in e for e in found.examples
    )
    assert main(["check", str(out)]) == 1
    assert f"WARNING (changes training) {found.line()}" in capsys.readouterr().out.splitlines()


def test_a_differing_template_is_one_line_and_its_diff_is_asked_for(clean, tmp_path, capsys):
    """The text report names both templates and their hashes in one line; the diff is in --json and
    behind --template-diff."""
    assert main(["check", str(clean), "--json", str(tmp_path / "check.json")]) == 0
    text = capsys.readouterr().out
    [line] = [t for t in text.splitlines() if t.startswith("template:")]
    assert "tokenize-mixer:olmo (sha256 " in line and "DIFFERS" in line and line.count("sha256") == 2
    assert "--template_diff" in line and "--json" in line
    assert not any(t.lstrip().startswith(("---", "+++", "@@")) for t in text.splitlines())
    diff = json.loads((tmp_path / "check.json").read_text())["template"]["diff"]
    assert diff[0].startswith("--- tokenizer's chat_template")
    assert main(["check", str(clean), "--template-diff"]) == 0
    assert f"    {diff[1]}" in capsys.readouterr().out.splitlines()


def test_data_the_template_never_renders_is_a_finding(prefect_api, tmp_path, capsys):
    """A chat in Hugging Face's tool format under olmo: its tool_calls and its tool message are in no
    render; the run says so in its summary and check finds it (changes training), the bytes unchanged."""
    tool_chat = {
        "messages": [
            {"role": "user", "content": "6 x 7?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "m"}}],
            },
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "42."},
        ]
    }
    out = run(tmp_path, [tool_chat, chat("q?", "fine.")], "tools")
    report = json.loads((out / "run_report.json").read_text())
    assert [line.split(" hold ")[1].split(",")[0] for line in report["unrendered"]] == [
        "message field 'tool_calls'",
        "messages of role 'tool'",
    ]
    [found] = [f for f in check_output(out).findings if f.kind == "template"]
    assert (found.count, found.severity, found.examples) == (2, "changes training", report["unrendered"])
    assert main(["check", str(out)]) == 1
    assert "tool_calls" in capsys.readouterr().out


def test_a_findings_documents_are_counted_once_and_only_a_few_kept():
    """What a finding holds does not grow with the output: its count, and its first examples; a document
    seen again at the next chunk's edge is one document, and a later part's are numbered after it."""
    from sftmix.check.parts import EXAMPLES, Documents

    part = Documents()
    part.add(np.array([2, 3, 7]))
    part.add(np.array([7, 9]))  # document 7 cut by a chunk's edge
    part.add(np.arange(10, 10_000))
    assert part.count == 4 + 9_990 and part.examples == [2, 3, 7, 9, 10][:EXAMPLES]
    output = Documents()
    output.merge(Documents(count=1, examples=[0], last=0), 0)
    output.merge(part, 100)
    assert output.count == 1 + part.count and output.examples == [0, 102, 103, 107, 109][:EXAMPLES]
    assert output.last == 100 + 9_999


def test_special_tokens_found_among_candidates_as_on_every_token():
    """The check looks special ids up among the tokens at or above the lowest of them when those are
    rare: the same documents as the lookup on every token, for ids low and high, rare and common."""
    from sftmix.check.parts import _check_chunk, _positions_of

    rng = np.random.default_rng(41)
    for trial in range(300):
        vocab = int(rng.integers(4, 300))
        ids = np.unique(rng.integers(0 if trial % 3 == 0 else vocab // 2, vocab, int(rng.integers(1, 6))))
        n = int(rng.integers(1, 400))
        common = trial % 2 == 0
        t = rng.integers(0, vocab if common else max(1, int(ids[0])), n).astype(np.uint32)
        sprinkle = rng.random(n) < 0.03
        t[sprinkle] = rng.choice(ids, int(sprinkle.sum()))
        assert _positions_of(t, ids).tolist() == np.flatnonzero(np.isin(t, ids)).tolist()
        with_next = rng.integers(0, 2, n + int(rng.integers(0, 2))).astype(np.uint8)
        lo = int(rng.integers(0, 50))
        ends = np.unique(np.r_[rng.integers(lo + 1, lo + n + 1, max(1, n // 20)), lo + n])
        facts = _check_chunk(t, with_next, lo, ends, vocab, None, ids)
        m = with_next.astype(bool)[:n]
        follows = np.append(with_next.astype(bool)[1:], False)[:n]
        last = np.zeros(n, bool)
        last[ends - lo - 1] = True
        at = np.flatnonzero(m & follows & ~last & np.isin(t, ids))
        docs = np.searchsorted(ends, lo + at, side="right")
        expected = {int(i): np.unique(docs[t[at] == i]).tolist() for i in np.unique(t[at]).tolist()}
        assert {k: v.tolist() for k, v in facts.special_trained.items()} == expected


def test_the_summary_says_what_changes_training(tmp_path):
    """Documents the max length cut (their EOS with them) are in the command's summary, a line each
    finding, not only an information line in the log (issue 71)."""
    from tests.cli_runs import convert_args
    from tests.test_cli import cli

    rows = [chat(f"question {i}?", "a long answer " * (2 + i * 4)) for i in range(12)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = cli(*convert_args(data, tmp_path / "work", tmp_path / "out", max_seq_length=160))
    report = json.loads((tmp_path / "out" / "run_report.json").read_text())
    [cut] = [
        f for f in report["check_findings"] if f["what"].startswith("documents truncated at max_seq_length")
    ]
    said = [line for line in proc.stdout.splitlines() if line.startswith("training")]
    assert said == [f"training    [fit] {cut['what']}: {cut['count']:,} documents"], proc.stdout
    assert report["training"] == [said[0].removeprefix("training    ")]
