"""Proto messages <-> engine types, with the validation errors the API promises (INVALID_ARGUMENT names the field)."""
from __future__ import annotations

from typing import Sequence

from engine.outputs import TokenLogprobs
from engine.sampling_params import MAX_LOGPROBS, MIN_REPETITION_PENALTY, SamplingParams
from kvstore.hashing import HASH_BYTES
from strata.v1 import common_pb2

DEFAULT_MAX_TOKENS = 64

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


class InvalidArgument(ValueError):
    """A request field is out of range; the message names it."""


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens == 0:
        raise InvalidArgument("sampling.max_tokens must be >= 1, got 0")
    if msg.HasField("top_p") and not 0.0 < msg.top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {msg.top_p}")
    for name in ("logprobs", "prompt_logprobs"):
        if msg.HasField(name) and getattr(msg, name) > MAX_LOGPROBS:
            raise InvalidArgument(f"sampling.{name} must be in [0, {MAX_LOGPROBS}], got {getattr(msg, name)}")
    if msg.HasField("repetition_penalty") and not MIN_REPETITION_PENALTY <= msg.repetition_penalty <= 10.0:
        raise InvalidArgument(f"sampling.repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10], got "
                              f"{msg.repetition_penalty}")
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=msg.min_tokens,
            temperature=msg.temperature, top_k=msg.top_k,   # tiny temperature / top_p: SamplingParams clamps
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
            seed=msg.seed if msg.HasField("seed") else None, stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
            include_stop_str_in_output=msg.include_stop_str_in_output,
            logprobs=msg.logprobs if msg.HasField("logprobs") else None, logit_bias=tuple(msg.logit_bias.items()),
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
            speculative=msg.speculative or None)
    except ValueError as exc:
        raise InvalidArgument(f"sampling.{exc}") from None


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                                    temperature=params.temperature,
                                    top_k=params.top_k, top_p=params.top_p, stop=list(params.stop),
                                    stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                                    include_stop_str_in_output=params.include_stop_str_in_output,
                                    presence_penalty=params.presence_penalty,
                                    frequency_penalty=params.frequency_penalty)
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    msg.logit_bias.update(dict(params.logit_bias))
    if params.speculative is not None:
        msg.speculative = params.speculative
    return msg


def check_speculative(params: SamplingParams, speculation) -> SamplingParams:
    """A request's `speculative` must name a drafter this worker loaded (`speculation`: the engine's, None when it
    does not speculate), or "off": checked before any KV is pulled or loaded for it."""
    wanted = params.speculative
    if wanted in (None, "off"):
        return params
    loaded = sorted(speculation.drafters) if speculation is not None else []
    if wanted not in loaded:
        runs = f"runs {', '.join(loaded)}" if loaded else "does not speculate"
        raise InvalidArgument(f"sampling.speculative {wanted!r} is not available: this decode worker {runs} (start "
                              f"it with --speculative {wanted}); 'off' always works")
    return params


def logprobs_to_proto(entry: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        sampled=common_pb2.Logprob(token_id=entry.token_id, logprob=entry.logprob), rank=entry.rank,
        top=[common_pb2.Logprob(token_id=t, logprob=v) for t, v in entry.top])


def check_vocab(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """Token ids in the sampling params (logit_bias) must be in the vocabulary."""
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"sampling.logit_bias token ids must be in [0, {vocab_size}), got {bad}")
    return params


def check_prompt(token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> list[int]:
    ids = list(token_ids)
    if not ids:
        raise InvalidArgument("token_ids must not be empty")
    if max(ids) >= vocab_size:  # NOTE: max() first: a scan in Python took ~0.14 ms for a 2,047-token prompt
        bad = next(t for t in ids if t >= vocab_size)
        raise InvalidArgument(f"token_ids must be in [0, {vocab_size}), got {bad}")
    if len(ids) >= max_model_len:
        raise InvalidArgument(f"token_ids: {len(ids)} tokens leave no room below max_model_len {max_model_len}")
    return ids


def check_resume(resume_ids: Sequence[int], prompt: Sequence[int], params: SamplingParams, vocab_size: int,
                 max_model_len: int) -> list[int]:
    """A migrated request's tokens so far (`WorkerGenerateRequest.resume_output_ids`): in the vocabulary, fewer
    than max_tokens, and leaving room below max_model_len for the next one."""
    bad = next((t for t in resume_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"resume_output_ids must be in [0, {vocab_size}), got {bad}")
    if len(resume_ids) >= params.max_tokens:
        raise InvalidArgument(f"resume_output_ids: {len(resume_ids)} tokens leave none of sampling.max_tokens "
                              f"{params.max_tokens} to generate")
    if len(prompt) + len(resume_ids) >= max_model_len:
        raise InvalidArgument(f"token_ids + resume_output_ids: {len(prompt) + len(resume_ids)} tokens leave no room "
                              f"below max_model_len {max_model_len}")
    return list(resume_ids)


def check_handle(kv: common_pb2.KvHandle, num_prompt_tokens: int) -> None:
    """KvHandle invariants (worker.proto); an empty handle is valid."""
    if not kv.block_hashes and not kv.blocks and not kv.HasField("tail"):
        return
    if len(kv.namespace_fingerprint) != HASH_BYTES:
        raise InvalidArgument(f"kv.namespace_fingerprint must be {HASH_BYTES} bytes, "
                              f"got {len(kv.namespace_fingerprint)}")
    if any(len(h) != HASH_BYTES for h in kv.block_hashes):
        raise InvalidArgument(f"kv.block_hashes must be {HASH_BYTES} bytes each")
    if len(kv.blocks) != len(kv.block_hashes):
        raise InvalidArgument(f"kv.blocks has {len(kv.blocks)} entries, kv.block_hashes {len(kv.block_hashes)}")
    if len(kv.block_hashes) * kv.block_size > num_prompt_tokens:
        raise InvalidArgument(f"kv.block_hashes cover {len(kv.block_hashes) * kv.block_size} tokens, the prompt "
                              f"has {num_prompt_tokens}")
    if kv.HasField("tail") and not 0 < kv.tail_tokens < kv.block_size:
        raise InvalidArgument(f"kv.tail_tokens must be in [1, {kv.block_size}) with a tail, got {kv.tail_tokens}")


def stop_reason_fields(stop_str: str | None, token_id: int | None, params: SamplingParams) -> dict:
    """The `stop_reason` oneof: the stop string, or a stop token id (unset for end-of-sequence)."""
    if stop_str is not None:
        return {"stop_str": stop_str}
    if token_id is not None and token_id in params.stop_token_ids:
        return {"stop_token_id": token_id}
    return {}
