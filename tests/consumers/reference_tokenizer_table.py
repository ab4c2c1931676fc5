"""Print, as JSON, what transformers' AutoTokenizer chooses a tokenizer class from, as the installed
transformers has it: run in the reference's locked environment (transformers 5.4.0) this is
``sftmix/tokenizing/data/reference_tokenizer_classes.json`` (tests/test_reference_env.py checks it is)."""

from __future__ import annotations

import json
import sys

import transformers
from transformers.models.auto import tokenization_auto as auto


def main() -> None:
    names = {v for v in auto.TOKENIZER_MAPPING_NAMES.values() if v}
    names |= set(getattr(auto, "REGISTERED_FAST_ALIASES", {})) | set(
        getattr(auto, "REGISTERED_TOKENIZER_CLASSES", {})
    )
    names |= {n for n in dir(transformers) if "Tokenizer" in n or n.endswith("Backend")}
    names |= {n + "Fast" for n in set(names) if not n.endswith("Fast")}
    classes = {}
    for name in sorted(names):
        try:
            found = auto.tokenizer_class_from_name(name)
        except Exception:
            found = None
        classes[name] = getattr(found, "__name__", None)
    table = {
        "transformers": transformers.__version__,
        "model_types": dict(sorted(auto.TOKENIZER_MAPPING_NAMES.items())),
        "incorrect_hub_class": sorted(auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS),
        "classes": classes,
    }
    json.dump(table, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
