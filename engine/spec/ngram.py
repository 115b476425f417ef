"""`ngram`: prompt lookup. The request's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
are looked up among its own earlier tokens (prompt and output); the tokens that followed their most recent earlier
occurrence are proposed. No model runs.

    token_ids:  ... a b c X Y Z ............ a b c |      (suffix "a b c", n = 3)
                          ^ proposed: X Y Z ...    ^ end

Per request one index per n maps each n-gram to the position right after its latest occurrence; it is extended
with the tokens appended since the last call only, so a call costs O(new tokens * n range), not O(length).
"""
from __future__ import annotations

from typing import Sequence

from engine.spec.drafter import DraftInput, Drafter, Proposal


class _Index:
    __slots__ = ("maps", "upto")

    def __init__(self, sizes: range) -> None:
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.upto = 0                    # n-grams ending before this position are indexed


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.sizes = range(max_n, min_n - 1, -1)      # longest first
        self._index: dict[str, _Index] = {}

    def propose(self, inputs: Sequence[DraftInput], seeds: Sequence[int | None]) -> list[Proposal]:
        return [Proposal(self._lookup(item.request.request_id, item.request.token_ids, item.num_tokens))
                for item in inputs]

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def _lookup(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        index = self._index.get(request_id)
        if index is None:
            index = self._index[request_id] = _Index(self.sizes)
        end = len(tokens)
        self._extend(index, tokens, end - 1)          # every n-gram that ends before the last token
        for n in self.sizes:
            if n > end:
                continue
            follow = index.maps[n].get(tuple(tokens[end - n:]))
            if follow is not None:
                return tokens[follow:follow + k]
        return []

    @staticmethod
    def _extend(index: _Index, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions [index.upto, upto) (each maps to the position after it)."""
        for stop in range(index.upto + 1, upto + 1):  # an n-gram tokens[stop - n:stop]
            for n, table in index.maps.items():
                if stop >= n:
                    table[tuple(tokens[stop - n:stop])] = stop
        index.upto = max(index.upto, upto)
