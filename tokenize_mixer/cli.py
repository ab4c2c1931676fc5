"""tokenize-mixer: chat datasets into OLMo-core training shards (convert, run, plan, check, compare, digest, inspect, report).

``convert`` and ``run`` both run the Prefect flow: with no ``PREFECT_API_URL`` it starts Prefect's
ephemeral API (no server needed); with one, the run shows up on that server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sftmix.config.command_flags import FlagSpec, flags, with_flags
from sftmix.config.config import (
    DatasetEntry,
    MixerConfig,
    RunOptions,
    load_run_file,
)
from sftmix.config.reference_flags import NEUTRAL_FLAGS, check_flags, transform_chain
from sftmix.config.selection import parse_amount
from sftmix.errors import CheckFailedError, ConfigError, MixerError, WorkerDiedError
from sftmix.output.report import COMMAND_CLOCK, RunReport
from sftmix.runtime import settings
from sftmix.runtime.console import configure_command_console
from sftmix.runtime.pipes import guard_std_streams, new_line_if_needed, quiet_after_stop, watch_output_pipes
from sftmix.runtime.stopping import (
    EXIT_API_LOST,
    EXIT_CANCELLED,
    EXIT_WORKERS_DIED,
    RUN_STOP_NOTE,
    RunStopped,
    exit_now,
    finish,
    first_stop,
    install_signal_handlers,
    record_stop,
    set_stop_note,
)
from sftmix.runtime.watchdog import arm_watchdog

logger = logging.getLogger("sftmix")

#: Environment setting for convert's --unknown_template (a cluster's profile can make typos errors).
UNKNOWN_TEMPLATE_ENV = settings.UNKNOWN_TEMPLATE.name
#: Reference flags that are not mixer settings: checked by ``reference_flags.check_flags``.
CHECKED_REFERENCE_FLAGS = (*NEUTRAL_FLAGS, "dataset_target_columns", "get_tokenizer_fn", "use_fast")


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """Accept both ``--snake_case`` (the reference's) and ``--kebab-case`` spellings."""
    spellings = [f"--{name}"]
    if "_" in name:
        spellings.append(f"--{name.replace('_', '-')}")
    parser.add_argument(*spellings, dest=name, **kwargs)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "y"):
        return True
    if text.lower() in ("0", "false", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    """The run options a plan reads (``plan`` takes these alone: it would ignore the others)."""
    _flag(
        parser,
        "work_dir",
        help="checkpoint directory (default: $TOKENIZE_MIXER_WORK_DIR or ~/.cache/tokenize-mixer)",
    )
    _flag(parser, "slice_rows", type=int, help="most source rows per slice")
    _flag(
        parser,
        "slice_bytes",
        type=int,
        help="target source bytes per slice when --slice_rows is not given (default: 4-64 MiB by the mixture's size)",
    )


def _run_flags(parser: argparse.ArgumentParser) -> None:
    _plan_flags(parser)
    _flag(parser, "workers", type=int, help="worker processes (default: the CPUs this process may use)")
    _flag(parser, "runner", choices=["auto", "process", "thread", "dask", "work_pool"], help="task runner")
    _flag(parser, "slice_deployment", help="runner work_pool: deployment of the tokenize-slices flow")
    _flag(parser, "batch_slices", type=int, help="runner work_pool: slices per batch flow run")
    _flag(parser, "dask_address", help="scheduler address of an existing Dask cluster (runner dask)")
    _flag(parser, "reference", help="directory or digests JSON to validate against; a mismatch fails the run")
    _flag(
        parser,
        "force",
        action="store_true",
        default=None,
        help="make and publish the output even when it is up to date (slices are still reused)",
    )
    _flag(parser, "force_recache", action="store_true", default=None, help="recompute every slice")
    _flag(
        parser, "disable_cache", action="store_true", default=None, help="neither read nor write checkpoints"
    )
    _flag(
        parser,
        "check",
        choices=["report", "strict", "off"],
        help="check the output before publishing it: list its findings (report, the default); refuse to "
        "publish it when one breaks it or changes training (strict: exit 3 or 1, as `tokenize-mixer check` "
        "exits for the same findings; notes for information do not refuse it); or skip (off)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenize-mixer",
        description=__doc__.splitlines()[0],
        epilog="environment settings (for a machine or a cluster's profile):\n"
        + "\n".join(f"  {s.name}: {s.help}" for s in settings.ALL if s is not settings.CONSOLE),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = _Subcommands(parser.add_subparsers(dest="command", required=True))
    _convert_parser(sub)
    _run_parser(sub)
    _output_parsers(sub)
    _check_parser(sub)
    return parser


def _convert_parser(sub: _Subcommands) -> None:
    """``convert``: the reference converter's flags, and ours beside them."""
    conv = sub.add_parser("convert", help="the reference converter's flags, same bytes out")
    _reference_input_flags(conv)
    _reference_output_flags(conv)
    for name in CHECKED_REFERENCE_FLAGS:
        _flag(conv, name, nargs="*", help=argparse.SUPPRESS)
    _beyond_the_reference(conv)
    _run_flags(conv)


def _reference_input_flags(conv: argparse.ArgumentParser) -> None:
    """The reference's flags for what is read: the datasets, the tokenizer and its chat template."""
    _flag(
        conv, "dataset_mixer_list", nargs="+", required=True, metavar="NAME AMOUNT", help="NAME AMOUNT pairs"
    )
    _flag(
        conv, "dataset_mixer_list_splits", nargs="+", default=["train"], help="one split, or one per dataset"
    )
    _flag(
        conv,
        "tokenizer_name_or_path",
        required=True,
        help="a hub name or a local directory holding tokenizer.json",
    )
    _flag(conv, "tokenizer_revision", help="the hub revision (branch, tag or commit) of the tokenizer")
    _flag(
        conv,
        "chat_template_name",
        help="one of the reference's named chat templates (olmo, tulu, zephyr, ...); none, or a name "
        "tokenize-mixer does not know: the tokenizer's own (see --unknown_template)",
    )
    _flag(
        conv,
        "add_bos",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="start every document with the tokenizer's bos token, where the template does not",
    )


def _reference_output_flags(conv: argparse.ArgumentParser) -> None:
    """The reference's flags for what is written: the length, number and order of the documents, where
    they go, the transforms that make them."""
    _flag(
        conv,
        "max_seq_length",
        type=int,
        help="longest document in tokens: longer chats are truncated, not dropped, as the reference does "
        "(default: no limit)",
    )
    _flag(conv, "num_examples", type=int, default=0, help="keep the first N rows after the shuffle (0: all)")
    _flag(
        conv, "shuffle_seed", type=int, default=42, help="seed of the shuffle of the kept rows (default 42)"
    )
    _flag(conv, "output_dir", required=True, help="where the shards go: a local directory or gs://...")
    _flag(
        conv,
        "dataset_transform_fn",
        nargs="+",
        help="the reference's transform chain: sft_tulu_tokenize_and_truncate_v1 sft_tulu_filter_v1 "
        "(default), sft_tulu_tokenize_and_truncate_v1 alone (keep rows with no trainable token), or "
        "last_turn_tulu_tokenize_and_truncate_v1 [sft_tulu_filter_v1] (train on the final turn only)",
    )
    _flag(
        conv,
        "tokenizer_config_only",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="write only OUTPUT_DIR/tokenizer/ (the tokenizer with the chat template) and stop",
    )


def _beyond_the_reference(conv: argparse.ArgumentParser) -> None:
    """``convert``'s flags that the reference does not have: where it is unsafe, the better way on request."""
    _flag(
        conv,
        "unknown_template",
        choices=["fallback", "error"],
        default=settings.UNKNOWN_TEMPLATE.get(),
        help="a --chat_template_name tokenize-mixer does not know: use the tokenizer's own template with a "
        f"warning, as the reference does (fallback, the default), or refuse the run (error; also "
        f"{UNKNOWN_TEMPLATE_ENV}=error)",
    )
    for spec in flags(MixerConfig):
        _setting_flag(conv, spec)


def _setting_flag(parser: argparse.ArgumentParser, spec: FlagSpec) -> None:
    """A flag derived from the setting it sets (:mod:`sftmix.config.command_flags`): left out, the
    setting keeps its default."""
    default = str(spec.default).lower() if spec.boolean else spec.default
    help_text = f"{spec.help} (default {default})".replace("%", "%%")
    if spec.boolean:
        _flag(
            parser,
            spec.name,
            type=_bool,
            nargs="?",
            const=True,
            default=None,
            metavar="true|false",
            help=help_text,
        )
    elif spec.whole_number:
        _flag(parser, spec.name, type=int, default=None, metavar="N", help=help_text)
    else:
        _flag(parser, spec.name, choices=spec.choices, default=None, help=help_text)


def _run_parser(sub: _Subcommands) -> None:
    """``run`` a mixer config."""
    run = sub.add_parser("run", help="run a mixer config (YAML or JSON)")
    run.add_argument("config", help="a mixer config file, YAML or JSON (see examples/mixer.yaml)")
    _flag(run, "output_dir", help="override the config's output path")
    _flag(
        run,
        "overwrite",
        action="store_true",
        default=None,
        help="replace an output directory that holds different shards (only ever a tokenize-mixer output)",
    )
    for spec in flags(MixerConfig):  # each overrides the config's setting
        if spec.name != "overwrite":
            _setting_flag(run, spec)
    _run_flags(run)


def _output_parsers(sub: _Subcommands) -> None:
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


def _check_parser(sub: _Subcommands) -> None:
    """``check``: will this output train as expected."""
    chk = sub.add_parser(
        "check",
        help="will this output train as expected: integrity, fit, masks; exit 0 when nothing is broken and "
        "nothing changes training (notes for information may remain), 1 when something changes training, 3 "
        "when something is broken",
    )
    chk.add_argument("output", help="an output directory")
    _flag(
        chk,
        "sequence_length",
        type=int,
        help="the training sequence length: longer documents are found, and OLMo-core's plain and packed "
        "FSL datasets are simulated at it (instances, padding, truncated and unread tokens)",
    )
    _flag(
        chk,
        "long_doc_strategy",
        choices=["truncate", "fragment"],
        default="truncate",
        help="what OLMo-core's packed dataset does with documents longer than the sequence length "
        "(its long_doc_strategy; default truncate)",
    )
    chk.add_argument("--json", help="also write the findings as JSON to this file")
    _flag(
        chk,
        "template_diff",
        action="store_true",
        help="print the diff of a chat template that differs from the tokenizer's own (tokenizer's -> used)",
    )


class _Subcommands:
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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenize-mixer")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


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


@contextlib.contextmanager
def _progress_bar() -> Iterator[None]:
    """The command's progress: a live bar on a terminal (slices, share of the input, the recent rate,
    time left), elsewhere a summary line every few seconds (``flows.progress``); both count the head
    start's slices as they finish, before the flow run exists."""
    # (plain generators, delegated to: their try/finally runs as if written here)
    if not sys.stderr.isatty():
        yield from _progress_lines()
        return
    yield from _live_bar()


def _progress_lines() -> Iterator[None]:
    """A summary line every few seconds while it runs, and the last slice's line at once."""
    from tokenize_mixer.flows.progress import BOARD, line_seconds

    stop, wake = threading.Event(), threading.Event()

    def complete(facts: Any) -> None:  # the last slice's line at once, not at the next tick
        if facts.done >= facts.total:
            wake.set()

    def lines() -> None:
        said_complete = False
        while not stop.is_set():
            wake.wait(line_seconds())
            wake.clear()
            if BOARD.active and not said_complete and not stop.is_set():
                facts = BOARD.facts()
                logging.getLogger("tokenize_mixer.progress").info(facts.line())
                said_complete = facts.done >= facts.total

    BOARD.add_listener(complete)
    ticker = threading.Thread(target=lines, name="progress-lines", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        BOARD.remove_listener(complete)
        stop.set()
        wake.set()


def _live_bar() -> Iterator[None]:
    """A live bar on the terminal while it runs; log lines are written above it."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TaskProgressColumn
    from rich.text import Text

    from tokenize_mixer.flows.progress import BOARD

    class Facts(ProgressColumn):  # read at every refresh: the rate and the time left move between slices
        def render(self, task: Any) -> Text:
            if not BOARD.active:
                return Text("planning, starting the Prefect API")
            facts = BOARD.facts()
            return Text(facts.short())

    bar = Progress(
        SpinnerColumn(),
        BarColumn(),
        TaskProgressColumn(),
        Facts(),
        console=Console(stderr=True),
        refresh_per_second=4,
    )
    task_id = bar.add_task("slices", total=1.0)

    def update(facts: Any) -> None:
        bar.update(task_id, completed=facts.fraction)

    BOARD.add_listener(update)
    stderr = sys.stderr
    try:
        with bar, _log_handlers_writing_to(stderr, sys.stderr):  # (the bar's stderr: lines above it)
            yield
    finally:
        BOARD.remove_listener(update)


@contextlib.contextmanager
def _log_handlers_writing_to(stream: Any, instead: Any) -> Iterator[None]:
    """Every log handler that writes to ``stream`` writes to ``instead`` meanwhile. A live bar's console
    puts what is written to its stderr above the bar; a handler holding the stream it was made with
    (ours, Prefect's) would write over the bar, its line glued to the bar's text."""
    loggers = [logging.getLogger()] + [
        each for each in logging.Logger.manager.loggerDict.values() if isinstance(each, logging.Logger)
    ]
    moved = [
        handler
        for logger in loggers
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler) and handler.stream is stream
    ]
    if instead is stream:  # (no terminal: nothing to move)
        moved = []
    for handler in moved:
        handler.setStream(instead)
    try:
        yield
    finally:
        for handler in moved:
            handler.setStream(stream)


def _write_tokenizer_only(mixer: MixerConfig) -> int:
    """--tokenizer_config_only: OUTPUT_DIR/tokenizer/ (the tokenizer with the chat template the run would
    use) and nothing else, as the reference writes it; an existing tokenizer/ is never replaced."""
    from sftmix.planning.plan import resolve_tokenizer
    from sftmix.runtime.storage import is_remote, writer_tag
    from sftmix.tokenizing.tokenizer_facts import write_tokenizer_dir

    if is_remote(mixer.output.path):
        raise ConfigError("--tokenizer_config_only writes to a local --output_dir only")
    target = Path(mixer.output.path) / "tokenizer"
    if target.exists():
        raise ConfigError(f"{target} already exists; remove it or choose another --output_dir")
    key, _, template = resolve_tokenizer(mixer.tokenizer)
    staging = target.with_name(f".tokenizer.tmp-{writer_tag()}")
    write_tokenizer_dir(key, template.text, staging)
    staging.rename(target)
    logger.info(
        "wrote %s (chat template %s); no data was converted (--tokenizer_config_only)",
        target,
        template.source,
    )
    return 0


def _run_flow(mixer: MixerConfig, run: RunOptions) -> int:
    from sftmix.assembly.up_to_date import UpToDate, may_be_up_to_date, up_to_date
    from tokenize_mixer.flows.api.runtime import prefect_api, remove_abandoned_private_dirs

    remove_abandoned_private_dirs()  # (a command killed outright could not remove its own)
    _check_before_any_api(mixer, run)
    if (done := up_to_date(mixer, run)) is not None:  # no API, no plan: the inputs' stamps say so
        return _say_up_to_date(done)

    from tokenize_mixer.flows.workers.head_start import head_start_scope
    from tokenize_mixer.tasks.plan import hand_to_flow

    planning = _Planning(mixer, run)
    if _one_run_per_process:
        from tokenize_mixer.flows.workers.worker_start import fork_workers_from_server, start_worker_server

        fork_workers_from_server()
        start_worker_server(mixer, run)
    try:
        # An output that only the plan can find up to date: planned before any API is launched.
        first = planning.plan_and_check if may_be_up_to_date(mixer, run) else None
        api = prefect_api(planning.prepare, launch_first=_one_run_per_process, before_launch=first)
        with head_start_scope(), api, _progress_bar():
            # Imported here, not above: with a temporary API server, the import overlaps its start-up.
            from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

            state = tokenize_mixer(mixer=mixer, run=run, return_state=True)
    except UpToDate as found:
        return _say_up_to_date(found.report)
    finally:
        hand_to_flow(mixer, run, None)
    return _say_flow_run_end(state)


def _check_before_any_api(mixer: MixerConfig, run: RunOptions) -> None:
    """The flow checks these again; here they fail fast, before a Prefect API starts."""
    from sftmix.output.output_dir import check_output_free, paths_to_protect, refuse_different_settings
    from sftmix.planning.plan import check_inputs
    from sftmix.planning.recipe import mixer_recipe
    from sftmix.planning.roots import check_allowed_roots
    from sftmix.tokenizing.slices import SLICE_FORMAT_VERSION

    check_allowed_roots(mixer, run)
    check_output_free(mixer.output.path, paths_to_protect(mixer, run))
    check_inputs(mixer, run)
    refuse_different_settings(
        mixer.output.path, mixer.output.overwrite, mixer_recipe(mixer), SLICE_FORMAT_VERSION
    )


class _Planning:
    """The plan of a run, made once: before any API where only the plan can find the output up to
    date, else while the API starts (:func:`prefect_api`'s ``before_launch`` and ``prepare``)."""

    def __init__(self, mixer: MixerConfig, run: RunOptions) -> None:
        self.mixer, self.run = mixer, run
        self.planned: list[Any] = []

    def plan_and_check(self, early: Any = None) -> None:
        """The plan, whose user errors end the command before a flow run exists, and whether it finds
        the output up to date (then no flow run either). ``early``: what the slices of a large file
        are handed while the plan still reads it."""
        from sftmix.assembly.up_to_date import UpToDate, remember_inputs, up_to_date
        from sftmix.planning.plan import prepare_plan
        from tokenize_mixer.flows.workers.head_start import plan_ahead
        from tokenize_mixer.tasks.plan import hand_to_flow

        mixer, run = self.mixer, self.run
        prepare_plan(mixer, run)
        plan = plan_ahead(mixer, run, early)
        if plan is not None and (done := up_to_date(mixer, run, plan.recipe())) is not None:
            remember_inputs(mixer.output.path, plan.recipe(), plan.inputs)
            raise UpToDate(done)  # no API (or it stops); no flow run
        self.planned.append(plan)
        hand_to_flow(mixer, run, plan)

    def prepare(self) -> None:
        """While the API starts: the plan (unless made before), then the head start where it applies:
        tokenizing begins while the API is still starting."""
        from tokenize_mixer.flows.workers.head_start import begin_head_start, early_start

        if not self.planned:
            self.plan_and_check(early_start(self.run))
        if self.planned[0] is not None:
            begin_head_start(self.mixer, self.run, self.planned[0])


def _say_flow_run_end(state: Any) -> int:
    """The flow run's end: a cancel through the API stops the command, a failure is raised, and a
    finished run's report is printed."""
    if state.is_cancelled() or state.is_cancelling():
        raise record_stop(RunStopped("cancelled through the Prefect API", EXIT_CANCELLED))
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise result
    report = RunReport.model_validate(result)
    sys.stdout.write(report.render() + "\n")
    return 0


def _say_up_to_date(report: RunReport) -> int:
    """The command's end when the output already holds its shards: its report, said again."""
    report.wall_seconds = report.plan_seconds = round(time.time() - (COMMAND_CLOCK.started or time.time()), 3)
    report.command_seconds = report.wall_seconds
    sys.stdout.write(report.render() + "\n")
    return 0


def _configure_logging(verbose: bool) -> None:
    configure_command_console(verbose)
    # (websockets' DEBUG lines are frames and headers: noise, and secrets were it not for sftmix.runtime.redaction)
    for name in (
        "httpx",
        "httpcore",
        "httpx2",  # (huggingface_hub's own copies of them: a line per hub request otherwise)
        "httpcore2",
        "websockets",
        "datasets",
        "filelock",
        "urllib3",
        "fsspec",
        "gcsfs",
        "google",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)


def _inspect(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text
    from tokenizers import Tokenizer

    from sftmix.check.inspect_output import find_document, load_document, segments

    index = args.doc
    if index is None:
        index = (
            find_document(args.output, args.dataset, args.row) if args.dataset or args.row is not None else 0
        )
    doc = load_document(args.output, index)
    tokenizer_file = Path(args.output) / "tokenizer" / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(f"{tokenizer_file} is missing: cannot decode")
    tok = Tokenizer.from_file(str(tokenizer_file))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    source = f"dataset {doc.dataset!r}, row {doc.row}" if doc.dataset is not None else "source unknown"
    header = (
        f"document {doc.index} (part {doc.part}, tokens {doc.start}-{doc.start + doc.tokens.shape[0]}): "
        f"{source}; {doc.tokens.shape[0]} tokens, {int(doc.mask.sum())} trainable"
    )
    if args.against:
        from sftmix.check.inspect_output import (
            BOTH,
            ONLY_HERE,
            ONLY_THERE,
            PLAIN_MARKERS,
            against,
            mask_diff_segments,
        )

        other = against(doc, args.against)
        runs = mask_diff_segments(doc, other, decode)
        header += f"; {int(other.mask.sum())} trainable in {args.against} (its document {other.index})"
        styles = {BOTH: "bold green", ONLY_HERE: "bold cyan", ONLY_THERE: "red strike"}
        legend = (
            "[bold green]trainable in both[/] [bold cyan]only here[/] [red strike]only in the other[/] "
            "[dim]in neither[/]"
        )
    else:
        runs = [(t, 1 if trainable else 0) for t, trainable in segments(doc, decode)]
        styles = {1: "bold green"}
        legend = "[bold green]trainable[/] [dim]not trained on[/]"
    if args.plain or not sys.stdout.isatty():  # a file or a pager gets the markers, not lost colours
        if args.against:
            body = "".join(PLAIN_MARKERS[state][0] + t + PLAIN_MARKERS[state][1] for t, state in runs)
        else:
            body = "".join(f"⟦{t}⟧" if state else t for t, state in runs)
        sys.stdout.write(f"{header}\n{body}\n")
        return 0
    console = Console(highlight=False)
    console.print(header, style="bold")
    text = Text()
    for t, state in runs:
        text.append(t, style=styles.get(state, "dim"))
    console.print(text)
    console.print(legend)
    return 0


def _as_stop(exc: BaseException) -> RunStopped | None:
    """The reason a run was stopped, whatever form the stop reached us in (ours, a KeyboardInterrupt
    from Python or a closed pipe, Prefect's TerminationSignal for SIGTERM inside a flow)."""
    if first_stop() is not None:
        return first_stop()
    if isinstance(exc, RunStopped):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return RunStopped("stopped by SIGINT", 128 + signal.SIGINT)
    if type(exc).__name__ == "TerminationSignal":  # prefect.exceptions, raised for SIGTERM in a flow
        signum = getattr(exc, "signal", signal.SIGTERM)
        return RunStopped(f"stopped by {signal.Signals(signum).name}", 128 + signum)
    import httpx  # Prefect's client

    cause: BaseException | None = exc
    while cause is not None:  # the flow engine itself failed to reach the API: it is gone
        if isinstance(cause, httpx.TransportError):
            return RunStopped(
                f"stopped: the Prefect API stopped answering ({type(cause).__name__}: {cause})", EXIT_API_LOST
            )
        cause = cause.__cause__ or cause.__context__
    return None


def main(argv: Sequence[str] | None = None, started: float | None = None) -> int:
    COMMAND_CLOCK.started = time.time() if started is None else started
    guard_std_streams()
    if _one_run_per_process:  # (in-process callers keep their own Ctrl-C, except for a run)
        install_signal_handlers()
    try:
        args = build_parser().parse_args(argv)
        _configure_logging(args.verbose)
        if args.command in ("convert", "run"):
            install_signal_handlers()
            set_stop_note(RUN_STOP_NOTE)
            if _one_run_per_process:
                watch_output_pipes()
                if not args.verbose:
                    quiet_after_stop()
        return _main(args)
    except BaseException as exc:
        stop = _as_stop(exc)
        if stop is None:
            raise
        exit_now(stop)
        raise  # not reached: exit_now ends the process


def _with_run_flags(mixer: MixerConfig, args: argparse.Namespace) -> MixerConfig:
    """The config's mixer with what ``run``'s flags override: ``--output_dir`` and each setting's flag."""
    if args.output_dir:
        mixer = mixer.model_copy(update={"output": mixer.output.model_copy(update={"path": args.output_dir})})
    given = {spec.name for spec in flags(MixerConfig) if getattr(args, spec.name, None) is not None}
    if not given:
        return mixer
    return MixerConfig.model_validate(with_flags(mixer.model_dump(mode="json"), vars(args), MixerConfig))


def _main(args: argparse.Namespace) -> int:
    try:
        if args.command == "convert":
            check_flags({name: getattr(args, name) for name in CHECKED_REFERENCE_FLAGS})
            mixer = mixer_from_convert_args(args)
            if args.tokenizer_config_only:
                return _write_tokenizer_only(mixer)
            return _run_flow(mixer, run_options(args))
        if args.command == "run":
            rf = load_run_file(args.config)
            return _run_flow(_with_run_flags(rf.mixer, args), run_options(args, rf.run))
        if args.command == "plan":
            from sftmix.planning.plan import build_plan

            rf = load_run_file(args.config)
            sys.stdout.write(build_plan(rf.mixer, run_options(args, rf.run)).summary() + "\n")
            return 0
        if args.command == "compare":
            from sftmix.output.digest import compare

            result = compare(args.a, args.b)
            sys.stdout.write(result.render() + "\n")
            return 0 if result.matches else 1
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "check":
            from sftmix.check.findings import check_output

            report = check_output(args.output, args.sequence_length, long_doc_strategy=args.long_doc_strategy)
            sys.stdout.write(report.render(template_diff=args.template_diff) + "\n")
            if args.json:
                Path(args.json).write_text(report.to_json(), encoding="utf-8")
            return report.exit_code
        if args.command == "report":
            from sftmix.check.report_page import write_report

            png, md = write_report(args.output, args.out)
            sys.stdout.write(f"wrote {png} and {md}\n")
            return 0
        if args.command == "digest":
            from sftmix.output.digest import digests_json

            text = digests_json(args.output)
            if args.out:
                with open(args.out, "w", encoding="utf-8") as fh:
                    fh.write(text)
                files = len(json.loads(text).get("files", {}))
                sys.stdout.write(f"wrote the digests of {args.output} ({files} files) to {args.out}\n")
            else:
                sys.stdout.write(text)
            return 0
    except MixerError as exc:
        sys.stderr.write(f"{new_line_if_needed()}error: {exc}\n")
        if isinstance(exc.__cause__, WorkerDiedError):
            return EXIT_WORKERS_DIED
        return exc.exit_code if isinstance(exc, CheckFailedError) else 2
    return 2


_one_run_per_process = False  # set by entry: this process ends with the run


def entry(started: float | None = None) -> None:
    """The command, one run per process (``main`` returns instead, for callers in this process); the
    ``tokenize-mixer`` script enters through :mod:`tokenize_mixer.command`, which installs the stop handling
    before this module's imports."""
    global _one_run_per_process
    _one_run_per_process = True
    arm_watchdog()
    finish(main(started=started))


if __name__ == "__main__":
    entry()
