"""``SliceManifest`` is kept in sections, but a slice's ``manifest.json`` is what checkpoints of earlier
versions hold: its keys, their order and its bytes stay those of the flat class it was, so those
checkpoints are read and reused (issue 80)."""

from __future__ import annotations

import json

from sftmix.tokenizing.slices import SliceManifest, tokenize_slice

#: A manifest as the flat SliceManifest wrote it (sftmix/tokenizing/slices/executor.py: ``indent=1``).
WRITTEN_FLAT = {
    "key": "k", "dataset": "d", "row_start": 0, "row_end": 5, "rows": 5, "kept": 4, "tokens": 9,
    "trainable_tokens": 4, "dropped": {"x": 1}, "kept_by_exact_spans": 1, "untrainable_kept": {"y": 1},
    "spelled_special_tokens": 2, "over_length": 1, "unrendered_rows": {"z": 1}, "drop_examples": [{"row": 1}],
    "token_dtype": "uint32", "files": {"tokens.npy": {"bytes": 3, "sha256": "s"}}, "seconds": 1.0,
    "started_at": 2.0, "finished_at": 3.0, "format_version": "3", "encoder": "fast", "library_texts": 1,
    "fast_engine": "tiktoken",
}  # fmt: skip


def test_a_flat_manifest_reads_into_sections_and_writes_the_same_bytes():
    manifest = SliceManifest.model_validate_json(json.dumps(WRITTEN_FLAT, indent=1))
    assert manifest.findings.over_length == 1 and manifest.findings.drop_examples == [{"row": 1}]
    assert (manifest.timing.seconds, manifest.timing.started_at, manifest.timing.finished_at) == (
        1.0,
        2.0,
        3.0,
    )
    assert (manifest.encoding.encoder, manifest.encoding.fast_engine) == ("fast", "tiktoken")
    assert json.dumps(manifest.model_dump(), indent=1) == json.dumps(WRITTEN_FLAT, indent=1)
    assert list(json.loads(manifest.model_dump_json())) == list(WRITTEN_FLAT)
    assert sorted(SliceManifest.flat_keys()) == sorted(WRITTEN_FLAT)
    assert len(SliceManifest.model_fields) <= 20


def test_a_manifest_of_an_older_version_reads_with_what_it_did_not_record_unknown():
    """Made before over-length rows, unrendered rows and the encoder were recorded: ``None`` (or the
    default) says so, and the store's checks read it as before."""
    old = {k: v for k, v in WRITTEN_FLAT.items() if k not in ("over_length", "unrendered_rows", "encoder")}
    manifest = SliceManifest.model_validate(old)
    assert manifest.findings.over_length is None and manifest.findings.unrendered_rows is None
    assert manifest.encoding.encoder == "hf" and manifest.encoding.library_texts == 1


def test_a_slice_writes_its_manifest_flat_in_the_order_it_always_had(golden_dir, tmp_path, monkeypatch):
    from sftmix.config.config import MixerConfig
    from sftmix.config.run_options import RunOptions
    from sftmix.planning.plan import build_plan
    from sftmix.tokenizing.slices import MANIFEST, slice_dir

    monkeypatch.chdir(golden_dir)
    mixer = MixerConfig.model_validate(
        {
            "datasets": [{"path": "data/chat_multi.jsonl", "amount": "1.0"}],
            "tokenizer": {"name_or_path": "tokenizers/dolma2", "chat_template": "olmo"},
            "output": {"path": str(tmp_path / "out")},
        }
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work"), slice_rows=100_000))
    manifest = tokenize_slice(plan.slices[0], plan.context)
    text = (slice_dir(plan.context.output.work_dir, manifest.key) / MANIFEST).read_text(encoding="utf-8")
    assert list(json.loads(text)) == list(WRITTEN_FLAT)
    assert SliceManifest.model_validate_json(text) == manifest
