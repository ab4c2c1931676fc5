#!/bin/bash
# One cold convert of a mixture of several JSON Lines files (each amount 1.0), dolma2, olmo, 4096, with
# TREE's sftmix (PYTHONPATH), printing the wall, the slices made and a digest of the token files: two
# trees side by side show what the slicing rule costs (session 37: the slices sized by the mixture).
#   bash bench/mixture.sh /work/main old /tmp/split4/part-0{0,1,2,3}.jsonl
# (ShareGPT x40 split by lines in 4: split -n l/4 -d --additional-suffix=.jsonl chats-40.jsonl part-)
set -u
TREE=$1; LABEL=$2; shift 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TOK=$(cd "$ROOT" && .venv/bin/python -c "import sys; sys.path.insert(0, '.'); from bench.data import dolma2_dir; print(dolma2_dir())")
MIX=(); for f in "$@"; do MIX+=("$f" 1.0); done
S=$(mktemp -d)
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
start=$(date +%s.%N)
PYTHONPATH=$TREE "$ROOT/.venv/bin/tokenize-mixer" convert --dataset_mixer_list "${MIX[@]}" \
  --tokenizer_name_or_path "$TOK" --chat_template_name olmo --max_seq_length 4096 \
  --work_dir "$S/work" --output_dir "$S/out" > "$S/stdout" 2> "$S/stderr"
rc=$?
end=$(date +%s.%N)
echo "$LABEL rc=$rc wall=$(echo "$end - $start" | bc) slices=$(ls -d "$S"/work/slices/*/* 2>/dev/null | wc -l)" \
  "tokens_sha=$(cat "$S"/out/token_ids_part_*.npy | sha256sum | cut -c1-16)"
grep "tokenizing done" "$S/stderr" | tail -1
rm -rf "$S"
