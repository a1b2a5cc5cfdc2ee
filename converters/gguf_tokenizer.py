"""GGUF tokenizer metadata -> Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) bytes.

Why: a unified checkpoint carries a `tokenizer.json`; a GGUF carries its vocabulary as
`tokenizer.ggml.*` arrays. Qwen-family GGUFs use llama.cpp's `gpt2` model (byte-level BPE) with a
pre-tokenizer named by `tokenizer.ggml.pre`. The `tokenizers` library builds the file.

Layout: `PRE_TOKENIZER_REGEX` (llama.cpp pre name -> split regex), `tokenizer_files(meta, path)`.
Token types follow llama.cpp: 1 normal, 2 unknown, 3 control (special), 4 user-defined, 5 unused,
6 byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from freetoken.errors import UnsupportedModelError

# Qwen3.5's split regex (adds \p{M} to Qwen2's letters); llama.cpp calls it `qwen35`
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZER_REGEX = {"qwen35": _QWEN35, "qwen2": _QWEN2}

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


def tokenizer_files(meta: dict[str, Any], path: str | Path) -> dict[str, bytes]:
    """Build `tokenizer.json`, `tokenizer_config.json` and (if present) `chat_template.jinja`.

    meta: the GGUF key/value metadata as Python values. Raises UnsupportedModelError (naming
    `path`) for tokenizer models or pre-tokenizers other than byte-level BPE with a Qwen regex.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModelError(f"tokenizer.ggml.model {model!r} is not supported (only byte-level BPE 'gpt2')", path)
    pre = meta.get("tokenizer.ggml.pre", "qwen2")
    if pre not in PRE_TOKENIZER_REGEX:
        raise UnsupportedModelError(f"tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(PRE_TOKENIZER_REGEX)})", path)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]

    special = [i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(tokens[i], special=types[i] == TOKEN_CONTROL, normalized=False) for i in special])

    def token_of(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config: dict[str, Any] = {
        "backend": "tokenizers",
        "tokenizer_class": "TokenizersBackend",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "bos_token": token_of("tokenizer.ggml.bos_token_id"),
        "eos_token": token_of("tokenizer.ggml.eos_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
    }
    files = {"tokenizer.json": tok.to_str().encode()}
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        files["chat_template.jinja"] = template.encode()
    files["tokenizer_config.json"] = (json.dumps({k: v for k, v in config.items() if v is not None}, indent=2) + "\n").encode()
    return files


def eos_token_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return () if eos is None else (int(eos),)
