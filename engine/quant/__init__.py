"""Quantization: weight schemes applied at load time (a module swap, never a fork of a model file), pre-quantized
checkpoint formats, and the kernels that run them. `packed.py` holds the format-neutral quantized weights every
scheme and checkpoint reader meets in."""
