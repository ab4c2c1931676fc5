#!/usr/bin/env bash
# Build .whl/ (git-ignored): wheels for CPython 3.12 manylinux x86_64 of prefect, datasets, pydantic and
# their whole dependency tree, at the versions of .venv (pip freeze), minus what the lent machine
# already has (bench/device_scaling.sh installs them with --target, where they shadow the machine's).
#
#     bash tools/make_wheelhouse.sh          # needs PyPI; writes .whl/ and .whl/README.txt
#
# Two deliberate differences from .venv:
#   huggingface-hub 1.33.0 (not 2.x): the machine's transformers 5.17 needs <2.0, datasets 5.2 >=1.31;
#   prefect's wheel is repacked without prefect/server/ui{,-v2} (4.6 MiB of web UI the temporary API,
#   started with PREFECT_UI_ENABLED=0, never serves).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PIP=${PIP:-.venv/bin/pip}
PY=${PY:-.venv/bin/python}
ALL=$(mktemp -d /tmp/whl-all.XXXXXX)
trap 'rm -rf "$ALL"' EXIT

# the machine has these (and big): not carried
DROP='^(numpy|pyarrow|pandas|torch|transformers|tokenizers|regex|safetensors|hf_xet|pygments|markdown_it_py|mdurl|psutil|requests|urllib3|charset_normalizer|typer|shellingham|pyyaml|xxhash|apprise)-'
# apprise: only imported by prefect to send notifications (not on the machine; not needed here)

"$PIP" freeze --exclude-editable | grep -vE '^(-e|#)' |
    grep -viE '^(huggingface.hub|transformers|tokenizers|numpy)==' >"$ALL/constraints.txt"
printf 'huggingface-hub==1.33.0\ntransformers==5.17.0\ntokenizers==0.23.2\nnumpy==2.5.2\n' >>"$ALL/constraints.txt"

"$PIP" download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux1_x86_64 \
    -c "$ALL/constraints.txt" -d "$ALL" \
    prefect datasets pydantic pydantic-core pyyaml jinja2 rich fsspec psutil numpy transformers tokenizers

rm -rf .whl && mkdir .whl
for w in "$ALL"/*.whl; do
    base=$(basename "$w")
    if ! grep -qiE "$DROP" <<<"$base"; then cp "$w" .whl/; fi
done

# prefect without its web UI bundles (RECORD rewritten)
"$PY" - "$ALL"/prefect-*.whl .whl/ <<'EOF'
import base64, csv, hashlib, io, sys, zipfile
from pathlib import Path
src = Path(sys.argv[1]); dst = Path(sys.argv[2]) / src.name
drop = ("prefect/server/ui/", "prefect/server/ui-v2/")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    rows = []
    for info in zin.infolist():
        if info.filename.startswith(drop) or info.filename == record:
            continue
        data = zin.read(info)
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append((info.filename, f"sha256={digest}", str(len(data))))
    rows.append((record, "", ""))
    buf = io.StringIO(); csv.writer(buf, lineterminator="\n").writerows(rows)
    zout.writestr(record, buf.getvalue())
print(f"{dst.name}: {src.stat().st_size / 2**20:.1f} MiB -> {dst.stat().st_size / 2**20:.1f} MiB (no web UI)")
EOF

dups=$(ls .whl | sed -E 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dups" ] || { echo "more than one version of: $dups" >&2; exit 1; }
{
    echo "Wheels for CPython 3.12 manylinux x86_64, built by tools/make_wheelhouse.sh on $(date -u +%F)."
    echo "Install: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl"
    echo "Left out (the lent machine has them): numpy pyarrow pandas torch transformers tokenizers regex safetensors"
    echo "  hf-xet pygments markdown-it-py mdurl psutil requests urllib3 charset-normalizer typer shellingham pyyaml xxhash;"
    echo "  apprise (prefect's notifications only). huggingface-hub is 1.33.0 (transformers 5.17 needs <2)."
    echo "prefect-*.whl is repacked without prefect/server/ui and ui-v2 (web UI, not served by the temporary API)."
    echo
    ls .whl | grep '\.whl$'
} >.whl/README.txt
echo ".whl: $(ls .whl/*.whl | wc -l) wheels, $(du -cb .whl/*.whl | tail -1 | awk '{printf "%.1f MiB", $1/1048576}')"
