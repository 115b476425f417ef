"""Worker-side text of one request: exactly the text and stop-string decisions the single engine makes.

The engine runs without a tokenizer in a worker (stop strings stripped from its params), and the worker pushes every
sampled token through `engine.detokenizer.Detokenizer` itself. This lets a decode worker resume the text stream
after a first token that a prefill worker sampled and emitted:

    prefill worker:  push([first])            -> first_text_delta
    decode worker:   push([first]) (dropped)   then push(new ids) per step -> text_delta, ...

so that first_text_delta + every text_delta equals the single engine's text (LLMEngine._output's rules).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

from engine.detokenizer import Detokenizer
from engine.sampling_params import SamplingParams


class TextDelta(NamedTuple):
    text: str
    stop_str: str | None     # a stop string matched: the request ends with reason 'stop'
    num_tokens: int = 0      # of the pushed tokens, how many the text took (fewer: a stop string ended it)


def engine_params(params: SamplingParams) -> SamplingParams:
    """The params the engine runs with: stop strings are the worker's (text side)."""
    return dataclasses.replace(params, stop=()) if params.stop else params


class TextStream:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams,
                 skip_text: bool = False) -> None:
        # NOTE: with stop strings the text is always tracked (the stop decision needs it), even under skip_text.
        needed = tokenizer is not None and (not skip_text or bool(params.stop))
        self._detok = Detokenizer(tokenizer, prompt_token_ids, params) if needed else None
        self._emit = not skip_text

    def resume(self, ids: Sequence[int]) -> str:
        """Replay tokens another worker already streamed (request migration): their text as this stream would
        release it, for the caller to put in front of the next delta (the router drops what the client has)."""
        delta = self.push(ids, False)
        if delta.stop_str is not None:
            raise ValueError(f"resume_output_ids already end the request at stop string {delta.stop_str!r}")
        return delta.text

    def push(self, new_ids: Sequence[int], engine_finished: bool) -> TextDelta:
        """Text released by these tokens; flushed when the engine already finished the request."""
        if self._detok is None:
            return TextDelta("", None, len(new_ids))
        (new_text, stop), used = self._detok.push_until_stop(new_ids)
        if stop is None and engine_finished:
            new_text += self._detok.flush()
        return TextDelta(new_text if self._emit else "", stop, used)
