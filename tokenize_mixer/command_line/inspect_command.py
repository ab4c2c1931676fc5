"""``tokenize-mixer inspect``: one written document decoded, its trainable tokens highlighted (or marked,
against another output's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sftmix.errors import ConfigError


def inspect_output_command(args: argparse.Namespace) -> int:
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
