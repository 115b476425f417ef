"""`quantize_vocab` (`--quantize-vocab`): the LM head and the token embedding quantized with the weights' scheme.

Against the same checkpoint quantized without it: the embedding looks up exactly the rows of the scheme's
dequantized matrix and the logits are the final norm's output times that matrix (to the kernel's rounding); a tied
matrix stays one quantized tensor (the embedding reads the head's buffers, except torch's CPU int4 layout, which
needs a row-major copy); the model holds fewer bytes; the namespace names the choice; bad combinations are errors
naming the field."""
from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig, quantization_label
from engine.quant.apply import quantize_vocab
from engine.quant.linear import Int4Rows, QuantEmbedding
from engine.quant.schemes import make_scheme
from engine.sampling_params import SamplingParams
from router.served_model import QuantChoice, ServedModel
from strata.llm import LLM
from worker_common.engine_setup import build_engine_from

SCHEMES = ["int8", "int4", "fp8", "mxfp4"]
# bf16 activations: the CPU int8/int4 kernels compute in bf16 (scales included); fp8 also rounds activations
TOLERANCE = {"int8": 2e-2, "int4": 2e-2, "fp8": 8e-2, "mxfp4": 2e-2}


def engine(path: str, scheme: str, vocab: bool, dtype: str = "bfloat16", eager: bool = True) -> LLM:
    return LLM(path, dtype=dtype, quantization=scheme, quant_group_size=32, quantize_vocab=vocab,
               enforce_eager=eager, num_blocks=64, max_num_seqs=4)


def model_of(llm: LLM):
    return llm.engine.runner.model


def model_bytes(model) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ["llama", "llama_sharded"], ids=["untied", "tied"])
def test_lookups_and_logits_follow_the_dequantized_vocabulary_matrices(tiny_checkpoint, arch, scheme):
    ckpt = tiny_checkpoint(arch)
    hf = ckpt.hf_model
    model = model_of(engine(str(ckpt.path), scheme, True))
    assert isinstance(model.embed, QuantEmbedding) and model.quant_head is not None and model.head_weight is None
    tied = hf.config.tie_word_embeddings
    quant = make_scheme(scheme, 32)
    head_ref = quant.quantize(hf.get_output_embeddings().weight.detach().bfloat16()).dequantize()      # [V, H]
    embed_ref = quant.quantize(hf.get_input_embeddings().weight.detach().bfloat16()).dequantize()
    ids = torch.tensor([[0, 5, 319], [7, 7, 100]])
    looked_up = model.embed(ids)                                                                       # [2, 3, H]
    assert looked_up.shape == (2, 3, 64) and looked_up.dtype == torch.bfloat16
    # within one bf16 step: int8 keeps its scales in the kernel's bf16, as the head's matmul uses them
    torch.testing.assert_close(looked_up.float(), embed_ref[ids].bfloat16().float(), rtol=2 ** -7, atol=1e-6)
    hidden = torch.randn(5, 64, dtype=torch.bfloat16)
    ref = model.norm(hidden).float() @ head_ref.T                                                      # [5, V]
    err = (model.logits(hidden) - ref).abs().max() / ref.abs().max()
    assert err < TOLERANCE[scheme], err
    if tied:   # one quantized matrix: the lookup reads the head's own buffers (CPU int4: a row-major copy)
        assert (model.embed.source is model.quant_head) != isinstance(model.embed.source, Int4Rows)
        assert scheme == "int4" or model.embed.source is model.quant_head


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_model_shrinks_and_still_generates(tiny_checkpoint, scheme):
    path = str(tiny_checkpoint("llama_sharded").path)
    linears_only, whole = engine(path, scheme, False), engine(path, scheme, True)
    vocab = 320 * 64 * 2                                          # one bf16 [V, H] matrix (tied)
    saved = model_bytes(model_of(linears_only)) - model_bytes(model_of(whole))
    per_weight = {"int8": 1, "fp8": 1, "int4": 1, "mxfp4": 0.5}[scheme]   # CPU int4: head + row-major copy
    assert saved >= vocab - 320 * 64 * per_weight - 320 * 64 // 32 * 8 - 320 * 8, (saved, vocab)
    out = whole.generate([[5, 9, 12, 40]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and all(0 <= t < 320 for t in out.token_ids)


def test_the_compiled_step_gives_the_eager_tokens(tiny_checkpoint):
    path = str(tiny_checkpoint("llama").path)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 12, 40, 41, 7], [3, 3, 8, 100, 150, 22]]
    eager = engine(path, "int8", True, dtype="float32").generate(prompts, params)
    compiled = engine(path, "int8", True, dtype="float32", eager=False).generate(prompts, params)
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]


def test_the_namespace_names_it_and_the_router_agrees(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3_moe").path)
    assert quantization_label("int8", 128, {}, True) == "int8+vocab" != quantization_label("int8", 128, {})
    quant = QuantChoice("int8", 128, "auto", True)
    bundle = build_engine_from(path, num_blocks=8, quantization="int8", quantize_vocab=True)
    assert ServedModel.load(path, "float32", 16, 256, quant=quant).namespace == bundle.namespace
    assert ServedModel.load(path, quant=QuantChoice("int8")).namespace != bundle.namespace


def test_bad_combinations_name_the_field(tiny_checkpoint):
    with pytest.raises(ValueError, match="quantize_vocab needs a load-time quantization scheme"):
        ModelConfig("m", quantize_vocab=True)
    model = model_of(engine(str(tiny_checkpoint("llama").path), "int8", False))
    with pytest.raises(ValueError, match=r"quantizing the vocabulary matrices \(quantize_vocab\) with int4"):
        quantize_vocab(model, make_scheme("int4", 128))            # in_features 64 is no multiple of 128


def test_strata_serve_hands_the_flag_to_the_router_and_every_worker(tiny_checkpoint):
    from router.__main__ import parse_args
    from strata.launcher import ServeConfig, router_args_of, worker_args_of
    from worker_common.cli import parse_config
    path = str(tiny_checkpoint("llama").path)
    config = ServeConfig(quantization="int8", quantize_vocab=True)
    router = parse_args(router_args_of(config, path, [], []))
    assert router.quantize_vocab and router.quantization == "int8"
    for role in ("prefill", "decode"):
        worker = parse_config(role, worker_args_of(config, role, f"{role}-0", path, "127.0.0.1:1", ""))
        assert worker.quantize_vocab and worker.quantization == "int8"
    with pytest.raises(ValueError, match="quantize_vocab needs a load-time quantization scheme"):
        ServeConfig(quantize_vocab=True)
