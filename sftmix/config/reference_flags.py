"""The reference converter's flags that are not mixer settings: each one is honoured, or provably does
not change the output (the reason is written next to it), or refused with a clear error before any work.

Audited against open-instruct e6c3044aa (``scripts/data/convert_sft_data_for_olmocore.py`` and
``open_instruct/dataset_transformation.py``, ``numpy_dataset_conversion.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sftmix.errors import ConfigError

logger = logging.getLogger(__name__)

TOKENIZE = "sft_tulu_tokenize_and_truncate_v1"
FILTER = "sft_tulu_filter_v1"
LAST_TURN = "last_turn_tulu_tokenize_and_truncate_v1"


@dataclass(frozen=True)
class Chain:
    """What a ``--dataset_transform_fn`` chain means for the mixer: the mixer settings it sets."""

    settings: dict[str, Any]
    warning: str | None = None


_LAST_TURN_WARNING = (
    "--dataset_transform_fn {chain}: the reference itself crashes on this chain (its convert script passes "
    "max_seq_length only to {tokenize}, so {last_turn} fails with a TypeError); there are no reference bytes "
    "to match. tokenize-mixer trains on the final assistant turn only (mask: last_turn)"
)

#: Every SFT chain the reference's convert script runs (or is meant to run), and its meaning here.
CHAINS: dict[tuple[str, ...], Chain] = {
    (TOKENIZE, FILTER): Chain({"mask": "assistant", "drop_untrainable": True}),
    (TOKENIZE,): Chain({"mask": "assistant", "drop_untrainable": False}),
    (LAST_TURN, FILTER): Chain({"mask": "last_turn", "drop_untrainable": True}, _LAST_TURN_WARNING),
    (LAST_TURN,): Chain({"mask": "last_turn", "drop_untrainable": False}, _LAST_TURN_WARNING),
}


def transform_chain(names: list[str] | None) -> Chain:
    """The chain's meaning, or a :class:`ConfigError` that lists the supported chains."""
    if not names:
        return CHAINS[TOKENIZE, FILTER]
    chain = CHAINS.get(tuple(names))
    if chain is None:
        supported = "; ".join(" ".join(c) for c in CHAINS)
        raise ConfigError(
            f"--dataset_transform_fn {' '.join(names)} is not supported. Supported chains: {supported} "
            f"(the first is the default). Other transforms (sft_tokenize_v1, sft_tokenize_mask_out_prompt_v1, "
            "sft_tulu_tokenize_without_truncation_v1, preference or RLVR ones) tokenize or mask differently"
        )
    if chain.warning:
        logger.warning(chain.warning.format(chain=" ".join(names), tokenize=TOKENIZE, last_turn=LAST_TURN))
    return chain


#: Flags that provably do not change the output, with the reason (accepted so scripts run unchanged).
NEUTRAL_FLAGS: dict[str, str] = {
    "dataset_name": "declared by the convert script but never passed to the conversion",
    "dataset_mixer": "declared by the convert script but never passed to the conversion",
    "dataset_cache_mode": "where the reference caches its tokenized datasets",
    "dataset_local_cache_dir": "where the reference caches its tokenized datasets",
    "dataset_config_hash": "the name of the reference's cache entry (we always tokenize, with our own checkpoints)",
    "dataset_skip_cache": "whether the reference reads its cache",
    "visualize": "prints the first example to the log",
    "resume": "resumes the reference's own partial files; our checkpoints always resume",
    "use_slow_tokenizer": "declared 'completely ignored' by the reference",
    "trust_remote_code": "how a hub tokenizer is loaded; tokenize-mixer never runs a tokenizer's remote code "
    "(a tokenizer that needs it fails with transformers' own message)",
}

#: The columns the reference's collect loop and statistics need (``TOKENIZED_SFT_DATASET_KEYS_WITH_SOURCE``).
REQUIRED_TARGET_COLUMNS = ("input_ids", "attention_mask", "labels", "dataset_source")


def check_flags(values: dict[str, list[str] | None]) -> None:
    """Refuse the flag values that would change the output in a way we do not reproduce; say which
    accepted flags are output-neutral. ``values``: flag name -> its words (None when not given)."""
    for name, why in NEUTRAL_FLAGS.items():
        if values.get(name) is not None:
            logger.info("--%s does not change the output (%s)", name, why)
    columns = values.get("dataset_target_columns")
    if columns is not None:
        missing = [c for c in REQUIRED_TARGET_COLUMNS if c not in columns]
        if missing:
            raise ConfigError(
                f"--dataset_target_columns without {', '.join(missing)}: the reference's conversion reads "
                "these columns and fails without them; leave the flag out"
            )
    fn = values.get("get_tokenizer_fn")
    if fn is not None and fn != ["get_tokenizer_tulu_v2_2"]:
        raise ConfigError(
            f"--get_tokenizer_fn {' '.join(fn)} is not supported: tokenize-mixer reproduces the reference's "
            "default, get_tokenizer_tulu_v2_2 (the others add pad tokens and pick templates differently)"
        )
    use_fast = values.get("use_fast")
    if use_fast is not None and [w.lower() for w in use_fast] in (["false"], ["0"], ["no"]):
        raise ConfigError(
            "--use_fast False: the reference refuses slow tokenizers for SFT (its assistant spans need "
            "offsets, which only fast tokenizers give); leave the flag out"
        )
