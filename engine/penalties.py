"""Penalty bookkeeping for the sampler: the tokens each penalised row has seen, counted per request and kept between
steps (`TokenCounts`), handed to `engine.sampler` as (row, token, count) triples (`SeenPairs`)."""
from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

import torch


class SeenTokens(NamedTuple):
    """The tokens a penalised row has seen. With a `key`, `TokenCounts` keeps the counts between calls and adds
    only the outputs appended since the last one (`output_token_ids` must then only grow); a plain
    `(prompt ids, output ids)` pair is counted afresh."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    key: Hashable | None = None


class SeenPairs(NamedTuple):
    """Every (row, token) a row has seen in its prompt or its outputs, with the token's count in the outputs."""

    row: torch.Tensor       # [n] int64, an index into the rows asked for
    token: torch.Tensor     # [n] int64
    count: torch.Tensor     # [n] int32, 0 for a token seen only in the prompt


class TokenCounts:
    """Per-request token counts for the penalties, kept between steps: one row ("slot") per key of a
    `[slots, vocab]` int32 tensor of output counts and a `[slots, vocab]` bool mask of tokens seen in the prompt or
    the outputs. A slot is built from the lists once; each later call adds the new outputs only, so a step costs
    O(new tokens + seen tokens) tensor work plus one bool pass over `[rows, vocab]`, and no Python per token.

    Contracts: `pairs` answers as of the lists it is given; a key whose output list is another object or shorter
    than what was counted is rebuilt from its lists; `release(key)` frees the slot (unknown keys are ignored).
    """

    def __init__(self) -> None:
        self._slots: dict[Hashable, int] = {}
        self._counted: dict[Hashable, tuple[Sequence[int], int]] = {}  # key -> (output list, how many counted)
        self._free: list[int] = []
        self.output_counts: torch.Tensor | None = None  # [capacity, vocab] int32
        self.seen: torch.Tensor | None = None           # [capacity, vocab] bool: in the prompt or the outputs

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def release(self, key: Hashable) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._counted.pop(key)
            self._free.append(slot)

    def pairs(self, entries: Sequence[SeenTokens], vocab: int, device: torch.device) -> SeenPairs:
        """The seen (row, token, output count) of each entry (row i is entries[i])."""
        index = torch.tensor(self._update(entries, vocab, device), device=device)   # [n] slots
        row, token = self.seen.index_select(0, index).nonzero(as_tuple=True)       # [pairs] each
        return SeenPairs(row, token, self.output_counts[index[row], token])

    def _update(self, entries: Sequence[SeenTokens], vocab: int, device: torch.device) -> list[int]:
        """Bring each entry's slot up to date (new outputs added, or built afresh); their slots."""
        self._ensure(vocab, device)
        slots, new_slots, new_tokens = [], [], []
        for entry in entries:
            key, outputs = entry.key, entry.output_token_ids
            slot, counted = self._slots.get(key), self._counted.get(key)
            if slot is None or counted[0] is not outputs or counted[1] > len(outputs):
                slot = self._build(key, entry, vocab) if slot is None else self._rebuild(slot, entry, vocab)
            elif counted[1] < len(outputs):
                new = outputs[counted[1]:]
                new_slots.extend([slot] * len(new))
                new_tokens.extend(new)
            self._counted[key] = (outputs, len(outputs))
            slots.append(slot)
        if new_tokens:
            where = (torch.tensor(new_slots, device=device), torch.tensor(new_tokens, device=device))
            self.output_counts.index_put_(where, torch.ones(len(new_tokens), dtype=torch.int32, device=device),
                                          accumulate=True)
            self.seen[where] = True
        return slots

    def _ensure(self, vocab: int, device: torch.device) -> None:
        if self.output_counts is None:
            self.output_counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
            self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        assert self.output_counts.shape[1] == vocab, f"vocabulary changed: {self.output_counts.shape[1]} -> {vocab}"

    def _build(self, key: Hashable, entry: SeenTokens, vocab: int) -> int:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slots[key] = slot
        return self._rebuild(slot, entry, vocab)

    def _rebuild(self, slot: int, entry: SeenTokens, vocab: int) -> int:
        device = self.output_counts.device
        outputs = torch.tensor(list(entry.output_token_ids), dtype=torch.long, device=device)
        prompt = torch.tensor(list(entry.prompt_token_ids), dtype=torch.long, device=device)
        self.output_counts[slot] = torch.bincount(outputs, minlength=vocab)[:vocab]
        self.seen[slot] = self.output_counts[slot] > 0
        self.seen[slot, prompt[prompt < vocab]] = True
        return slot

    def _grow(self) -> None:
        """Double the slots (at least 8): rare, as slots are released when requests end."""
        capacity, vocab = self.output_counts.shape
        extra = max(8, capacity)
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(extra, vocab)])
        self.seen = torch.cat([self.seen, self.seen.new_zeros(extra, vocab)])
        self._free.extend(range(capacity + extra - 1, capacity - 1, -1))  # lowest slot popped first
