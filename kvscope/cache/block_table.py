"""Block-table arithmetic: how many blocks tokens need, and the chained block hashes.

A sequence's block table is a plain list of block ids; token position `p` lives in
block `table[p // block_size]` at offset `p % block_size`. A full block is named by a
chained hash of its parent block's hash and its own token ids, so equal prefixes get
equal hashes and different prefixes never share a hash chain.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"\0")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def extend_hashes(
    hashes: list[bytes],
    tokens: Sequence[int],
    upto: int,
    block_size: int,
    salt: bytes | None = None,
) -> None:
    """Append to `hashes` the hash of every full block of `tokens[:upto]` not yet hashed.
    A `salt` starts the chain: only sequences with the same salt share cached blocks."""
    for index in range(len(hashes), upto // block_size):
        parent = hashes[-1] if hashes else salt
        hashes.append(block_hash(parent, tokens[index * block_size : (index + 1) * block_size]))
