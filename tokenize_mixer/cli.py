"""tokenize-mixer: chat datasets into OLMo-core training shards (convert, run, plan, check, compare, digest, inspect, report).

``convert`` and ``run`` both run the Prefect flow: with no ``PREFECT_API_URL`` it starts Prefect's
ephemeral API (no server needed); with one, the run shows up on that server.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sftmix.config.command_flags import flags, with_flags
from sftmix.config.config import MixerConfig
from sftmix.config.reference_flags import check_flags
from sftmix.config.run_file import load_run_file
from sftmix.errors import CheckFailedError, MixerError, WorkerDiedError
from sftmix.output.report import COMMAND_CLOCK
from sftmix.runtime import settings
from sftmix.runtime.console import configure_command_console
from sftmix.runtime.pipes import guard_std_streams, new_line_if_needed, quiet_after_stop, watch_output_pipes
from sftmix.runtime.stopping import (
    EXIT_API_LOST,
    EXIT_WORKERS_DIED,
    RUN_STOP_NOTE,
    RunStopped,
    exit_now,
    finish,
    first_stop,
    handlers_given_back,
    install_signal_handlers,
    set_stop_note,
)
from sftmix.runtime.watchdog import arm_watchdog
from tokenize_mixer.command_line import flow_run
from tokenize_mixer.command_line.convert_flags import (
    CHECKED_REFERENCE_FLAGS,
    convert_parser,
    mixer_from_convert_args,
)
from tokenize_mixer.command_line.flow_run import run_flow, write_tokenizer_only
from tokenize_mixer.command_line.inspect_command import inspect_output_command
from tokenize_mixer.command_line.subcommands import (
    Subcommands,
    check_parser,
    output_parsers,
    run_options,
    run_parser,
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
    sub = Subcommands(parser.add_subparsers(dest="command", required=True))
    convert_parser(sub)
    run_parser(sub)
    output_parsers(sub)
    check_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenize-mixer")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


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
    """The command's work. In the command (:func:`entry`) a stop ends the process with its one line; a
    caller in its own process (a test, a notebook) gets the exception, and its signal handlers back."""
    if flow_run.one_run_per_process:
        return _main_of_the_command(argv, started)
    with handlers_given_back():
        return _main_of_the_command(argv, started)


def _main_of_the_command(argv: Sequence[str] | None, started: float | None) -> int:
    COMMAND_CLOCK.started = time.time() if started is None else started
    guard_std_streams()
    if flow_run.one_run_per_process:  # (in-process callers keep their own Ctrl-C, except for a run)
        install_signal_handlers()
    try:
        args = build_parser().parse_args(argv)
        _configure_logging(args.verbose)
        if args.command in ("convert", "run"):
            install_signal_handlers()
            set_stop_note(RUN_STOP_NOTE)
            if flow_run.one_run_per_process:
                watch_output_pipes()
                if not args.verbose:
                    quiet_after_stop()
        return _main(args)
    except BaseException as exc:
        # (only the command's own process ends here: an in-process caller's holds its other work)
        stop = _as_stop(exc) if flow_run.one_run_per_process else None
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
                return write_tokenizer_only(mixer)
            return run_flow(mixer, run_options(args))
        if args.command == "run":
            rf = load_run_file(args.config)
            return run_flow(_with_run_flags(rf.mixer, args), run_options(args, rf.run))
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
            return inspect_output_command(args)
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


def entry(started: float | None = None) -> None:
    """The command, one run per process (``main`` returns instead, for callers in this process); the
    ``tokenize-mixer`` script enters through :mod:`tokenize_mixer.command`, which installs the stop handling
    before this module's imports."""
    flow_run.one_run_per_process = True
    arm_watchdog()
    finish(main(started=started))


if __name__ == "__main__":
    entry()
