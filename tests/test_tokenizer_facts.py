"""The facts kept per tokenizer directory are the loaded tokenizer's, and the files copied from a kept copy
are the files transformers writes: a run gives the same bytes with and without them, and a command
whose tokenizer is kept imports neither transformers nor datasets."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sftmix.tokenizing import tokenizer_facts as facts_module
from sftmix.tokenizing.templates import named_template
from sftmix.tokenizing.tokenizer import (
    TokenizerKey,
    largest_token_id,
    load_changes,
    load_hf_tokenizer,
    special_tokens,
    tokenizer_fingerprint,
)
from sftmix.tokenizing.tokenizer_facts import (
    TokenizerFacts,
    save_tokenizer,
    tokenizer_facts,
    worker_tokenizer_file,
    write_tokenizer_dir,
)
from tests.tokenizer_fixtures import GOLDEN, ensure_dolma2

ROOT = Path(__file__).parent.parent
DEMO_TOKENIZER = ROOT / "examples" / "tokenizer"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A user cache of the test's own, and no facts remembered by this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    facts_module.tokenizer_facts.cache_clear()
    facts_module._kept_dir.cache_clear()
    yield tmp_path / "cache"
    facts_module.tokenizer_facts.cache_clear()
    facts_module._kept_dir.cache_clear()


def _directory(name: str) -> Path:
    if name == "demo":
        return DEMO_TOKENIZER
    if name == "dolma2":
        return ensure_dolma2()
    return GOLDEN / "tokenizers" / name


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


@pytest.mark.parametrize("name", ["tiny", "demo", "dolma2"])
def test_kept_facts_and_files_are_the_loaded_tokenizers(cache, tmp_path, monkeypatch, name):
    key = TokenizerKey.of(str(_directory(name)), None)
    template = named_template("olmo")
    tok = load_hf_tokenizer(key)
    oracle = TokenizerFacts(
        fingerprint=tokenizer_fingerprint(key),
        chat_template=tok.chat_template,
        bos_token=tok.bos_token,
        special_tokens=special_tokens(tok),
        vocab_size=tok.vocab_size,
        largest_id=largest_token_id(tok),
        tokenizer_class=type(tok).__name__,
        load_changes=load_changes(key),
        eos_id=tok.eos_token_id,
    )
    save_tokenizer(key, template, tmp_path / "transformers")
    assert tokenizer_facts(key) == oracle  # made, and kept
    write_tokenizer_dir(key, template, tmp_path / "made")  # written, and kept
    first_copy = Path(worker_tokenizer_file(key, tmp_path / "workers-1"))

    # From here on the kept copies answer: loading the tokenizer would fail the test.
    def refuse(*args: object) -> None:
        raise AssertionError("the tokenizer was loaded though its facts are kept")

    monkeypatch.setattr(facts_module, "load_hf_tokenizer", refuse)
    monkeypatch.setattr(facts_module, "save_tokenizer", refuse)
    monkeypatch.setattr(facts_module, "save_worker_tokenizer", refuse)
    facts_module.tokenizer_facts.cache_clear()
    assert tokenizer_facts(key) == oracle
    write_tokenizer_dir(key, template, tmp_path / "copied")
    _same_files(tmp_path / "transformers", tmp_path / "made")
    _same_files(tmp_path / "transformers", tmp_path / "copied")
    second_copy = Path(worker_tokenizer_file(key, tmp_path / "workers-2"))
    assert first_copy.name == second_copy.name and first_copy.read_bytes() == second_copy.read_bytes()
    assert oracle.token_dtype("vocab_size").name == ("uint32" if oracle.vocab_size > 65536 else "uint16")


def test_a_changed_file_is_a_new_tokenizer_even_with_its_old_size_and_time(cache, tmp_path):
    """The key is the files' bytes: an edit that keeps the size and the modification time (a restored
    backup, ``touch -r``) still loads the tokenizer again."""
    directory = tmp_path / "tok"
    shutil.copytree(GOLDEN / "tokenizers" / "tiny", directory)
    config = directory / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = "{{ 'a' }}"
    config.write_text(json.dumps(data))
    before = tokenizer_facts(TokenizerKey.of(str(directory), None))
    stat = config.stat()
    data["chat_template"] = "{{ 'b' }}"
    config.write_text(json.dumps(data))
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert config.stat().st_size == stat.st_size
    facts_module.tokenizer_facts.cache_clear()
    facts_module._kept_dir.cache_clear()
    load_hf_tokenizer.cache_clear()  # (a new command: this process's own copy is keyed by size and time)
    after = tokenizer_facts(TokenizerKey.of(str(directory), None))
    assert (before.chat_template, after.chat_template) == ("{{ 'a' }}", "{{ 'b' }}")


def test_spoiled_kept_facts_are_made_again(cache):
    key = TokenizerKey.of(str(GOLDEN / "tokenizers" / "tiny"), None)
    made = tokenizer_facts(key)
    [kept] = list((cache / "tokenize-mixer" / "tokenizer-facts").glob("*/facts.json"))
    kept.write_text('{"fingerprint": "x"}')  # missing fields
    facts_module.tokenizer_facts.cache_clear()
    assert tokenizer_facts(key) == made
    assert json.loads(kept.read_text())["fingerprint"] == made.fingerprint


def test_a_hub_name_is_not_kept(cache):
    """What a hub name means can change on the hub: it is loaded by every command, as before."""
    assert facts_module._kept_dir(TokenizerKey.of("allenai/dolma2-tokenizer", None)) is None


PLAN_TWICE = """
import sys
from sftmix.config.run_file import load_run_file
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import build_plan
rf = load_run_file(sys.argv[1])
plan = build_plan(rf.mixer, RunOptions(work_dir=sys.argv[2]))
print(plan.context.tokenizer.encoder, *sorted(m for m in ("transformers", "datasets", "pandas") if m in sys.modules))
"""


def test_a_kept_tokenizer_and_schema_spare_a_plan_transformers_and_datasets(tmp_path):
    """The demo planned twice, each in a process of its own: the first imports transformers and datasets
    (and keeps what it learnt), the second neither (1.3-2 s of every command's start on 2 cores)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    argv = [sys.executable, "-c", PLAN_TWICE, str(ROOT / "examples" / "mixer.yaml"), str(tmp_path / "work")]
    first = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    second = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert {"datasets", "transformers"} <= set(first.stdout.split()), first.stdout
    assert second.stdout.split() == [first.stdout.split()[0]], second.stdout
