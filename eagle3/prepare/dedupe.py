"""Exact and near duplicates among short texts (the self-written source's user turns).

Exact: the same words, case and punctuation aside. Near: Jaccard similarity of the word
3-shingle sets at or above a threshold t. Candidates are found by MinHash banding, 64
permutations in bands of r rows, r the largest of 8, 4, 2, 1 that finds a pair at Jaccard t with
probability 1 - (1 - t^r)^(64/r) >= 0.99 (t = 0.8: 16 bands of 4, 0.9998; t = 0.5: 32 bands of 2),
and each is confirmed by the exact Jaccard of the shingle sets, so a text is never called a near
duplicate of one it is not near to. Cost per text: one hash per shingle and a [shingles, 64]
array of integer ops, then dictionary look-ups.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

_WORD = re.compile(r"\w+")
_MERSENNE = (1 << 61) - 1  # the universal hashes (a x + b) mod p, p prime
SHINGLE_WORDS = 3


class DuplicateFilter:
    """Texts added so far; `check` says whether a new one repeats one of them."""

    PERM = 64

    def __init__(self, threshold: float):
        self.threshold = threshold  # Jaccard at or above which a text is a near duplicate
        self.rows = next((r for r in (8, 4, 2) if 1 - (1 - threshold ** r) ** (self.PERM // r)
                          >= 0.99), 1)
        rng = np.random.default_rng(20240611)  # fixed: the same bands on every run
        self._a = rng.integers(1, 1 << 31, self.PERM, dtype=np.uint64)
        self._b = rng.integers(0, 1 << 31, self.PERM, dtype=np.uint64)
        self.exact: set[str] = set()
        self.sets: list[frozenset] = []
        self.buckets: list[dict[bytes, list[int]]] = [{} for _ in range(self.PERM // self.rows)]
        self._memo: tuple[str, str, frozenset, list[bytes]] | None = None  # last text checked

    def __len__(self) -> int:
        return len(self.sets)

    @staticmethod
    def normalize(text: str) -> str:
        return " ".join(_WORD.findall(text.lower()))

    def _signature(self, text: str) -> tuple[str, frozenset, list[bytes]]:
        """(normalized text, shingle set, band keys), kept for the `add` that follows a check."""
        if self._memo is not None and self._memo[0] == text:
            return self._memo[1:]
        norm = self.normalize(text)
        words = norm.split()
        k = min(SHINGLE_WORDS, len(words))
        shingles = frozenset(" ".join(words[i:i + k]) for i in range(len(words) - k + 1))
        x = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=4).digest(),
                                     "little") for s in sorted(shingles)] or [0], dtype=np.uint64)
        # x < 2^32 and a < 2^31: the products fit in 64 bits before the modulo.
        sig = ((x[:, None] * self._a[None, :] + self._b[None, :]) % _MERSENNE).min(axis=0)
        r = self.rows
        bands = [sig[b * r:(b + 1) * r].tobytes() for b in range(self.PERM // r)]
        self._memo = (text, norm, shingles, bands)
        return norm, shingles, bands

    def check(self, text: str) -> str | None:
        """None, 'exact duplicate' or 'near duplicate' of a text added before."""
        norm, shingles, bands = self._signature(text)
        if norm in self.exact:
            return "exact duplicate"
        seen: set[int] = set()
        for bucket, key in zip(self.buckets, bands):
            for j in bucket.get(key, ()):
                if j not in seen:
                    seen.add(j)
                    other = self.sets[j]
                    if len(shingles & other) >= self.threshold * len(shingles | other):
                        return "near duplicate"
        return None

    def add(self, text: str) -> None:
        norm, shingles, bands = self._signature(text)
        self.exact.add(norm)
        j = len(self.sets)
        self.sets.append(shingles)
        for bucket, key in zip(self.buckets, bands):
            bucket.setdefault(key, []).append(j)
