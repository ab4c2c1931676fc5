"""The proof that the fast encoder is the tokenizers library's tokenizer (:func:`analyse`), or why not.

tiktoken implements byte-level BPE as "merge the adjacent pair whose concatenation has the lowest rank,
leftmost first", over pieces found by a regex, after splitting at special tokens. The tokenizers library
merges "the adjacent pair earliest in the merges list, leftmost first". :func:`analyse` proves from
``tokenizer.json`` where the two are the same tokenizer:

- structure: a BPE model on bytes (no normalizer but NFC or NFKC, which only texts already in that form
  pass through fast; no dropout, byte fallback or word affixes), one of the
  regexes we test in both regex engines as a Split that keeps every match (the regex matches every
  character, so no text falls between pieces), a post-processor that adds nothing when special tokens
  are off (a ByteLevel one's offset trimming is done here as it does it), and added tokens matched as
  plain text (no strip, no single-word, none a prefix of another, so first and longest match agree);
- merges: every merge makes a vocabulary token, in the order of their ids (so "earliest merge" is
  "lowest rank" up to ties among merges that make the same token);
- every token, alone: its bytes run through both merge rules step by step. A token is *safe* when both
  pick the same pair at every step and end at the token. Inside one output token the merges made in
  context are exactly those made on its bytes alone, so an output whose tokens are all safe came from
  merges both rules make in the same order. Where each token is made by one merge (dolma2) that is a
  proof for every text; :class:`FastEncoder` re-encodes with the tokenizers library any text whose
  output holds an unsafe token (Llama-3's vocabulary, made by merging any split of each token, has 588).
  Where one token is made by several merges, ties between equal-rank merges in two different output
  tokens are the one case not decided here: the run's sample check and the tests compare both.

SentencePiece-style BPE has a proof of its own (``sftmix.tokenizing.sentencepiece_proof``).
"""

from __future__ import annotations

import json
from typing import Any

from sftmix.tokenizing.bpe_vocabulary import bpe_merges, bpe_ranks, byte_alphabet
from sftmix.tokenizing.engines import (
    BYTE_LEVEL_PATTERN,
    PROVEN_PATTERNS,
    PROVEN_SPLIT_SEQUENCES,
    fastokens_installed,
)
from sftmix.tokenizing.fast_analysis import LINE_RESTARTS, FastAnalysis, Trim, Unproven
from sftmix.tokenizing.pipeline_steps import (
    node_kind,
    normal_form,
    normalizer_does_nothing,
    plain_added_tokens,
    post_processor_trims,
)
from sftmix.tokenizing.sentencepiece_proof import analyse_sentencepiece, metaspace_scheme


def analyse(tokenizer_json: str | dict[str, Any]) -> FastAnalysis:
    """Prove the fast encoder equals this tokenizer (see the module docstring), or raise :class:`Unproven`;
    a file spelled in a way the proof does not expect is unproven too, never an error of the run."""
    try:
        return _analyse(tokenizer_json)
    except (Unproven, MemoryError):  # (a proof is kept: out of memory once is no reason for ever)
        raise
    except Exception as exc:
        raise Unproven(
            f"its tokenizer.json has a shape the proof does not read ({type(exc).__name__}: {exc})"
        ) from exc


def _analyse(tokenizer_json: str | dict[str, Any]) -> FastAnalysis:
    data = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise Unproven(f"its model is {model.get('type')!r}, not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise Unproven("its BPE has dropout")
    scheme = metaspace_scheme(data.get("normalizer"), data.get("pre_tokenizer"))
    if scheme is not None:
        return analyse_sentencepiece(data, scheme)
    if model.get("byte_fallback"):
        raise Unproven("its BPE falls back to byte tokens")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise Unproven("its BPE marks word pieces with a prefix or suffix")
    form = normal_form(data.get("normalizer"))
    normalizes = not normalizer_does_nothing(data.get("normalizer"))
    splits = _splits(data.get("pre_tokenizer"))
    pattern = splits[0] if len(splits) == 1 else ""
    if not pattern and not fastokens_installed():
        raise Unproven("a sequence of Split pre-tokenizers is fast only with fastokens, not installed here")
    trims = post_processor_trims(data.get("post_processor"))
    added = plain_added_tokens(data.get("added_tokens") or [], normalizes=normalizes)
    if trims and any(t[:1].isspace() or t[-1:].isspace() for t in added):
        raise Unproven("its post-processor trims offsets and an added token starts or ends with whitespace")
    ranks = bpe_ranks(model.get("vocab") or {}, added)
    merges = bpe_merges(model.get("merges") or [])
    index, one_merge = _merge_index(merges, ranks)
    trim = None if not trims else Trim(keep_first_space=trims[0])
    decodes = _decodes_as_bytes(data.get("decoder"), added)
    unsafe = tuple(_unsafe_tokens(ranks, index))
    return FastAnalysis(
        pattern,
        unsafe,
        one_merge,
        trim,
        decodes,
        form,
        splits=() if pattern else splits,
        restarts=LINE_RESTARTS,
    )


def _decodes_as_bytes(decoder: Any, added: dict[str, int]) -> bool:
    """Whether the library's decode is "every token's bytes, then UTF-8 with replacement": a ByteLevel
    decoder, and added tokens whose text it maps to their own UTF-8 (it maps text made only of its
    byte alphabet to those bytes, so ``é`` alone would become the byte 0xE9)."""
    if not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel":
        return False
    alphabet = byte_alphabet()
    for text in added:
        if all(c in alphabet for c in text) and bytes(alphabet[c] for c in text) != text.encode("utf-8"):
            return False
    return True


def _splits(pre: Any) -> tuple[str, ...]:
    """The Split regexes, in order, of a pre-tokenizer that is Splits then ByteLevel: one that amounts to
    tiktoken's find-all (:data:`PROVEN_PATTERNS`), or a proven sequence (:data:`PROVEN_SPLIT_SEQUENCES`)."""
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and isinstance(steps[0], dict) and steps[0].get("type") == "ByteLevel":
        level = steps[0]
        if level.get("add_prefix_space") or not level.get("use_regex", True):
            raise Unproven("its ByteLevel pre-tokenizer adds a prefix space or splits with no regex")
        return (BYTE_LEVEL_PATTERN,)
    if len(steps) < 2 or not all(isinstance(s, dict) for s in steps):
        raise Unproven(f"its pre-tokenizer is not Splits then ByteLevel ({node_kind(pre)})")
    *splits, level = steps
    kinds = [node_kind(step) for step in steps]
    if any(kind != "Split" for kind in kinds[:-1]) or kinds[-1] != "ByteLevel":
        raise Unproven(f"its pre-tokenizer is {' then '.join(kinds)}, not Splits then ByteLevel")
    if level.get("add_prefix_space") or level.get("use_regex"):
        raise Unproven("its ByteLevel step adds a prefix space or splits again with GPT-2's regex")
    regexes = []
    for split in splits:
        keeps_matches = (split.get("behavior"), bool(split.get("invert"))) in {
            ("Isolated", False),
            ("Removed", True),
        }
        if not keeps_matches:
            raise Unproven(
                f"its Split keeps pieces as {split.get('behavior')!r} (invert {split.get('invert')})"
            )
        regex = (split.get("pattern") or {}).get("Regex")
        if not isinstance(regex, str):
            raise Unproven("its Split matches a plain string, not a regex")
        regexes.append(regex)
    if len(regexes) == 1 and regexes[0] not in PROVEN_PATTERNS.values():
        raise Unproven("its Split regex is not one proven to split the same in every regex engine we use")
    if len(regexes) > 1 and tuple(regexes) not in PROVEN_SPLIT_SEQUENCES.values():
        raise Unproven(
            f"its {len(regexes)} Split regexes are not a sequence proven to split the same in every regex engine we use"
        )
    return tuple(regexes)


def _merge_index(
    merges: list[tuple[str, str]], ranks: dict[bytes, int]
) -> tuple[dict[tuple[bytes, bytes], int], bool]:
    """Each merge (as bytes) -> its place in the list, after checking the list is in rank order."""
    alphabet = byte_alphabet()
    index: dict[tuple[bytes, bytes], int] = {}
    made: set[int] = set()
    one_merge, last = True, -1
    for k, (a, b) in enumerate(merges):
        left, right = bytes(alphabet[c] for c in a), bytes(alphabet[c] for c in b)
        rank = ranks.get(left + right)
        if rank is None or left not in ranks or right not in ranks:
            raise Unproven(f"merge {a!r} + {b!r} uses or makes a token outside the vocabulary")
        if rank < last:
            raise Unproven(f"merge {k} ({a!r} + {b!r}) comes after a merge that makes a later token")
        if rank in made:
            one_merge = False
        made.add(rank)
        last = rank
        index.setdefault((left, right), k)
    return index, one_merge


def _unsafe_tokens(ranks: dict[bytes, int], index: dict[tuple[bytes, bytes], int]) -> list[int]:
    """Tokens whose bytes, alone, the two merge rules take through different steps (module docstring)."""
    unsafe = []
    for token, rank in ranks.items():
        if len(token) > 1 and not _same_steps(token, ranks, index):
            unsafe.append(rank)
    return sorted(unsafe)


def _same_steps(token: bytes, ranks: dict[bytes, int], index: dict[tuple[bytes, bytes], int]) -> bool:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        by_rank = by_merge = -1
        best_rank = best_merge = None
        for i in range(len(parts) - 1):
            pair = (parts[i], parts[i + 1])
            r = ranks.get(pair[0] + pair[1])
            if r is not None and (best_rank is None or r < best_rank):
                best_rank, by_rank = r, i
            k = index.get(pair)
            if k is not None and (best_merge is None or k < best_merge):
                best_merge, by_merge = k, i
        if by_rank < 0 or by_rank != by_merge:
            return False
        parts[by_rank : by_rank + 2] = [parts[by_rank] + parts[by_rank + 1]]
    return True


#: Bump when :func:`analyse` proves something else: cached proofs of the old one are not used.
ANALYSIS_VERSION = 8
