"""The allow-list of input and output roots (sftmix/planning/roots.py): pure checks, and one flow run refused
before any slice is computed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.errors import ConfigError
from sftmix.planning.roots import ENV, check_allowed_roots, is_hub_name, split_roots

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(autouse=True)
def _no_worker_roots(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """/allowed (data, tokenizer, template, out, work) and /outside, with the cwd in /allowed."""
    allowed = tmp_path / "allowed"
    for sub in ("data", "tok", "out", "work"):
        (allowed / sub).mkdir(parents=True)
    (allowed / "data" / "d.jsonl").write_text("{}\n")
    (allowed / "chat.jinja").write_text("{{ messages }}")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.jsonl").write_text("{}\n")
    monkeypatch.chdir(allowed)
    return tmp_path


def mixer(datasets=("data/d.jsonl",), tokenizer="tok", template="olmo", output="out/run1") -> MixerConfig:
    return MixerConfig(
        datasets=[DatasetEntry(path=p) for p in datasets],
        tokenizer=TokenizerSpec(name_or_path=tokenizer, chat_template=template),
        output=OutputSpec(path=output),
    )


def run(tree: Path, **kw) -> RunOptions:
    return RunOptions(work_dir=kw.pop("work_dir", str(tree / "allowed" / "work")), **kw)


def test_no_roots_no_restriction(tree):
    check_allowed_roots(mixer(datasets=["/etc/passwd.jsonl"], output="/tmp/x"), run(tree, work_dir="/"))


def test_everything_inside_the_roots_passes(tree, monkeypatch):
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    check_allowed_roots(mixer(template="chat.jinja"), run(tree, reference="out/old"))


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("mixer.datasets[1].path", {"datasets": ["data/d.jsonl", "../outside/secret.jsonl"]}),
        ("mixer.tokenizer.name_or_path", {"tokenizer": "../outside"}),
        ("mixer.tokenizer.chat_template", {"template": "../outside/t.jinja"}),
        ("mixer.output.path", {"output": "../outside/out"}),
    ],
)
def test_each_mixer_path_outside_is_refused_by_name(tree, monkeypatch, field, change):
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    with pytest.raises(ConfigError) as exc:
        check_allowed_roots(mixer(**change), run(tree))
    msg = str(exc.value)
    assert field in msg and str(tree / "outside") in msg  # the offending path, resolved
    assert f"allowed roots ({tree / 'allowed'}, from {ENV})" in msg


@pytest.mark.parametrize(
    ("field", "change"),
    [("run.work_dir", {"work_dir": "/tmp/elsewhere"}), ("run.reference", {"reference": "/tmp/ref.json"})],
)
def test_run_paths_outside_are_refused(tree, monkeypatch, field, change):
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    with pytest.raises(ConfigError, match=rf"{field} '/tmp/"):
        check_allowed_roots(mixer(), run(tree, **change))


def test_default_work_dir_is_checked_when_work_dir_is_unset(tree, monkeypatch):
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    monkeypatch.setenv("TOKENIZE_MIXER_WORK_DIR", str(tree / "outside" / "cache"))
    with pytest.raises(ConfigError, match="the default work directory"):
        check_allowed_roots(mixer(), RunOptions())
    monkeypatch.setenv("TOKENIZE_MIXER_WORK_DIR", str(tree / "allowed" / "cache"))
    check_allowed_roots(mixer(), RunOptions())


def test_every_offender_is_listed_at_once(tree, monkeypatch):
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    with pytest.raises(ConfigError) as exc:
        check_allowed_roots(mixer(output="/tmp/o"), run(tree, work_dir="/tmp/w"))
    assert "mixer.output.path" in str(exc.value) and "run.work_dir" in str(exc.value)
    assert "is a root" not in str(exc.value)


def test_symlinks_do_not_escape(tree, monkeypatch):
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    os.symlink(tree / "outside", tree / "allowed" / "data" / "link")
    with pytest.raises(ConfigError, match=r"resolves to .*outside/secret\.jsonl"):
        check_allowed_roots(mixer(datasets=["data/link/secret.jsonl"]), run(tree))
    os.symlink(tree / "outside", tree / "allowed" / "out" / "link")
    with pytest.raises(ConfigError, match="mixer.output.path"):
        check_allowed_roots(mixer(output="out/link/run"), run(tree))


def test_dot_dot_is_resolved_before_comparing(tree, monkeypatch):
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    with pytest.raises(ConfigError, match="mixer.output.path"):
        check_allowed_roots(mixer(output=str(tree / "allowed" / ".." / "outside" / "o")), run(tree))


def test_roots_match_whole_components_not_string_prefixes(tree, monkeypatch):
    (tree / "allowed2").mkdir()
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    with pytest.raises(ConfigError, match="mixer.output.path"):
        check_allowed_roots(mixer(output=str(tree / "allowed2" / "o")), run(tree))


def test_a_local_output_must_lie_strictly_below_a_root(tree, monkeypatch):
    monkeypatch.setenv(ENV, f"{tree / 'allowed'}{os.pathsep}{tree / 'allowed' / 'out'}")
    with pytest.raises(ConfigError, match="is a root: it must lie below one"):
        check_allowed_roots(mixer(output=str(tree / "allowed")), run(tree))
    check_allowed_roots(mixer(output="out"), run(tree))  # below the first root


def test_hub_names_are_not_paths(tree, monkeypatch):
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    check_allowed_roots(
        mixer(
            datasets=["allenai/tulu-3-sft-olmo-2-mixture-0225", "HuggingFaceH4/no_robots"], tokenizer="gpt2"
        ),
        run(tree),
    )
    assert is_hub_name("allenai/OLMo-2-1124-7B") and is_hub_name("gpt2")
    for not_hub in (
        "a/b/c",
        "/abs",
        "./x",
        "../x",
        "a/..",
        "~/x",
        "x.jsonl",
        "x.jsonl.gz",
        "o/x.csv",
        "gs://b/x",
        "file:///x",
    ):
        assert not is_hub_name(not_hub, dataset=True), not_hub
    assert not is_hub_name("data", dataset=True)  # exists here: datasets would load the directory


def test_a_hub_shaped_name_that_exists_locally_is_a_path(tree, monkeypatch):
    monkeypatch.setenv(ENV, str(tree / "allowed" / "data"))
    (tree / "allowed" / "org").mkdir()
    os.symlink(tree / "outside", tree / "allowed" / "org" / "name")
    with pytest.raises(ConfigError, match=r"mixer.datasets\[0\].path 'org/name'"):
        check_allowed_roots(mixer(datasets=["org/name"], tokenizer="gpt2", output="data/o"), run(tree))


def test_gs_roots(tree, monkeypatch):
    monkeypatch.setenv(ENV, f"{tree / 'allowed'}{os.pathsep}gs://bucket/sft")
    check_allowed_roots(
        mixer(datasets=["gs://bucket/sft/a.jsonl"], output="gs://bucket/sft/shards/run1"),
        run(tree, work_dir="gcs://bucket/sft/work"),
    )
    for bad in ("gs://bucket/sft2/a.jsonl", "gs://other/sft/a.jsonl", "s3://bucket/sft/a.jsonl"):
        with pytest.raises(ConfigError, match="mixer.datasets"):
            check_allowed_roots(mixer(datasets=[bad]), run(tree))
    with pytest.raises(ConfigError, match=r"'\.' and '\.\.' are not allowed"):
        check_allowed_roots(mixer(datasets=["gs://bucket/sft/../private/a.jsonl"]), run(tree))


@pytest.mark.skipif(os.pathsep != ":", reason="the ':' of a URL is only ambiguous where ':' separates roots")
def test_split_roots_keeps_url_colons():
    assert split_roots("/data:gs://b/p::gcs://c:/x ") == ["/data", "gs://b/p", "gcs://c", "/x"]


def test_parameter_roots_may_narrow_but_not_widen_the_workers(tree, monkeypatch):
    monkeypatch.setenv(ENV, str(tree / "allowed"))
    narrow = run(tree, allowed_roots=[str(tree / "allowed" / "data"), str(tree / "allowed" / "work")])
    with pytest.raises(ConfigError, match=r"run.allowed_roots \(within TOKENIZE_MIXER_ALLOWED_ROOTS\)"):
        check_allowed_roots(mixer(), narrow)  # tok and out are not in the narrowed roots
    with pytest.raises(ConfigError, match="outside the worker's TOKENIZE_MIXER_ALLOWED_ROOTS.*not widen"):
        check_allowed_roots(mixer(), run(tree, allowed_roots=["/"]))
    with pytest.raises(ConfigError, match="not widen"):
        check_allowed_roots(mixer(), run(tree, allowed_roots=[str(tree / "allowed"), "gs://bucket"]))


def test_parameter_roots_alone_restrict(tree):
    check_allowed_roots(mixer(), run(tree, allowed_roots=[str(tree / "allowed")]))
    with pytest.raises(ConfigError, match="from run.allowed_roots"):
        check_allowed_roots(mixer(output="/tmp/o"), run(tree, allowed_roots=[str(tree / "allowed")]))
    with pytest.raises(ConfigError, match="must be an absolute directory"):
        check_allowed_roots(mixer(), run(tree, allowed_roots=["relative"]))


def test_set_but_empty_allows_nothing(tree, monkeypatch):
    monkeypatch.setenv(ENV, "")
    with pytest.raises(ConfigError, match=r"allowed roots \(none"):
        check_allowed_roots(mixer(), run(tree))


def test_flow_run_outside_the_workers_roots_fails_before_any_slice(prefect_api, tmp_path, monkeypatch):
    from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

    data = tmp_path / "data"
    shutil.copytree(EXAMPLES / "data", data)
    (tmp_path / "allowed").mkdir()
    monkeypatch.setenv(ENV, str(tmp_path / "allowed"))
    m = MixerConfig(
        datasets=[DatasetEntry(path=str(data / "general.jsonl"))],
        tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="olmo"),
        output=OutputSpec(path=str(tmp_path / "victim")),
    )
    work = tmp_path / "allowed" / "work"
    with pytest.raises(ConfigError, match="outside the allowed roots") as exc:
        tokenize_mixer(mixer=m, run=RunOptions(work_dir=str(work), slice_rows=40, runner="thread"))
    assert "mixer.datasets[0].path" in str(exc.value) and "mixer.output.path" in str(exc.value)
    assert not (tmp_path / "victim").exists()
    assert not work.exists()  # no plan, no slice, no checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["allowed", "data"]  # not even a probe


def test_a_batch_of_slices_is_bound_by_the_workers_roots(tmp_path, monkeypatch):
    """runner work_pool: the tokenize-slices flow's parameters name datasets, a tokenizer and a work
    directory; the worker's roots bind them, and its local paths are never taken from them."""
    from sftmix.planning.roots import check_slices_allowed

    inside, outside = tmp_path / "data", tmp_path / "secret"
    inside.mkdir()
    outside.mkdir()
    monkeypatch.setenv(ENV, f"{inside}{os.pathsep}gs://work")
    check_slices_allowed(
        [str(inside / "a.jsonl"), "allenai/tulu-3-sft-mixture"], "allenai/OLMo-2-1124-7B", "gs://work/x"
    )
    with pytest.raises(ConfigError, match="secret"):
        check_slices_allowed([str(outside / "passwords.jsonl")], "allenai/OLMo-2-1124-7B", "gs://work/x")
    with pytest.raises(ConfigError, match="tokenizer"):
        check_slices_allowed([str(inside / "a.jsonl")], str(outside), "gs://work/x")
    with pytest.raises(ConfigError, match="work_dir"):
        check_slices_allowed([str(inside / "a.jsonl")], "allenai/OLMo-2-1124-7B", "gs://elsewhere/x")
    with pytest.raises(ConfigError, match="remote work directory"):
        check_slices_allowed([str(inside / "a.jsonl")], "allenai/OLMo-2-1124-7B", None)
