"""RoPE inverse frequencies and scales equal transformers' for every scaling type Strata supports."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.models.rope import RotaryTable, inv_freq_and_scale
from engine.models.spec import parse_rope
from engine.models.registry import ARCHITECTURES

CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seq_len", [100, 1000])
def test_inv_freq_matches_transformers(case, seq_len):
    params = {"rope_theta": 50000.0, **CASES[case]}
    hf_config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=512,
                                         rope_parameters=dict(params))
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, None, seq_len=seq_len)
    rope = parse_rope({"rope_parameters": dict(params)}, ARCHITECTURES["LlamaForCausalLM"], "config.json")
    freq, scale = inv_freq_and_scale(rope, 64, 512, seq_len)
    torch.testing.assert_close(freq, ref_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_table_grows_past_its_initial_length():
    rope = parse_rope({"rope_theta": 10000.0}, ARCHITECTURES["LlamaForCausalLM"], "config.json")
    table = RotaryTable(rope, 16, 1 << 16, torch.device("cpu"), torch.float32, initial_length=8)
    table.ensure(20)
    assert table.length >= 20
    cos, sin = table.lookup(torch.tensor([19]))
    assert cos.shape == (1, 1, 16)
    torch.testing.assert_close(cos[0, 0, 0], torch.cos(torch.tensor(19.0)))
