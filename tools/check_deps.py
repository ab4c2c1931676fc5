"""Are the installed requirements of some packages satisfied, as this interpreter's sys.path sees them?

    python tools/check_deps.py prefect datasets pydantic transformers

Walks the non-optional ``Requires-Dist`` closure of the named distributions (markers evaluated for this
interpreter, extras only where a requirement asks for them) and prints every requirement that is missing
or whose installed version is outside its range, with the version found and where it was found. Exit
status 1 when something is missing or out of range (the first copy on sys.path is the one imported).
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

_FIRST: dict[str, md.Distribution] = {}


def first_dist(name: str) -> md.Distribution | None:
    """The copy that ``import`` would find: the first on sys.path."""
    if not _FIRST:
        for dist in md.distributions():  # in sys.path order
            _FIRST.setdefault(canonicalize_name(dist.metadata["Name"] or ""), dist)
    return _FIRST.get(canonicalize_name(name))


def main(roots: list[str]) -> int:
    problems: list[str] = []
    seen: set[tuple[str, frozenset[str]]] = set()
    queue: list[tuple[str, frozenset[str], str]] = [(r, frozenset(), "(asked)") for r in roots]
    while queue:
        name, extras, parent = queue.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        seen.add(key)
        dist = first_dist(name)
        if dist is None:
            problems.append(f"MISSING  {name} (needed by {parent})")
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            found = first_dist(req.name)
            where = f"{dist.metadata['Name']} {dist.version}"
            if found is None:
                problems.append(f"MISSING  {req} (needed by {where})")
                continue
            if req.specifier and not req.specifier.contains(found.version, prereleases=True):
                problems.append(
                    f"VERSION  {req} (needed by {where}): found {found.version} at {found.locate_file('')}"
                )
            queue.append((req.name, frozenset(req.extras), where))
    names = sorted({n for n, _ in seen})
    print(f"checked {len(names)} distributions reachable from {', '.join(roots)}")
    for p in problems:
        print("  " + p)
    if not problems:
        print("  every requirement is installed and in range")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["prefect", "datasets", "pydantic", "transformers"]))
