"""Quantization: weight schemes applied at load time (a module swap, never a fork of a model file), pre-quantized
checkpoint formats, and the kernels that run them.

    packed.py          the format-neutral quantized weights (IntWeight, Fp8Weight, Mxfp4Weight) all parts meet in
    schemes/           float weight -> QuantizedWeight, one file per scheme, registry keyed by `--quantization`
    formats/           pre-quantized checkpoints (compressed-tensors, GPTQ, AWQ) -> QuantizedWeight
    linear.py          QuantizedWeight -> the module that runs it (drop-in for engine.models.layers.Linear)
    kernels.py         the matmul each module runs, per device; dequant_tables.py: CPU byte-code lookups
    triton_gemm.py     Triton int4 / MXFP4 matmuls (CUDA)
    moe.py             quantized MoE experts (a MoEBackend)
    apply.py           the load-time hook: quantize a loaded float model's linears and experts
    prequantized.py    load a pre-quantized checkpoint's linears into quantized modules
"""
