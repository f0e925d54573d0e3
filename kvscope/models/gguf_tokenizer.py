"""The tokenizer a GGUF file describes, built as a `tokenizers.Tokenizer`.

A GGUF file has no `tokenizer.json`: llama.cpp's converter stores the vocabulary
(`tokenizer.ggml.tokens`, with each token's `token_type` and `scores`), the BPE
`merges`, the special token ids and whether to add BOS/EOS as metadata, and names the
kind of tokenizer in `tokenizer.ggml.model`:

* `gpt2`: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM). `tokenizer.ggml.pre` names
  how text is split into words before the merges; the splits here are the regexes
  llama.cpp applies for that name (`llm_tokenizer_bpe` in llama-vocab.cpp), one after
  the other, and a name it does not know is refused, as llama.cpp refuses it.
* `llama`: SentencePiece BPE with byte fallback (Llama 2, Mistral); the merges, when
  the file has none, are recovered from the scores as transformers' GGUF converter
  does.

Control (and unknown) tokens become special added tokens, so `<|im_start|>` in text is
one token and decoding skips it; user-defined tokens are added whole but not special.
`gguf_tokenizer` returns an `HFTokenizer` whose config names the special tokens as a
`tokenizer_config.json` would, so chat templates see `bos_token` and `eos_token`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import ModelLoadError
from .tokenizer import HFTokenizer

__all__ = ["PRE_TOKENIZER_SPLITS", "TOKENIZER_KINDS", "gguf_tokenizer"]

# llama.cpp's token types (llama_token_type).
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _names(names: str, splits: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return dict.fromkeys(names.split(), splits)


#: The regexes llama.cpp splits text with, in order, by `tokenizer.ggml.pre`.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # A file without the key gets llama.cpp's default (with its warning that quality
    # suffers): punctuation runs, then GPT-2's words, then runs of digits.
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **_names(
        "gpt-2 phi-2 mpt olmo jais jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 "
        "mellum modern-bert exaone4 trillion granite-docling",
        (_GPT2,),
    ),
    **_names("smollm starcoder refact command-r codeshell exaone minerva-7b", (r"\p{N}", _GPT2)),
    **_names(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano "
        "dbrx smaug-bpe",
        (_LLAMA3,),
    ),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan", (_QWEN2,)),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", (_GPT4O,)),
}
#: The splits whose whole word is looked up before any merge (llama.cpp's
#: `ignore_merges`, tokenizers' `BPE(ignore_merges=True)`), and which add BOS unless
#: the file says otherwise.
LLAMA3_NAMES = frozenset(k for k, v in PRE_TOKENIZER_SPLITS.items() if v == (_LLAMA3,))

#: `tokenizer.ggml.model` values served: byte-level BPE and SentencePiece BPE.
TOKENIZER_KINDS = ("gpt2", "llama")


def gguf_tokenizer(metadata: Mapping[str, Any], *, eos_token_ids: tuple[int, ...]) -> HFTokenizer:
    """The tokenizer of a GGUF file's `metadata` (its key-value pairs)."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind not in TOKENIZER_KINDS:
        raise ModelLoadError(
            f"GGUF tokenizer {kind!r} (tokenizer.ggml.model) is not supported; "
            f"supported: {', '.join(TOKENIZER_KINDS)}"
        )
    if not tokens:
        raise ModelLoadError("the GGUF file has no vocabulary (tokenizer.ggml.tokens)")
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        tokenizer, add_bos = _byte_level(metadata, tokens)
    else:
        tokenizer, add_bos = _sentencepiece(metadata, tokens), True
    _add_special_tokens(tokenizer, tokens, types)
    config = _special_token_config(metadata, tokens)
    config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    _add_bos_eos(tokenizer, config)
    return HFTokenizer.from_tokenizer(tokenizer, config, eos_token_ids=eos_token_ids)


def _merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for merge in metadata.get("tokenizer.ggml.merges") or []:
        left, space, right = merge.partition(" ")
        if not space:
            raise ModelLoadError(f"GGUF merge {merge!r} is not two tokens")
        merges.append((left, right))
    return merges


def _byte_level(metadata: Mapping[str, Any], tokens: list[str]) -> tuple[Any, bool]:
    """Byte-level BPE split as `tokenizer.ggml.pre` says; whether it adds BOS by default."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = metadata.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
            f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    model = models.BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=_merges(metadata),
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        ignore_merges=pre in LLAMA3_NAMES,
    )
    tokenizer = Tokenizer(model)
    splits = [
        pre_tokenizers.Split(Regex(split), behavior="isolated")
        for split in PRE_TOKENIZER_SPLITS[pre]
    ]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, pre in LLAMA3_NAMES


def _sentencepiece(metadata: Mapping[str, Any], tokens: list[str]) -> Any:
    """SentencePiece BPE: `▁` for spaces, unknown bytes as `<0xNN>` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _merges(metadata) or _merges_from_scores(vocab, metadata)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=tokens[unk] if unk is not None and unk < len(tokens) else None,
        )
    )
    prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(
    vocab: dict[str, int], metadata: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scored merged token first (ties:
    the longer left piece, then the longer right one), as transformers'
    `generate_merges` orders them."""
    scores = metadata.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(vocab):
        raise ModelLoadError("the GGUF SentencePiece vocabulary has neither merges nor scores")
    ranked: list[tuple[str, str, float]] = []
    for token, score in zip(vocab, scores, strict=True):
        pairs = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((left, right, score) for left, right in pairs)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_special_tokens(tokenizer: Any, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens as special tokens, user-defined ones as whole added
    tokens: each matched in text before the split, never cut into pieces."""
    from tokenizers import AddedToken

    special = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types, strict=False)
        if kind in (CONTROL, UNKNOWN)
    ]
    added = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(added)


_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _special_token_config(metadata: Mapping[str, Any], tokens: list[str]) -> dict[str, Any]:
    """The named special tokens as `tokenizer_config.json` spells them, and the
    chat template."""
    config: dict[str, Any] = {}
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(key)
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise ModelLoadError(f"GGUF {key} {token_id} is outside the vocabulary")
        config[name] = tokens[token_id]
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def _add_bos_eos(tokenizer: Any, config: dict[str, Any]) -> None:
    """BOS before (and EOS after) a sequence encoded with special tokens, as the file asks."""
    from tokenizers import processors

    bos = config.get("bos_token") if config["add_bos_token"] else None
    eos = config.get("eos_token") if config["add_eos_token"] else None
    if bos is None and eos is None:
        return
    ends = [token for token in (bos, eos) if token is not None]
    single = " ".join([*([bos] if bos else []), "$A", *([eos] if eos else [])])
    pair = " ".join([single, *([bos] if bos else []), "$B:1", *([eos] if eos else [])])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in dict.fromkeys(ends)],
    )
