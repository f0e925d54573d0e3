"""The tokenizer a GGUF file describes (`models/gguf_tokenizer.py`), against the one
`transformers` builds from the same file (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), on small vocabularies written by the test: SentencePiece BPE with
merges recovered from the scores and bytes falling back to `<0xNN>` tokens, and
byte-level BPE with control and user-defined tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFWriter

from kvscope.models.errors import ModelLoadError
from kvscope.models.gguf_tokenizer import gguf_tokenizer

transformers = pytest.importorskip("transformers")

PIECES = [
    "▁", "e", "h", "l", "o", "t", "i", "n", "w", "r", "d", "a", "s",
    "he", "ll", "in", "▁t", "▁the", "▁h", "▁he", "llo", "▁hello", "▁in", "or", "▁w", "▁wor",
    "ld", "▁world", "er", "▁a", "an", "▁an", "nd", "▁and", "is", "▁is",
]  # fmt: skip
TEXTS = [
    "hello the world",
    " leading space and  two spaces",
    "in the inn is an end",
    "bytes ü → 日本 fall back",
    "<s>inside</s> and <tool> kept whole",
    "\n\ttabs\nand lines\n",
]


def sentencepiece_metadata(add_space_prefix: bool = True) -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>", "<tool>"]
    types = [2, 3, 3, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += PIECES
    types += [1] * len(PIECES)
    # Longer pieces merge later: a score a token, falling with its position.
    scores = [0.0] * (4 + 256) + [-float(i) for i in range(len(PIECES))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def byte_level_metadata() -> dict[str, Any]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = sorted(set(bytes_to_unicode().values()))
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ in", "l l", "he ll", "hell o", "Ġ w", "o r"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", *alphabet, *merged]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 4] + [1] * (len(tokens) - 4),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }


def write_tokenizer_file(path: Path, metadata: dict[str, Any]) -> Path:
    writer = GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_tokenizer(tmp_path: Path, metadata: dict[str, Any]) -> Any:
    path = write_tokenizer_file(tmp_path / "tokenizer.gguf", metadata)
    return transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)


def test_sentencepiece_encodes_and_decodes_as_transformers(tmp_path: Path) -> None:
    metadata = sentencepiece_metadata()
    ours = gguf_tokenizer(metadata, eos_token_ids=(2,))
    theirs = transformers_tokenizer(tmp_path, metadata)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ids[0] == ours.bos_token_id == 1  # SentencePiece files add BOS unless told
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    byte_tokens = set(range(4, 4 + 256))  # "ü" is two bytes, each its <0xNN> token
    assert len(set(ours.encode("ü", add_special_tokens=False)) & byte_tokens) == 2
    assert ours.config["bos_token"] == "<s>" and ours.eos_token_ids == (2,)


def test_sentencepiece_without_a_space_prefix_adds_none() -> None:
    """`add_space_prefix: false` (which transformers ignores): the text is encoded as
    it is, as llama.cpp does, where the default puts one space before it."""
    plain = gguf_tokenizer(sentencepiece_metadata(add_space_prefix=False), eos_token_ids=())
    spaced = gguf_tokenizer(sentencepiece_metadata(), eos_token_ids=())
    for text in ("hello the world", "in the inn is an end", "bytes ü → 日本 fall back"):
        assert plain.encode(" " + text) == spaced.encode(text), text
        assert plain.decode(plain.encode(text)) == text.replace("<s>", "").replace("</s>", "")
    assert plain.encode("hello") != spaced.encode("hello")


def test_byte_level_encodes_and_decodes_as_transformers(tmp_path: Path) -> None:
    metadata = byte_level_metadata()
    ours = gguf_tokenizer(metadata, eos_token_ids=(2,))
    theirs = transformers_tokenizer(tmp_path, metadata)
    texts = [*TEXTS, "<|im_start|>user\nhello<|im_end|>\n<think>the</think>"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    chat = ours.encode("<|im_start|>hello<|im_end|>")
    assert chat[0] == 1 and chat[-1] == 2  # control tokens are matched whole
    assert ours.encode("<think>")[0] == 3  # and so are user-defined ones
    assert ours.decode(chat) == "hello"  # decoding skips the special ones


def test_bos_is_added_as_the_file_says() -> None:
    metadata = byte_level_metadata() | {"tokenizer.ggml.add_bos_token": True}
    tokenizer = gguf_tokenizer(metadata, eos_token_ids=())
    assert tokenizer.encode("the")[0] == 1
    assert tokenizer.encode("the", add_special_tokens=False)[0] != 1


def test_an_unknown_pre_tokenizer_or_kind_is_refused_by_name() -> None:
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'made-up'"):
        gguf_tokenizer(byte_level_metadata() | {"tokenizer.ggml.pre": "made-up"}, eos_token_ids=())
    with pytest.raises(ModelLoadError, match="tokenizer 'rwkv'"):
        gguf_tokenizer(byte_level_metadata() | {"tokenizer.ggml.model": "rwkv"}, eos_token_ids=())
