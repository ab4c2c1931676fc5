#!/usr/bin/env bash
# One-shot worker-scaling benchmark on a lent machine with no network (run from anywhere):
#
#     OUT=/some/dir bash bench/device_scaling.sh        # WORKERS=1,2,4,8,16 by default
#     WORKERS=1,2,4,8,16,16:1048576 bash bench/device_scaling.sh   # N:B = N workers, slice_bytes B
#     BENCH=scale OUT=/some/dir bash bench/device_scaling.sh --copies 1,4   # bench/scale.py instead
#
# PYTHON (python3), SITE (/tmp/site), DATA (.devdata/sharegpt.jsonl.xz), TOKENIZER (.devdata/dolma2)
# can be overridden too.
#
# Needs, next to the working tree, the git-ignored .whl/ (prefect, datasets, pydantic and their
# dependencies for CPython 3.12 manylinux x86_64, minus what the machine has: numpy, pyarrow, pandas,
# tokenizers, transformers, ...) and .devdata/ (bench/make_devdata.py: sharegpt.jsonl.xz, dolma2/).
# Installs the wheels into $SITE (default /tmp/site; nothing else on the machine changes), then runs
# bench/scaling.py. Writes $OUT/log.txt (everything printed) and $OUT/scaling.json. Extra arguments
# go to bench/scaling.py (e.g. --slice-bytes 1048576).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/scaling-out}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
WORKERS=${WORKERS:-1,2,4,8,16}
DATA=${DATA:-.devdata/sharegpt.jsonl.xz}
TOKENIZER=${TOKENIZER:-.devdata/dolma2}
mkdir -p "$OUT"

main() {
    echo "== $(date -u +%FT%TZ) $(uname -srm), $(nproc) CPUs (nproc), repo $PWD"
    echo "== python: $(command -v "$PY") -> $("$PY" -c 'import sys; print(sys.version.split()[0], sys.prefix)')"
    "$PY" -m pip --version || echo "(no pip in $PY)"
    free -g | head -2 || true
    df -h /tmp | tail -1 || true
    echo "== .whl: $(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1); .devdata: $(du -sh .devdata | cut -f1)"

    local t0=$SECONDS
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .whl/*.whl
    else # no pip here: a wheel is a zip; purelib/platlib go to the top, scripts/headers are skipped
        echo "== no pip: unpacking the wheels into $SITE with zipfile"
        "$PY" - "$SITE" .whl/*.whl <<'UNPACK'
import sys, zipfile
from pathlib import Path
site = Path(sys.argv[1])
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if not info.is_dir():
                target = site.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(info))
UNPACK
    fi
    echo "== installed into $SITE in $((SECONDS - t0)) s"
    # --no-compile left no bytecode; with PYTHONDONTWRITEBYTECODE set (as it may be), every process of every
    # run (CLI, temporary API, each worker) would compile prefect & co. from source: ~8 s each, not what a
    # normal install costs. compileall writes the .pyc files whatever that variable says.
    t0=$SECONDS
    "$PY" -m compileall -qq -j 0 "$SITE" sftmix flows tasks bench >/dev/null 2>&1 || true
    echo "== byte-compiled $SITE and the repo's packages in $((SECONDS - t0)) s (PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset})"
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1

    "$PY" - <<'EOF'
import importlib, importlib.metadata as md
mods = ["prefect", "pydantic", "pydantic_core", "datasets", "huggingface_hub", "transformers", "tokenizers",
        "numpy", "pyarrow", "pandas", "fsspec", "sqlalchemy", "psutil", "sftmix", "flows", "tasks"]
for name in mods:
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # report every failure, fail below
        print(f"   {name:16} IMPORT FAILED: {type(exc).__name__}: {exc}")
        continue
    version = getattr(mod, "__version__", None)
    try:
        version = md.version(name.replace("_", "-")) if name not in ("sftmix", "flows", "tasks") else version
    except md.PackageNotFoundError:
        pass
    print(f"   {name:16} {version or '-':14} {getattr(mod, '__file__', None)}")
EOF
    "$PY" -c 'import prefect, datasets, pydantic, sftmix, flows, tasks, transformers, tokenizers, psutil'
    echo "== requirements of the carried packages, as this sys.path sees them (informational)"
    echo "   (apprise is left out of .whl on purpose: prefect imports it only to send notifications)"
    "$PY" tools/check_deps.py prefect datasets pydantic huggingface-hub transformers || true
    "$PY" -m tokenize_mixer.cli --help >/dev/null && echo "== python -m tokenize_mixer.cli: ok"

    if [ "${BENCH:-scaling}" = scale ]; then
        echo "== $(date -u +%T) scale: bench/scale.py $*"
        "$PY" bench/scale.py --data "$DATA" --tokenizer "$TOKENIZER" --out "$OUT/scale.json" --logs "$OUT" "$@"
    else
        echo "== $(date -u +%T) scaling: workers $WORKERS"
        "$PY" bench/scaling.py --data "$DATA" --tokenizer "$TOKENIZER" --workers "$WORKERS" --out "$OUT" \
            --timeout 300 "$@"
    fi
    echo "== $(date -u +%T) done in $SECONDS s"
}

main "$@" 2>&1 | tee "$OUT/log.txt"
