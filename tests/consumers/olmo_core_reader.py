"""Run inside an environment with ai2-olmo-core (not the project's): read a tokenize-mixer output with
OLMo-core's own dataset configs and print what they yield as JSON on stdout.

    python olmo_core_reader.py OUTPUT_DIR WORK_DIR SEQ_LEN VOCAB_SIZE EOS_ID PAD_ID DTYPE [COUNT_LENGTHS]

COUNT_LENGTHS (comma-separated sequence lengths): also print, at each, the instance counts of the plain
FSL dataset and of the packed one with each long-document strategy and each source of boundaries
(the .csv.gz files, or EOS scanning, OLMo-core's default for local files).
"""

import json
import sys
from pathlib import Path

import numpy as np
from olmo_core.data import (
    LongDocStrategy,
    NumpyFSLDatasetConfig,
    NumpyPackedFSLDatasetConfig,
    TokenizerConfig,
)


def instances(dataset, limit: int = 10_000) -> list[dict]:
    out = []
    for i in range(min(len(dataset), limit)):
        item = dataset[i]
        out.append(
            {
                "input_ids": np.asarray(item["input_ids"]).tolist(),
                "label_mask": np.asarray(item["label_mask"]).astype(int).tolist(),
                "doc_lens": np.asarray(item["doc_lens"]).tolist() if "doc_lens" in item else None,
            }
        )
    return out


def main() -> None:
    output, work, seq_len, vocab, eos, pad, dtype = sys.argv[1:8]
    out = Path(output)
    tokens = sorted(str(p) for p in out.glob("token_ids_part_*.npy"))
    masks = sorted(str(p) for p in out.glob("labels_mask_part_*.npy"))
    tokenizer = TokenizerConfig(vocab_size=int(vocab), eos_token_id=int(eos), pad_token_id=int(pad))
    common = dict(
        paths=tokens, label_mask_paths=masks, tokenizer=tokenizer, dtype=dtype, sequence_length=int(seq_len)
    )
    result = {}
    fsl = NumpyFSLDatasetConfig(**common, work_dir=str(Path(work) / "fsl")).build()
    fsl.prepare()
    result["fsl"] = instances(fsl)
    packed = NumpyPackedFSLDatasetConfig(
        **common, work_dir=str(Path(work) / "packed"), generate_doc_lengths=True, use_array_if_local=False
    ).build()
    packed.prepare()
    result["packed"] = instances(packed)
    by_eos = NumpyPackedFSLDatasetConfig(
        **common, work_dir=str(Path(work) / "by-eos"), generate_doc_lengths=True
    ).build()
    by_eos.prepare()  # (documents found by EOS: OLMo-core's default for local files)
    result["packed_by_eos"] = instances(by_eos)
    result["counts"] = {}
    for length in sys.argv[8].split(",") if len(sys.argv) > 8 else []:
        at = {**common, "sequence_length": int(length)}
        fsl = NumpyFSLDatasetConfig(**at, work_dir=str(Path(work) / f"fsl-{length}")).build()
        result["counts"][f"fsl/{length}"] = len(fsl)
        for strategy in ("truncate", "fragment"):
            for boundaries, use_array in (("csv", False), ("eos", None)):
                name = f"packed/{length}/{strategy}/{boundaries}"
                packed = NumpyPackedFSLDatasetConfig(
                    **at,
                    work_dir=str(Path(work) / name.replace("/", "-")),
                    long_doc_strategy=LongDocStrategy(strategy),
                    use_array_if_local=use_array,
                ).build()
                packed.prepare()
                result["counts"][name] = len(packed)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
