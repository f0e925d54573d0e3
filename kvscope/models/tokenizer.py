"""Tokenizers and incremental detokenization.

* `ByteTokenizer`: UTF-8 bytes as token ids 0..255 plus BOS and EOS; the tokenizer of
  the built-in `tiny-random` model.
* `HFTokenizer`: a Hugging Face `tokenizer.json` through the `tokenizers` library, with
  the special tokens of `tokenizer_config.json`; or a `tokenizers.Tokenizer` built from
  another format's vocabulary (`models/gguf_tokenizer.py`) with the same config.
* `IncrementalDecoder`: turns a growing token list into text deltas, holding back a
  token that ends inside a multi-byte character (as vLLM's detokenizer does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Bytes are tokens: id b for byte b, then BOS and EOS."""

    BOS = 256
    bos_token_id: int | None = BOS
    eos_token_ids: tuple[int, ...] = (257,)
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer: a `tokenizer.json` directory (with its
    `tokenizer_config.json`), or a `tokenizers.Tokenizer` built elsewhere with the
    config that names its special tokens (`from_tokenizer`, as GGUF files give one)."""

    def __init__(self, directory: str | Path, *, eos_token_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self._adopt(_Tokenizer.from_file(str(path)), config, eos_token_ids)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, config: dict[str, Any], *, eos_token_ids: tuple[int, ...] = ()
    ) -> HFTokenizer:
        """`tokenizer` (a `tokenizers.Tokenizer`) with `config` in the place of a
        `tokenizer_config.json` (`bos_token`, `eos_token`, `chat_template`, ...)."""
        self = cls.__new__(cls)
        self._adopt(tokenizer, config, eos_token_ids)
        return self

    def _adopt(
        self, tokenizer: Any, config: dict[str, Any], eos_token_ids: tuple[int, ...]
    ) -> None:
        self._tok = tokenizer
        self.config: dict[str, Any] = config
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = list(eos_token_ids)
        if (
            self.eos_token
            and (eid := self._tok.token_to_id(self.eos_token)) is not None
            and eid not in eos
        ):
            eos.append(eid)
        self.eos_token_ids = tuple(eos)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = self.config.get("chat_template")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The `tokenizer.json` document (what grammar libraries read)."""
        return self._tok.to_str()


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class IncrementalDecoder:
    """Text deltas for one sequence's generated tokens."""

    # Decoding starts a few tokens back so that tokenizers that strip a leading space
    # (SentencePiece-style) see the context that decides it.
    _CONTEXT = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-self._CONTEXT :])
        self._prefix = 0
        self._read = len(self._ids)

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode, skip = self._tokenizer.decode, self._skip_special
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=skip)
        new_text = decode(self._ids[self._prefix :], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]
