"""Adding a request whose first blocks' KV is provided (pulled or loaded), so it resumes right after them.

    admit(...) on the engine thread:
      install_blocks(hashes, payloads)        -> blocks written, registered in the prefix index, pinned
      engine.add_request(prompt, params)      -> its prefix match takes the pinned blocks at scheduling
      request.append_output(t) per output     -> (decode) the first token, sampled by the prefill worker;
                                                 (migration) every token the client already has
      request.preloaded_kv = tail             -> (decode) the prompt's partial last block, when every full one is in
      loop.track(tracked)                     -> outputs fan out; pins released when the request leaves

Appending those tokens as *outputs* (not prompt tokens) keeps the sampler's position, max_tokens, penalties and the
stop rules exactly where the single engine has them, so a seeded request continues the same random stream. `hashes`
and `payloads` then cover prompt + outputs: the engine computes whatever of them no block was installed for.
"""
from __future__ import annotations

import time
from typing import Sequence

from engine.sampling_params import SamplingParams
from worker_common.engine_loop import EngineLoop, Tracked
from worker_common.kv_blocks import InstallResult, install_blocks, payload_tensor


def admit(loop: EngineLoop, tracked: Tracked, request_id: str, prompt: Sequence[int], params: SamplingParams,
          fingerprint: bytes, hashes: Sequence[bytes], payloads: Sequence[memoryview | None],
          outputs: Sequence[int] = (), tail: memoryview | None = None) -> InstallResult:
    """Engine thread only. Raises ValueError (nothing changed) when the engine refuses the request. `tail`: the
    verified payload of the block after `hashes` (the prompt's last tokens), used when every block got installed."""
    bundle = loop.bundle
    installed = install_blocks(bundle, hashes, payloads, [*prompt, *outputs])
    try:
        request = bundle.engine.add_request(request_id, prompt, params, hash_root=fingerprint)
    except ValueError:
        bundle.engine.block_manager.pool.release(installed.pinned)
        raise
    for token in outputs:
        request.append_output(token)
    if outputs:  # NOTE: the installed blocks came from a prefill worker or the store: they are stored already
        tracked.handed_over_blocks = installed.num_blocks
    if tail is not None and installed.num_blocks == len(hashes):
        request.preloaded_kv = (payload_tensor(bundle, [tail])[0], len(prompt) - len(hashes) * bundle.block_size)
    tracked.request, tracked.pinned = request, installed.pinned
    tracked.arrived_at = time.perf_counter()  # queue time starts when the engine has the request
    loop.track(tracked)
    return installed
