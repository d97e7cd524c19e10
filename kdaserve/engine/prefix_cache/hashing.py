"""Chained block hashes: block i's hash covers its tokens, everything that changes their cached
values (a cache salt, the content hashes of the images among them), and the hash of block i-1, so
equal hashes mean equal prefixes. vLLM's algorithms by name: sha256 (pickle, then SHA-256; the
default) and xxhash (pickle, then 128-bit xxHash: faster, not cryptographic; needs the `xxhash`
package)."""

from __future__ import annotations

import hashlib
import pickle

from kdaserve.engine.multimodal import ImageItem, block_image_keys

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def hash_function(algo: str):
    """bytes -> bytes for `algo`; ValueError for an unknown or unavailable one."""
    if algo == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError:
            raise ValueError("--prefix-caching-hash-algo xxhash needs the `xxhash` package (pip install xxhash)") from None
        return lambda data: xxhash.xxh3_128_digest(data)
    if algo in HASH_ALGOS:
        raise ValueError(f"--prefix-caching-hash-algo {algo} is not supported here (the CBOR serializations); "
                         f"use sha256 or xxhash")
    raise ValueError(f"unknown --prefix-caching-hash-algo {algo!r}; expected one of {', '.join(HASH_ALGOS)}")


class BlockHasher:
    def __init__(self, block_size: int, algo: str = "sha256"):
        self.block_size = block_size
        self._hash = hash_function(algo)

    def extend(self, hashes: list[bytes], token_ids: list[int], salt: str | None = None,
               images: tuple[ImageItem, ...] = ()) -> list[bytes]:
        """Appends to `hashes` (a sequence's hashes so far, in order) those of its further full
        blocks in `token_ids`; returns `hashes`. A block covering image tokens also hashes those
        images' content hashes (their placeholder tokens are all alike)."""
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[i - 1] if i else b""
            key = (parent, tuple(token_ids[i * bs : (i + 1) * bs]), salt)
            extra = block_image_keys(images, i * bs, (i + 1) * bs) if images else ()
            hashes.append(self._hash(pickle.dumps(key + (extra,) if extra else key, protocol=5)))
        return hashes
