"""``convert``: the reference converter's flags, ours beside them, and the mixer config they make.

A reference flag is honoured here, or listed in :mod:`sftmix.config.reference_flags` with the reason it
cannot change the output (:data:`CHECKED_REFERENCE_FLAGS`), or refused there.
"""

from __future__ import annotations

import argparse

from sftmix.config.command_flags import flags, with_flags
from sftmix.config.config import DatasetEntry, MixerConfig
from sftmix.config.reference_flags import NEUTRAL_FLAGS, transform_chain
from sftmix.config.selection import parse_amount
from sftmix.errors import ConfigError
from sftmix.runtime import settings
from tokenize_mixer.command_line.subcommands import Subcommands, add_flag, flag_bool, run_flags, setting_flag

#: Environment setting for convert's --unknown_template (a cluster's profile can make typos errors).
UNKNOWN_TEMPLATE_ENV = settings.UNKNOWN_TEMPLATE.name
#: Reference flags that are not mixer settings: checked by ``reference_flags.check_flags``.
CHECKED_REFERENCE_FLAGS = (*NEUTRAL_FLAGS, "dataset_target_columns", "get_tokenizer_fn", "use_fast")


def convert_parser(sub: Subcommands) -> None:
    """``convert``: the reference converter's flags, and ours beside them."""
    conv = sub.add_parser("convert", help="the reference converter's flags, same bytes out")
    _reference_input_flags(conv)
    _reference_output_flags(conv)
    for name in CHECKED_REFERENCE_FLAGS:
        add_flag(conv, name, nargs="*", help=argparse.SUPPRESS)
    _beyond_the_reference(conv)
    run_flags(conv)


def _reference_input_flags(conv: argparse.ArgumentParser) -> None:
    """The reference's flags for what is read: the datasets, the tokenizer and its chat template."""
    add_flag(
        conv, "dataset_mixer_list", nargs="+", required=True, metavar="NAME AMOUNT", help="NAME AMOUNT pairs"
    )
    add_flag(
        conv, "dataset_mixer_list_splits", nargs="+", default=["train"], help="one split, or one per dataset"
    )
    add_flag(
        conv,
        "tokenizer_name_or_path",
        required=True,
        help="a hub name or a local directory holding tokenizer.json",
    )
    add_flag(conv, "tokenizer_revision", help="the hub revision (branch, tag or commit) of the tokenizer")
    add_flag(
        conv,
        "chat_template_name",
        help="one of the reference's named chat templates (olmo, tulu, zephyr, ...); none, or a name "
        "tokenize-mixer does not know: the tokenizer's own (see --unknown_template)",
    )
    add_flag(
        conv,
        "add_bos",
        type=flag_bool,
        nargs="?",
        const=True,
        default=False,
        help="start every document with the tokenizer's bos token, where the template does not",
    )


def _reference_output_flags(conv: argparse.ArgumentParser) -> None:
    """The reference's flags for what is written: the length, number and order of the documents, where
    they go, the transforms that make them."""
    add_flag(
        conv,
        "max_seq_length",
        type=int,
        help="longest document in tokens: longer chats are truncated, not dropped, as the reference does "
        "(default: no limit)",
    )
    add_flag(
        conv, "num_examples", type=int, default=0, help="keep the first N rows after the shuffle (0: all)"
    )
    add_flag(
        conv, "shuffle_seed", type=int, default=42, help="seed of the shuffle of the kept rows (default 42)"
    )
    add_flag(conv, "output_dir", required=True, help="where the shards go: a local directory or gs://...")
    add_flag(
        conv,
        "dataset_transform_fn",
        nargs="+",
        help="the reference's transform chain: sft_tulu_tokenize_and_truncate_v1 sft_tulu_filter_v1 "
        "(default), sft_tulu_tokenize_and_truncate_v1 alone (keep rows with no trainable token), or "
        "last_turn_tulu_tokenize_and_truncate_v1 [sft_tulu_filter_v1] (train on the final turn only)",
    )
    add_flag(
        conv,
        "tokenizer_config_only",
        type=flag_bool,
        nargs="?",
        const=True,
        default=False,
        help="write only OUTPUT_DIR/tokenizer/ (the tokenizer with the chat template) and stop",
    )


def _beyond_the_reference(conv: argparse.ArgumentParser) -> None:
    """``convert``'s flags that the reference does not have: where it is unsafe, the better way on request."""
    add_flag(
        conv,
        "unknown_template",
        choices=["fallback", "error"],
        default=settings.UNKNOWN_TEMPLATE.get(),
        help="a --chat_template_name tokenize-mixer does not know: use the tokenizer's own template with a "
        f"warning, as the reference does (fallback, the default), or refuse the run (error; also "
        f"{UNKNOWN_TEMPLATE_ENV}=error)",
    )
    for spec in flags(MixerConfig):
        setting_flag(conv, spec)


def mixer_from_convert_args(args: argparse.Namespace) -> MixerConfig:
    pairs = args.dataset_mixer_list
    if len(pairs) % 2:
        raise ConfigError(
            f"--dataset_mixer_list needs NAME AMOUNT pairs; got {len(pairs)} values: {' '.join(pairs)}"
        )
    if args.unknown_template not in ("fallback", "error"):
        raise ConfigError(f"{UNKNOWN_TEMPLATE_ENV} must be fallback or error, not {args.unknown_template!r}")
    names, amounts = pairs[0::2], [parse_amount(a) for a in pairs[1::2]]
    splits = args.dataset_mixer_list_splits
    if len(splits) == 1:
        splits = splits * len(names)
    elif len(splits) != len(names):
        raise ConfigError(f"--dataset_mixer_list_splits has {len(splits)} splits for {len(names)} datasets")
    chain = transform_chain(args.dataset_transform_fn)
    data = {
        "datasets": [
            DatasetEntry(path=n, amount=a, split=s) for n, a, s in zip(names, amounts, splits, strict=True)
        ],
        **chain.settings,
        "tokenizer": {
            "name_or_path": args.tokenizer_name_or_path,
            "revision": args.tokenizer_revision,
            "chat_template": args.chat_template_name,
            "add_bos": args.add_bos,
            "unknown_template": args.unknown_template,
        },
        "max_seq_length": args.max_seq_length,
        "shuffle_seed": args.shuffle_seed,
        "num_examples": args.num_examples,
        "output": {"path": args.output_dir},
    }
    return MixerConfig.model_validate(with_flags(data, vars(args), MixerConfig))
