"""Quantized models (engine/quant/apply.py, moe.py, prequantized.py; the loader's hook).

- A whole tiny model quantized with each scheme at load time gives the logits of the same float model with every
  quantized weight replaced by its dequantized matrix, computed by plain float ops (ReferenceLinear): fp32 max
  abs diff <= 1e-4 (logits span about +-5). The reference rounds activations where the scheme does on CPU: fp8
  (W8A8) its input per token to e4m3; int8 and int4, whose CPU kernels run in bf16, their input and output to
  bf16, with the scales bf16 too (`effective_weight`); there a sum rounded to bf16 the other way can propagate,
  so their bound is 1e-2 (usually the logits are identical).
- The quantized MoE computes what the float per-expert loop computes on the dequantized experts (<= 1e-5 of the
  output's scale where it computes in fp32, 2e-2 in bf16 and for int8/int4 on CPU), eager and compiled.
- A pre-quantized checkpoint loads into the same modules as load-time quantization; a different `quantization`
  is refused. The compiled decode step gives the eager step's greedy tokens. Each scheme has its own fingerprint.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.loader as loader
import engine.quant.formats as formats
from engine import cpu_kernels
from engine.batch import ScheduledSeq, StepBatch
from engine.config import CacheConfig, ModelConfig, quantization_label
from engine.checkpoint import weight_files
from engine.loader import SafetensorsReader, load_model
from engine.model_runner import ModelRunner
from engine.models.errors import TensorShapeError
from engine.models.layers import Linear, SparseMoE
from engine.models.weights import weight_sources
from engine.moe.local import LocalMoE
from engine.moe.paths import loop
from engine.quant.apply import QUANTIZED_LINEARS, set_module
from engine.quant.formats.base import CheckpointQuant
from engine.quant.kernels import quantize_per_token
from engine.quant.linear import ConcatLinear, Int4Linear, QuantLinear, unsigned_int4
from engine.quant.moe import QuantizedMoE, quantized_experts
from engine.quant.packed import IntWeight
from engine.quant.prequantized import in_input_order
from engine.quant.schemes import make_scheme
from engine.sampling_params import SamplingParams
from strata.llm import LLM
from tests.unit.test_moe_paths import make_batch, routing_cases

SCHEMES = ["int8", "int4", "fp8", "mxfp4"]
GROUP = 32                       # the tiny models' in_features are 32..128
ATOL = 1e-4
BF16_KERNEL_ATOL = 1e-2          # int8/int4: a bf16 rounding that lands the other way (measured 0 to 2.5e-3)
# int8 through Strata's CPU kernel (engine/cpu_kernels, a CPU without native bf16): activations stay unrounded
INT8_KERNEL = cpu_kernels.int8_kernel(torch.device("cpu"))
BF16_ROUNDED = ("int4",) if INT8_KERNEL else ("int8", "int4")     # schemes whose CPU kernel rounds x and y to bf16
BLOCK = 4
MOE_REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_runner(path, quantization: str | None = None, dtype: str = "float32") -> ModelRunner:
    config = ModelConfig(str(path), dtype=dtype, quantization=quantization, quant_group_size=GROUP)
    return ModelRunner(config, CacheConfig(block_size=BLOCK, num_blocks=64))


def prefill_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    table = list(range(-(-len(tokens) // BLOCK)))
    return runner.execute(StepBatch([ScheduledSeq("a", tokens, 0, table, len(tokens))]))    # [n, V]


def effective_weight(qw, name: str) -> torch.Tensor:
    """float32 `[n, k]` the CPU kernel multiplies by: `dequantize()`, except that torch's int8/int4 kernels run in
    bf16 and so hold their scales (int4: scale and torch's float zero (8 - zero) * scale) in bf16 (int8 runs
    Strata's kernel instead where `INT8_KERNEL`: fp32 scales)."""
    if name == "int8" and not INT8_KERNEL:
        return qw.q.float() * qw.scale.bfloat16().float()
    if name == "int4":
        g, (q, zero) = qw.group_size, unsigned_int4(qw)                      # symmetric: q + 8, zero 8
        scale = qw.scale.bfloat16().float().repeat_interleave(g, dim=1)
        zero_float = ((8 - zero) * qw.scale).bfloat16().float().repeat_interleave(g, dim=1)
        return (q.float() - 8) * scale + zero_float
    return qw.dequantize()


class ReferenceLinear(torch.nn.Module):
    """What a quantized linear computes, in plain float32 ops: the effective weight, and the activations rounded
    as the scheme does on CPU (int8/int4: input and output in bf16; fp8: input to e4m3 per token)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str,
                 perm: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight, self.bias, self.name, self.perm = weight, bias, name, perm
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x[..., self.perm]                                            # act-order
        if self.name == "fp8":
            a, scale = quantize_per_token(x)                                 # [T, k] e4m3, [T, 1]
            out = torch.nn.functional.linear(a.float() * scale, self.weight)
        elif self.name in BF16_ROUNDED:
            out = torch.nn.functional.linear(x.bfloat16().float(), self.weight).bfloat16().float()
        else:
            out = torch.nn.functional.linear(x.float(), self.weight)
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias


def use_reference_linears(model: torch.nn.Module, name: str) -> None:
    """Swap every module the scheme would quantize for ReferenceLinear(s) of its quantized weight."""
    scheme = make_scheme(name, GROUP)

    def ref(w: torch.Tensor, bias: torch.Tensor | None) -> ReferenceLinear:
        return ReferenceLinear(effective_weight(scheme.quantize(w), name), bias, name)

    with torch.no_grad():
        for mod_name, module in list(model.named_modules()):
            if isinstance(module, Linear) and mod_name.rpartition(".")[2] in QUANTIZED_LINEARS:
                set_module(model, mod_name, ref(module.weight, module.bias))
            elif isinstance(module, SparseMoE):
                stacks = (module.experts.w13, module.experts.w2)
                module.experts = QuantizedMoE(*[[ref(w, None) for w in stack] for stack in stacks])
    model.post_load()


def quantized_module_count(model: torch.nn.Module) -> int:
    return sum(isinstance(m, (QuantLinear, QuantizedMoE)) for m in model.modules())


# ------------------------------------------------------------------------------------------------ quantized MoE

def make_quantized_experts(name: str, dtype=torch.float32, experts: int = 8, hidden: int = 64, inter: int = 32):
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)
    scheme = make_scheme(name, GROUP)
    q13, q2 = [scheme.quantize(w) for w in w13], [scheme.quantize(w) for w in w2]
    moe = quantized_experts(q13, q2, dtype, "cpu")
    deq13 = torch.stack([q.dequantize() for q in q13]).to(dtype)                # [E, 2I, H]
    deq2 = torch.stack([q.dequantize() for q in q2]).to(dtype)                  # [E, H, I]
    return moe, deq13, deq2


def assert_rel(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.numel():
        diff, scale = (out.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
        assert diff <= rel * scale, f"max abs diff {diff:.3e} > {rel:g} x {scale:.3e}"


@pytest.mark.parametrize("case", ["one token", "many tokens", "experts with zero tokens", "top-k ties"])
@pytest.mark.parametrize("name", ["int8", "int4", "mxfp4"])
def test_quantized_moe_equals_the_float_loop_on_dequantized_experts(name, case):
    moe, deq13, deq2 = make_quantized_experts(name)
    x, ids, weights = routing_cases()[case]
    x = torch.randn(x.shape[0], 64, generator=torch.Generator().manual_seed(2))     # H = 64 here
    ref = loop(x, deq13, deq2, ids, weights)
    rel = MOE_REL[torch.bfloat16 if name in BF16_ROUNDED else torch.float32]          # CPU int kernels: bf16
    assert_rel(moe(x, ids, weights), ref, rel)
    assert_rel(moe.forward_dense(x, ids, weights), moe(x, ids, weights), MOE_REL[torch.float32])


def test_quantized_moe_bf16_and_under_compile():
    """bf16 activations, and the sync-free path `torch.compile(fullgraph=True)` takes."""
    moe, deq13, deq2 = make_quantized_experts("int4", torch.bfloat16)
    x, ids, weights = make_batch(6, experts=8, hidden=64, dtype=torch.bfloat16)
    ref = LocalMoE(deq13, deq2, path="loop")(x, ids, weights)
    assert_rel(moe(x, ids, weights), ref, MOE_REL[torch.bfloat16])
    torch._dynamo.reset()
    assert_rel(torch.compile(moe, fullgraph=True)(x, ids, weights), ref, MOE_REL[torch.bfloat16])


def test_quantized_experts_refuse_mismatched_shapes():
    scheme = make_scheme("int8")
    with pytest.raises(ValueError, match=r"expert 0: w13 must be \[2I, H\] and w2 \[H, I\]"):
        quantized_experts([scheme.quantize(torch.randn(64, 32))], [scheme.quantize(torch.randn(32, 16))])


# ------------------------------------------------------------------------------------------------ whole models

@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_quantized_model_logits_equal_the_dequantized_model(tiny_checkpoint, arch, name):
    path = tiny_checkpoint(arch).path
    quantized, reference = make_runner(path, name), make_runner(path)
    layers = reference.spec.num_layers
    assert quantized_module_count(quantized.model) >= 3 * layers          # qkv, o and an MLP pair (or experts)
    assert isinstance(quantized.model.layers[0].attn.qkv, QuantLinear)
    assert not isinstance(quantized.model.layers[0].mlp, SparseMoE) or \
        isinstance(quantized.model.layers[0].mlp.router, Linear)         # routing stays float
    tokens = prompt(19, seed=3)
    float_logits = prefill_logits(reference, tokens)
    use_reference_linears(reference.model, name)
    ours, ref = prefill_logits(quantized, tokens), prefill_logits(reference, tokens)
    diff = (ours - ref).abs().max().item()
    assert diff <= (BF16_KERNEL_ATOL if name in BF16_ROUNDED else ATOL), f"{name}: max abs diff {diff:.2e}"
    assert (ours - float_logits).abs().max().item() > 10 * ATOL           # the weights really were quantized


def test_bf16_int4_model_stays_close_to_its_dequantized_model(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe").path
    quantized, reference = make_runner(path, "int4", "bfloat16"), make_runner(path, None, "bfloat16")
    use_reference_linears(reference.model, "int4")
    tokens = prompt(19, seed=4)
    ours, ref = prefill_logits(quantized, tokens), prefill_logits(reference, tokens)
    assert (ours - ref).abs().max().item() <= 0.1 * ref.abs().max().item()
    assert ours.argmax(-1).eq(ref.argmax(-1)).float().mean() >= 0.8


def test_fingerprints_differ_per_scheme(tiny_checkpoint):
    path = str(tiny_checkpoint("llama").path)
    prints = {q: load_model(ModelConfig(path, quantization=q, quant_group_size=GROUP)).fingerprint
              for q in [None, *SCHEMES]}
    assert [p.rsplit("/", 1)[1] for p in prints.values()] == ["none", "int8", "int4-g32", "fp8", "mxfp4"]
    assert len(set(prints.values())) == 5
    assert load_model(ModelConfig(path, quantization="int4", quant_group_size=64)).fingerprint.endswith("/int4-g64")


def test_compiled_decode_gives_the_eager_greedy_tokens_when_quantized(tiny_checkpoint):
    """The whole engine with the compiled decode step (int4 linears and int4 experts, the dense expert path in
    the graph) generates the eager engine's greedy tokens."""
    path = str(tiny_checkpoint("qwen3_moe").path)
    kw = dict(block_size=BLOCK, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32, quantization="int4",
              quant_group_size=GROUP)
    compiled, eager = LLM(path, enforce_eager=False, **kw), LLM(path, enforce_eager=True, **kw)
    assert compiled.engine.runner.compiled is not None
    prompts = [prompt(n, seed=n) for n in (5, 11)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a, b = compiled.generate(prompts, params), eager.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


# ------------------------------------------------------------------------------------ pre-quantized checkpoints

class RoundTripQuant(CheckpointQuant):
    """A stand-in checkpoint format: "stores" every attention/MLP/expert linear quantized with `scheme_name` by
    quantizing the float tensor on read, so the result must equal load-time quantization exactly."""

    def __init__(self, scheme_name: str, also: tuple[str, ...] = ()) -> None:
        self.scheme, self.name = scheme_name, f"roundtrip-{scheme_name}"
        self.quantizer = make_scheme(scheme_name, GROUP)
        self.read_prefixes: list[str] = []
        self.also = also                          # other prefixes (ends) it "stores" quantized: lm_head, gate

    def is_quantized(self, reader, hf_prefix: str) -> bool:
        return any(p in hf_prefix for p in ("_proj", "experts.")) or hf_prefix.endswith(("w1", "w2", "w3")) \
            or hf_prefix.endswith(self.also)

    def read(self, reader, hf_prefix: str):
        self.read_prefixes.append(hf_prefix)
        return self.quantizer.quantize(reader.get(f"{hf_prefix}.weight"))


@pytest.mark.parametrize("arch", ["qwen2", "mixtral"])
def test_prequantized_checkpoint_loads_the_same_modules_as_load_time_quantization(tiny_checkpoint, monkeypatch,
                                                                                arch):
    path = tiny_checkpoint(arch).path
    fake = RoundTripQuant("int8")
    monkeypatch.setattr(loader, "checkpoint_quantization", lambda config, source: fake)
    loaded = load_model(ModelConfig(str(path)))
    assert loaded.quantization == "roundtrip-int8"
    assert loaded.fingerprint.endswith("/none")   # the stand-in format is not declared in config.json
    assert "model.layers.0.self_attn.k_proj" in fake.read_prefixes
    monkeypatch.undo()
    runtime = make_runner(path, "int8")
    prequant = make_runner(path)                 # a float runner...
    prequant.model = loaded.model                # ...running the pre-quantized model in its place
    tokens = prompt(13, seed=5)
    assert torch.equal(prefill_logits(prequant, tokens), prefill_logits(runtime, tokens))


def test_a_quantization_other_than_the_checkpoints_is_refused(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(loader, "checkpoint_quantization", lambda config, source: RoundTripQuant("int4"))
    with pytest.raises(ValueError, match=r"quantization='fp8' differs from the checkpoint's own"):
        load_model(ModelConfig(str(tiny_checkpoint("llama").path), quantization="fp8"))
    assert load_model(ModelConfig(str(tiny_checkpoint("llama").path), quantization="int4",
                                  quant_group_size=GROUP)).quantization == "roundtrip-int4"


def use_checkpoint_references(model: torch.nn.Module, spec, folder, scheme: str) -> None:
    """Swap every linear (and MoE layer's experts) the quantized checkpoint in `folder` stores quantized for
    ReferenceLinears over what its format reader reads, one per HF part, outputs concatenated."""
    cq = formats.checkpoint_quantization(json.loads((folder / "config.json").read_text()), "config.json")
    reader, sources = SafetensorsReader(weight_files(folder)), weight_sources(spec)

    def ref(names: tuple[str, ...], bias: torch.Tensor | None, expert: int | None = None) -> ConcatLinear:
        prefixes = [(n if expert is None else n.format(e=expert)).removesuffix(".weight") for n in names]
        parts = [cq.read(reader, p) for p in prefixes]
        return ConcatLinear([ReferenceLinear(effective_weight(qw, scheme), None, scheme, getattr(qw, "perm", None))
                             for qw in parts], bias, torch.float32, "cpu")

    for name, module in list(model.named_modules()):
        if isinstance(module, Linear) and name.rpartition(".")[2] in QUANTIZED_LINEARS:
            set_module(model, name, ref(sources[f"{name}.weight"].names, module.bias))
        elif isinstance(module, Linear):                                     # router, shared_gate: float
            prefix = sources[f"{name}.weight"].names[0].removesuffix(".weight")
            if cq.is_quantized(reader, prefix):
                with torch.no_grad():
                    module.weight.copy_(cq.read(reader, prefix).dequantize())
        elif isinstance(module, SparseMoE):
            up, down = sources[f"{name}.experts.w13"], sources[f"{name}.experts.w2"]
            experts = range(module.experts.num_experts)
            module.experts = QuantizedMoE([ref(up.names, None, e) for e in experts],
                                          [ref(down.names, None, e) for e in experts])
    model.post_load()


def copy_tokenizer(src, dest) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dest / name)


def test_gptq_act_order_checkpoint_serves_the_formats_reference_weights(tiny_checkpoint, tmp_path):
    """A GPTQ v1 act-order checkpoint packed by the writer of tests/integration/test_quant_checkpoints.py loads
    through engine.quant.formats: q|k|v (one perm) become one Int4Linear, gate|up (written with two perms) a
    ConcatLinear, lm_head stays float; the logits are those of ReferenceLinears over the format's weights."""
    writers = pytest.importorskip("tests.integration.test_quant_checkpoints")
    tiny, dest = tiny_checkpoint("llama").path, tmp_path / "gptq"
    qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False}
    writers.write_quantized(tiny, dest, qc, lambda p, w: writers.gptq_pack(p, w, GROUP, seed=len(p)))
    copy_tokenizer(tiny, dest)
    quantized, reference = make_runner(dest), make_runner(tiny)
    assert quantized.fingerprint.endswith(f"/{quantization_label(None, 128, json.loads((dest / 'config.json').read_text()))}")
    assert quantized.fingerprint.rsplit("/", 1)[1].startswith("ckpt-gptq-")
    layer = quantized.model.layers[0]
    assert type(layer.attn.qkv) is Int4Linear and layer.attn.qkv.perm is not None
    assert type(layer.mlp.gate_up) is ConcatLinear and isinstance(quantized.model.lm_head, torch.nn.Parameter)
    use_checkpoint_references(reference.model, reference.spec, dest, "int4")
    tokens = prompt(17, seed=6)
    diff = (prefill_logits(quantized, tokens) - prefill_logits(reference, tokens)).abs().max().item()
    assert diff <= BF16_KERNEL_ATOL, f"max abs diff {diff:.2e}"


@pytest.mark.parametrize("arch, preset, scheme", [("qwen2_moe", "W4A16", "int4"), ("mixtral", "FP8_DYNAMIC", "fp8")])
def test_compressed_tensors_moe_checkpoint_serves_the_formats_reference_weights(tiny_checkpoint, tmp_path, arch,
                                                                                preset, scheme):
    """Checkpoints written by the compressed-tensors library: experts quantized; the Mixtral routers
    (`block_sparse_moe.gate`, which the recipe's "mlp.gate$" ignore misses) quantized too, and dequantized."""
    writers = pytest.importorskip("tests.integration.test_quant_checkpoints")
    tiny, dest = tiny_checkpoint(arch).path, tmp_path / arch
    writers.save_model_free(tiny, writers.SCHEMES[preset][0], dest)
    copy_tokenizer(tiny, dest)
    quantized, reference = make_runner(dest), make_runner(tiny)
    assert isinstance(quantized.model.layers[1].mlp.experts, QuantizedMoE)
    assert type(quantized.model.layers[1].mlp.router) is Linear                # routing stays float...
    assert quantized.model.layers[1].mlp.router.weight.abs().max() < 10         # ...fp8 ones dequantized
    use_checkpoint_references(reference.model, reference.spec, dest, scheme)
    tokens = prompt(17, seed=7)
    diff = (prefill_logits(quantized, tokens) - prefill_logits(reference, tokens)).abs().max().item()
    assert diff <= (BF16_KERNEL_ATOL if scheme == "int4" else ATOL), f"max abs diff {diff:.2e}"


def test_linears_kept_float_are_dequantized_when_the_checkpoint_quantized_them(tiny_checkpoint, monkeypatch):
    """lm_head and the MoE router stay float; a checkpoint that quantized them anyway loads their dequantization."""
    path = tiny_checkpoint("qwen2_moe").path
    fake = RoundTripQuant("int4", also=("lm_head", "mlp.gate"))
    monkeypatch.setattr(loader, "checkpoint_quantization", lambda config, source: fake)
    model = load_model(ModelConfig(str(path))).model
    assert {"lm_head", "model.layers.0.mlp.gate"} <= set(fake.read_prefixes)
    reader = SafetensorsReader(weight_files(path))
    for ours, theirs in ((model.lm_head, "lm_head"), (model.layers[0].mlp.router.weight, "model.layers.0.mlp.gate")):
        assert torch.equal(ours, fake.quantizer.quantize(reader.get(f"{theirs}.weight")).dequantize())


def test_a_quantized_tensor_is_never_copied_into_a_float_weight(tiny_checkpoint, tmp_path):
    """An fp8 tensor has the float weight's shape: without this check it would load without its scale."""
    src = tiny_checkpoint("llama").path
    dest = Path(shutil.copytree(src, tmp_path / "fp8_head"))
    tensors = load_file(str(dest / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TensorShapeError, match=r"'lm_head.weight' in model.safetensors has dtype torch.float8_e4m3fn"):
        load_model(ModelConfig(str(dest)))


def test_act_order_is_undone_when_a_float_weight_is_dequantized():
    base = make_scheme("int4", GROUP).quantize(torch.randn(16, 64))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    qw = IntWeight(base.q, base.scale, base.zero, GROUP, 4, perm)
    x = torch.randn(3, 64)
    assert torch.allclose(x @ in_input_order(qw).dequantize().T, x[:, perm] @ qw.dequantize().T, atol=1e-5)


def test_a_group_size_the_model_cannot_use_is_refused_naming_layer_and_field(tiny_checkpoint):
    path = str(tiny_checkpoint("llama").path)           # hidden size 64
    with pytest.raises(ValueError, match=r"quantizing layers.0.attn.qkv with int4-g128: int4: in_features 64 is "
                                         r"not a multiple of quant_group_size 128; use one of \[32, 64\]"):
        load_model(ModelConfig(path, quantization="int4", quant_group_size=128))
