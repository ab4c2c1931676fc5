"""The command's subcommands and the flags they share: ``run``, ``plan``, the commands that read an output
(``compare``, ``digest``, ``inspect``, ``report``) and ``check``; the run options their flags set; each
flag in both spellings (``--snake_case``, the reference's, and ``--kebab-case``), and a flag per setting
derived from the config's fields (:mod:`sftmix.config.command_flags`).
"""

from __future__ import annotations

import argparse
from typing import Any

from sftmix.config.command_flags import FlagSpec, flags
from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """Accept both ``--snake_case`` (the reference's) and ``--kebab-case`` spellings."""
    spellings = [f"--{name}"]
    if "_" in name:
        spellings.append(f"--{name.replace('_', '-')}")
    parser.add_argument(*spellings, dest=name, **kwargs)


def flag_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "y"):
        return True
    if text.lower() in ("0", "false", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    """The run options a plan reads (``plan`` takes these alone: it would ignore the others)."""
    add_flag(
        parser,
        "work_dir",
        help="checkpoint directory (default: $TOKENIZE_MIXER_WORK_DIR or ~/.cache/tokenize-mixer)",
    )
    add_flag(parser, "slice_rows", type=int, help="most source rows per slice")
    add_flag(
        parser,
        "slice_bytes",
        type=int,
        help="target source bytes per slice when --slice_rows is not given (default: 4-64 MiB by the mixture's size)",
    )


def run_flags(parser: argparse.ArgumentParser) -> None:
    _plan_flags(parser)
    add_flag(parser, "workers", type=int, help="worker processes (default: the CPUs this process may use)")
    add_flag(parser, "runner", choices=["auto", "process", "thread", "dask", "work_pool"], help="task runner")
    add_flag(parser, "slice_deployment", help="runner work_pool: deployment of the tokenize-slices flow")
    add_flag(parser, "batch_slices", type=int, help="runner work_pool: slices per batch flow run")
    add_flag(parser, "dask_address", help="scheduler address of an existing Dask cluster (runner dask)")
    add_flag(
        parser, "reference", help="directory or digests JSON to validate against; a mismatch fails the run"
    )
    add_flag(
        parser,
        "force",
        action="store_true",
        default=None,
        help="make and publish the output even when it is up to date (slices are still reused)",
    )
    add_flag(parser, "force_recache", action="store_true", default=None, help="recompute every slice")
    add_flag(
        parser, "disable_cache", action="store_true", default=None, help="neither read nor write checkpoints"
    )
    add_flag(
        parser,
        "check",
        choices=["report", "strict", "off"],
        help="check the output before publishing it: list its findings (report, the default); refuse to "
        "publish it when one breaks it or changes training (strict: exit 3 or 1, as `tokenize-mixer check` "
        "exits for the same findings; notes for information do not refuse it); or skip (off)",
    )


def setting_flag(parser: argparse.ArgumentParser, spec: FlagSpec) -> None:
    """A flag derived from the setting it sets (:mod:`sftmix.config.command_flags`): left out, the
    setting keeps its default."""
    default = str(spec.default).lower() if spec.boolean else spec.default
    help_text = f"{spec.help} (default {default})".replace("%", "%%")
    if spec.boolean:
        add_flag(
            parser,
            spec.name,
            type=flag_bool,
            nargs="?",
            const=True,
            default=None,
            metavar="true|false",
            help=help_text,
        )
    elif spec.whole_number:
        add_flag(parser, spec.name, type=int, default=None, metavar="N", help=help_text)
    else:
        add_flag(parser, spec.name, choices=spec.choices, default=None, help=help_text)


def run_parser(sub: Subcommands) -> None:
    """``run`` a mixer config."""
    run = sub.add_parser("run", help="run a mixer config (YAML or JSON)")
    run.add_argument("config", help="a mixer config file, YAML or JSON (see examples/mixer.yaml)")
    add_flag(run, "output_dir", help="override the config's output path")
    add_flag(
        run,
        "overwrite",
        action="store_true",
        default=None,
        help="replace an output directory that holds different shards (only ever a tokenize-mixer output)",
    )
    for spec in flags(MixerConfig):  # each overrides the config's setting
        if spec.name != "overwrite":
            setting_flag(run, spec)
    run_flags(run)


def output_parsers(sub: Subcommands) -> None:
    """``plan``, and the commands that read an output: ``compare``, ``digest``, ``inspect``, ``report``."""
    plan = sub.add_parser("plan", help="print the slices of a mixer config without running")
    plan.add_argument("config", help="a mixer config file, YAML or JSON")
    _plan_flags(plan)

    cmp_ = sub.add_parser(
        "compare", help="compare two outputs (directories or digests JSON); exit 1 on mismatch"
    )
    cmp_.add_argument("a", help="an output directory or a digests JSON file")
    cmp_.add_argument("b", help="another output directory or digests JSON file")

    dig = sub.add_parser("digest", help="write the digests of an output directory as JSON")
    dig.add_argument("output", help="an output directory")
    dig.add_argument("-o", "--out", help="file to write (default: stdout)")

    ins = sub.add_parser("inspect", help="decode a written document with its trainable tokens highlighted")
    ins.add_argument("output", help="an output directory")
    ins.add_argument("--doc", type=int, help="document index in output order (default: the first)")
    ins.add_argument(
        "--dataset",
        help="the first document of this dataset (its path, file name, or index in the mixer as the lineage columns give it)",
    )
    ins.add_argument("--row", type=int, help="with or without --dataset: the document of this source row")
    ins.add_argument(
        "--against",
        metavar="OTHER_OUTPUT",
        help="mark where another output of the same text (e.g. made with another mask policy) trains "
        "this document differently: {+trained only here+}, [-trained only there-]",
    )
    ins.add_argument(
        "--plain",
        action="store_true",
        help="no colours: trainable text between ⟦ and ⟧ (the default when the output is not a terminal)",
    )

    rep = sub.add_parser(
        "report", help="write report.png and report.md: lengths, trainable %%, dataset shares"
    )
    rep.add_argument("output", help="an output directory")
    rep.add_argument("-o", "--out", help="directory for the report (default: the output directory)")


def positive_int(text: str) -> int:
    """A whole number above zero (a sequence length): anything else is said by argparse, by its flag."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number above 0, not {text!r}")
    return value


def check_parser(sub: Subcommands) -> None:
    """``check``: will this output train as expected."""
    chk = sub.add_parser(
        "check",
        help="will this output train as expected: integrity, fit, masks; exit 0 when nothing is broken and "
        "nothing changes training (notes for information may remain), 1 when something changes training, 3 "
        "when something is broken",
    )
    chk.add_argument("output", help="an output directory")
    add_flag(
        chk,
        "sequence_length",
        type=positive_int,
        help="the training sequence length: longer documents are found, and OLMo-core's plain and packed "
        "FSL datasets are simulated at it (instances, padding, truncated and unread tokens)",
    )
    add_flag(
        chk,
        "long_doc_strategy",
        choices=["truncate", "fragment"],
        default="truncate",
        help="what OLMo-core's packed dataset does with documents longer than the sequence length "
        "(its long_doc_strategy; default truncate)",
    )
    chk.add_argument("--json", help="also write the findings as JSON to this file")
    add_flag(
        chk,
        "template_diff",
        action="store_true",
        help="print the diff of a chat template that differs from the tokenizer's own (tokenizer's -> used)",
    )


class Subcommands:
    """Subcommands that take no abbreviated flags and take ``-v`` after their name too (its value
    is left alone when not given there)."""

    def __init__(self, action: Any) -> None:
        self.action = action

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser = self.action.add_parser(name, allow_abbrev=False, **kwargs)
        parser.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging"
        )
        return parser


def run_options(args: argparse.Namespace, base: RunOptions | None = None) -> RunOptions:
    data = (base or RunOptions()).model_dump()
    for key in (
        "work_dir",
        "workers",
        "slice_rows",
        "slice_bytes",
        "runner",
        "dask_address",
        "slice_deployment",
        "batch_slices",
        "reference",
        "force",
        "force_recache",
        "disable_cache",
        "check",
    ):
        if getattr(args, key, None) is not None:
            data[key] = getattr(args, key)
    return RunOptions.model_validate(data)
