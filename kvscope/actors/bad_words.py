"""`bad_words` (a `SamplingParams` field) as the token sequences sampling bans, as vLLM
spells them: each word as at the text's start, and after a space where that is other
tokens of the same count.
"""

from __future__ import annotations

from kvscope.models.tokenizer import Tokenizer


def bad_word_ids(tokenizer: Tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `bad_words`, as vLLM spells them: each word as at the
    text's start, and after a space where that is other tokens of the same count."""
    sequences = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(bare)
        if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return tuple(sequence for sequence in sequences if sequence)
