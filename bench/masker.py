"""The masker alone (render, encode, spans, checks) on ShareGPT chats, one core, as a slice makes it.

    python bench/masker.py --template olmo --rows 6000 --repeats 3

No I/O, no Prefect: what issue 41 item 1 calls the per-turn work, with the slice's own settings (the
worker's encoding and fast encoder, drop_untrainable on, the skeleton store in a scratch directory).
Prints each repeat's seconds, then the best parts on the same rows (a plain Jinja environment's render and
the encoder's, each the best of as many repeats; our renderer's alone beside them) and ours over them. To compare two trees of the code side by side, run it from each under
``farm-bench`` with ``PYTHONPATH`` set to that tree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: another tree of the code can be timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", default="olmo")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "tests" / "golden" / "tokenizers" / "dolma2")
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seq-length", type=int, default=4096)
    args = ap.parse_args()

    import jinja2
    import jinja2.ext

    from bench.data import sharegpt_chats
    from sftmix.sources.formats import Conversation
    from sftmix.tokenizing.masking import Masking
    from sftmix.tokenizing.slices import WorkerTemplate, cached_masker, worker_encoding
    from sftmix.tokenizing.templates import named_template

    encoding = worker_encoding(str(args.tokenizer), None, None, "fast")
    skeletons = tempfile.mkdtemp(prefix="tm-bench-skeletons-")
    masking = Masking(args.max_seq_length, "assistant", "reference", drop_untrainable=True)
    masker = cached_masker(encoding, WorkerTemplate(text=named_template(args.template)), masking, skeletons)
    convs = [Conversation(c, None) for c in sharegpt_chats(args.rows)]
    masker.tokenize(convs[:256])  # the shapes' skeletons, made once
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for k in range(0, len(convs), 256):  # the slice's batch size
            masker.tokenize(convs[k : k + 256])
        times.append(time.perf_counter() - started)
        print(f"ours {times[-1]:.3f} s")
    # The best parts (FACTS.md): a plain Jinja environment with transformers' options, and the encoder.
    plain = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    template = plain.from_string(named_template(args.template))
    tokens = masker.renderer._special_tokens
    renders, ours_renders, encodes = [], [], []
    for _ in range(args.repeats):  # the parts at their best too, as ours: one pass of each swings 2x here
        started = time.perf_counter()
        texts = [
            template.render(
                messages=c.messages, tools=None, documents=None, add_generation_prompt=False, **tokens
            )
            for c in convs
        ]
        renders.append(time.perf_counter() - started)
        started = time.perf_counter()
        ours_text = [masker.renderer.render(c.messages, None, False) for c in convs]
        ours_renders.append(time.perf_counter() - started)
        assert ours_text == texts
        started = time.perf_counter()
        encoding.encode_batch(texts)
        encodes.append(time.perf_counter() - started)
    render, encode = min(renders), min(encodes)
    best = min(times)
    print(
        f"{len(convs)} chats, {args.template}: ours best {best:.3f} s, median {statistics.median(times):.3f} s; "
        f"plain Jinja render {render:.3f} s + encode {encode:.3f} s = {render + encode:.3f} s "
        f"(our render alone {min(ours_renders):.3f} s); ours / (render + encode) = {best / (render + encode):.2f}x"
    )


if __name__ == "__main__":
    main()
