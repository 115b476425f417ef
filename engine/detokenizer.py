"""Incremental detokenization of one request's output, with stop strings.

Each push decodes a small window of ids twice, `[prefix_offset, read_offset)` and `[prefix_offset, end)`, and
keeps the difference; a few prompt tokens seed the window so that tokenizers which strip a leading space at the
start of a decode (Metaspace) still print it:

    ids:  ... prompt tail | out0 out1 ... | new tokens |
          prefix_offset ^   read_offset ^          end ^

A byte-level BPE token can end in the middle of a UTF-8 character; the decode then ends in U+FFFD and the window
waits for more tokens, so a partial character is never emitted. Text that could be the start of a stop string is
held back until it is known not to be one, so what was released is never taken back.

A request that nobody reads text from before it ends (no stop strings, `RequestOutputKind.FINAL_ONLY`) skips all of
this: `decode_final` decodes its outputs once, to the same text.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

from engine.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5        # prompt tokens in the first window
_REPLACEMENT = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class DetokenizeStep(NamedTuple):
    new_text: str           # text released by this push
    stop: str | None        # the stop string that matched; the request must finish with reason 'stop'


class Detokenizer:
    """`push(new_ids)` -> released text delta; `flush()` releases held-back text when the request ends otherwise.

    After a stop string matches, output text is final (truncated at the match, which is kept only with
    `include_stop_str_in_output`) and later pushes release nothing.
    """

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], params: SamplingParams,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = params.stop
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens     # stop strings count only from this many outputs on (vLLM)
        self._num_outputs = 0
        self._decoded = ""       # complete characters decoded so far (after a stop: truncated, final)
        self._released = 0       # how much of _decoded has been handed out
        self.stop: str | None = None

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._decoded[:self._released]

    @property
    def num_released(self) -> int:
        return self._released

    def text_upto(self, length: int) -> str:
        """The first `length` characters released (what `text` was when `num_released` was `length`): released
        text is never taken back, so this stays valid as the request goes on."""
        assert length <= self._released
        return self._decoded[:length]

    def push(self, token_ids: Sequence[int]) -> DetokenizeStep:
        if self.stop is not None:
            return DetokenizeStep("", self.stop)
        self._ids.extend(token_ids)
        self._num_outputs += len(token_ids)
        start = len(self._decoded)
        self._decoded += self._decode_new()
        if self._stops and len(self._decoded) > start and self._num_outputs >= self._min_tokens:
            self._truncate_at_stop(start)
        release_to = len(self._decoded) if self.stop is not None else len(self._decoded) - self._holdback()
        return DetokenizeStep(self._release(release_to), self.stop)

    def push_until_stop(self, token_ids: Sequence[int]) -> tuple[DetokenizeStep, int]:
        """`push` for several tokens at once (a speculative step), one at a time while stop strings are set so
        that the request ends at the token whose text completes a stop string, as it would one token per step;
        with the number of tokens taken (the rest are dropped)."""
        if not self._stops or len(token_ids) <= 1:
            return self.push(token_ids), len(token_ids)
        texts: list[str] = []
        for used, token_id in enumerate(token_ids, 1):
            step = self.push([token_id])
            texts.append(step.new_text)
            if step.stop is not None:
                return DetokenizeStep("".join(texts), step.stop), used
        return DetokenizeStep("".join(texts), None), len(token_ids)

    def flush(self) -> str:
        """Release the held-back tail (the request finished for another reason)."""
        return self._release(len(self._decoded))

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        new = self._decoded[self._released:upto]
        self._released = upto
        return new

    def _decode_new(self) -> str:
        decode, ids = self._tokenizer.decode, self._ids
        prefix = decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip_special)
        full = decode(ids[self._prefix_offset:], skip_special_tokens=self._skip_special)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing yet, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix):]

    def _truncate_at_stop(self, start: int) -> None:
        """Find the earliest stop string that overlaps the new text `_decoded[start:]`."""
        search_from = max(0, start - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._decoded.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self._decoded = self._decoded[:at + len(stop) if self._include_stop else at]
            self.stop = stop

    def _holdback(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text = self._decoded
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0


def decode_final(tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> str:
    """The text a `Detokenizer` without stop strings releases in all (flushed) when pushed these outputs one token
    per push; in one decode when that text has no U+FFFD, else by those pushes.

    NOTE: one decode gives the same text when the decode of the outputs extends the decode of each prefix that
    ends on a complete character: true of every decoder of generative checkpoints (byte-level BPE, Metaspace, byte
    fallback) as long as every byte run is valid UTF-8. A text with U+FFFD may hold an invalid run (byte fallback
    turns a whole run into U+FFFD, after the pushes released its valid start) or a partial last character (the
    pushes never release it), so it is replayed.
    """
    context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
    prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(context + list(output_token_ids), skip_special_tokens=skip_special_tokens)
    if full.startswith(prefix) and _REPLACEMENT not in full:
        return full[len(prefix):]
    detokenizer = Detokenizer(tokenizer, prompt_token_ids, SamplingParams(), skip_special_tokens)
    return "".join(detokenizer.push([t]).new_text for t in output_token_ids) + detokenizer.flush()
