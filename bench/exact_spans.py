"""Rows kept and trainable tokens with the reference's span rule vs ``spans: exact``, on the same chats.

    python bench/exact_spans.py --rows 4000 --template olmo --max-seq-length 4096

The reference drops rows whose assistant spans it cannot verify (token-count fallback); exact spans
come from the pasted render itself. Both run here side by side on ShareGPT chats (bench/data.py) with
the dolma2 tokenizer, through the same engine as the flow (LabelMasker), and print both tallies.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.data import dolma2_dir, sharegpt_chats  # noqa: E402
from sftmix.sources.formats import Conversation  # noqa: E402
from sftmix.tokenizing.labels import LabelMasker, MaskerEncoding  # noqa: E402
from sftmix.tokenizing.masking import Masking  # noqa: E402
from sftmix.tokenizing.row_status import DROP_REASONS, RowStatus  # noqa: E402
from sftmix.tokenizing.templates import ChatRenderer, named_template  # noqa: E402
from sftmix.tokenizing.tokenizer import (  # noqa: E402
    TokenizerKey,
    load_hf_tokenizer,
    rust_tokenizer,
    segment_boundaries,
    special_tokens,
)


def tally(spans: str, convs: list[Conversation], template: str, max_len: int) -> dict:
    key = TokenizerKey.of(str(dolma2_dir()), None)
    hf, rust = load_hf_tokenizer(key), rust_tokenizer(key)
    masker = LabelMasker(
        ChatRenderer(named_template(template), special_tokens(hf)),
        MaskerEncoding(
            lambda texts: rust.encode_batch(texts, add_special_tokens=False),
            lambda ids: rust.decode(ids, skip_special_tokens=False),
            segment_boundaries(key),
        ),
        Masking(max_len, spans=spans),
    )
    started = time.perf_counter()
    kept = trainable = tokens = rescued = 0
    dropped: Counter[str] = Counter()
    for b in range(0, len(convs), 256):
        for row in masker.tokenize(convs[b : b + 256]):
            if row.status == RowStatus.KEPT:
                kept += 1
                tokens += row.ids.shape[0]
                trainable += int(row.mask.sum())
                rescued += row.reference_drops
            else:
                dropped[DROP_REASONS[row.status]] += 1
    return {
        "spans": spans,
        "rows_kept": kept,
        "tokens": tokens,
        "trainable_tokens": trainable,
        "dropped": dict(dropped),
        "kept_where_reference_drops": rescued,
        "seconds": round(time.perf_counter() - started, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--template", default="olmo")
    ap.add_argument("--max-seq-length", type=int, default=4096)
    args = ap.parse_args()
    convs = [Conversation(m, None) for m in sharegpt_chats(args.rows)]
    print(
        f"{len(convs)} ShareGPT chats, dolma2, template {args.template}, max_seq_length {args.max_seq_length}"
    )
    results = [tally(s, convs, args.template, args.max_seq_length) for s in ("reference", "exact")]
    for r in results:
        print(
            f"  spans {r['spans']:9s}: {r['rows_kept']:5d} rows kept, {r['trainable_tokens']:,} trainable of "
            f"{r['tokens']:,} tokens, dropped {r['dropped']}, kept where the reference drops "
            f"{r['kept_where_reference_drops']} ({r['seconds']} s)"
        )
    ref, exact = results
    print(
        f"  exact / reference: rows kept x{exact['rows_kept'] / max(ref['rows_kept'], 1):.3f}, "
        f"trainable tokens x{exact['trainable_tokens'] / max(ref['trainable_tokens'], 1):.3f}"
    )


if __name__ == "__main__":
    main()
