"""Write the bundled demo datasets (our own, licence-clean conversations). Deterministic; output committed.

python examples/generate_demo_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent / "data"


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def arithmetic(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        messages = [msg("user", f"What is {a} + {b}?"), msg("assistant", f"{a} + {b} = {a + b}.")]
        if i % 3 == 0:
            messages += [msg("user", "And if you multiply them?"), msg("assistant", f"{a} × {b} = {a * b}.")]
        if i % 7 == 0:
            messages += [
                msg("user", "Is the sum even?"),
                msg("assistant", "Yes." if (a + b) % 2 == 0 else "No, it is odd."),
            ]
        rows.append({"id": f"arith-{i}", "messages": messages})
    return rows


def conversions(rng: random.Random, n: int) -> list[dict]:
    units = [
        ("kilometres", "miles", 0.621371),
        ("kilograms", "pounds", 2.20462),
        ("litres", "US gallons", 0.264172),
        ("metres", "feet", 3.28084),
    ]
    rows = []
    for i in range(n):
        src, dst, factor = units[i % len(units)]
        value = rng.randint(1, 500)
        system = [msg("system", "You convert units precisely and show the factor you used.")] if i % 2 else []
        rows.append(
            {
                "id": f"conv-{i}",
                "messages": system
                + [
                    msg("user", f"Convert {value} {src} to {dst}."),
                    msg(
                        "assistant",
                        f"{value} {src} is about {value * factor:.2f} {dst} (1 {src[:-1]} = {factor} {dst}).",
                    ),
                ],
            }
        )
    return rows


def special_tokens() -> list[str]:
    """The demo tokenizer's special tokens (its role markers among them)."""
    spec = json.loads((Path(__file__).parent / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8"))
    return [t["content"] for t in spec["added_tokens"] if t.get("special")]


def general() -> list[dict]:
    """The golden chats, less those that quote a special token: the golden tests keep them (a marker in
    a message is a case to get right), but in the showcase one teaches the model to emit a role marker
    mid-answer, which ``tokenize-mixer check`` rightly reports."""
    special = special_tokens()
    rows = []
    for name in ("chat_single.jsonl", "chat_multi.jsonl"):
        src = Path(__file__).parent.parent / "tests" / "golden" / "data" / name
        rows += [json.loads(line) for line in src.read_text(encoding="utf-8").splitlines()]
    return [r for r in rows if not any(s in json.dumps(r, ensure_ascii=False) for s in special)]


def write(name: str, rows: list[dict]) -> None:
    with open(HERE / name, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    rng = random.Random(2026)
    HERE.mkdir(exist_ok=True)
    write("arithmetic.jsonl", arithmetic(rng, 240))
    write("conversions.jsonl", conversions(rng, 120))
    write("general.jsonl", general())
