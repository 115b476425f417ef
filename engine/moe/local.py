"""`LocalMoE`: every expert on this process, run by one of the paths in `paths.py` (or the Triton kernels of
`triton_moe.py` on CUDA), picked per call by `plan.choose_path` from the batch's shape:

- under `torch.compile` (the compiled decode step) only paths with no host sync and static shapes qualify;
- eager calls may also take the per-expert loop where it measured fastest.
"""
from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.moe.backend import MoEBackend, register_moe_backend
from engine.moe.paths import PATHS, grouped_mm, grouped_mm_supported, silu_and_mul
from engine.moe.plan import MoEShape, choose_path
from engine.moe.triton_moe import fused_moe_op, triton_available

PATH_NAMES = (*PATHS, "triton")


class LocalMoE(MoEBackend):
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, path: str | None = None) -> None:
        """`path` forces one path (tests, benchmarks); None picks one per call by shape (`plan.py`)."""
        super().__init__(w13, w2)
        if path is not None and path not in PATH_NAMES:
            raise ValueError(f"moe path {path!r} is unknown; use one of {PATH_NAMES} or None (by shape)")
        self.path = path

    @property
    def shape(self) -> MoEShape:
        return MoEShape(self.num_experts, self.w2.shape[1], self.w2.shape[2])

    def choose(self, x: torch.Tensor, top_k: int, compiling: bool | None = None) -> str:
        """The path `forward` runs for x `[T, H]`; `compiling` defaults to whether torch.compile is tracing."""
        compiling = torch.compiler.is_compiling() if compiling is None else compiling
        return choose_path(self.shape, x.shape[0], top_k, x.dtype, x.is_cuda and triton_available(), compiling,
                           grouped_mm_supported(x, self.w13, self.w2), self.cpu_kernel_ok(x))

    def cpu_kernel_ok(self, x: torch.Tensor) -> bool:
        """Whether Strata's CPU MoE kernel takes x with these weights (engine/cpu_kernels)."""
        return cpu_kernels.usable(x, self.w13, self.w2)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.run(self.path or self.choose(x, topk_ids.shape[1]), x, topk_ids, topk_weights.to(x.dtype))

    def run(self, path: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if path == "triton":
            return fused_moe_op(x, self.w13, self.w2, topk_ids, topk_weights)
        return PATHS[path](x, self.w13, self.w2, topk_ids, topk_weights)

    def run_pairs(self, x: torch.Tensor, row: torch.Tensor, slot: torch.Tensor,
                  weight: torch.Tensor) -> torch.Tensor:
        """Rows `x [R, H]` and (row, expert slot, weight) pairs `[P]` each -> `[R, H]`: each row's weighted sum over
        its pairs (an expert-parallel rank's arrivals: a row may have several of this rank's experts, or none).
        The grouped path gathers each pair's row once, already sorted by expert; other paths run pairs as tokens."""
        pairs = slot.numel()
        out = x.new_zeros(x.shape)                                                 # [R, H]
        path = self.path or choose_path(self.shape, pairs, 1, x.dtype, x.is_cuda and triton_available(), False,
                                        grouped_mm_supported(x, self.w13, self.w2), self.cpu_kernel_ok(x))
        if path != "grouped":
            return out.index_add_(0, row, self.run(path, x[row], slot.unsqueeze(1), weight.unsqueeze(1)))
        order = torch.argsort(slot, stable=True)                                   # [P] pairs by expert
        rows = row[order]
        ends = torch.searchsorted(slot[order], torch.arange(self.num_experts, device=x.device),
                                  right=True).to(torch.int32)                      # [E] end of each group
        act = silu_and_mul(grouped_mm(x[rows], self.w13.transpose(1, 2), ends))   # [P, I]
        y = grouped_mm(act, self.w2.transpose(1, 2), ends) * weight[order].unsqueeze(-1)   # [P, H]
        return out.index_add_(0, rows, y)

    def forward_gather(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.run("gather", x, topk_ids, topk_weights)

    def forward_grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        path = "grouped" if grouped_mm_supported(x, self.w13, self.w2) else "loop"
        return self.run(path, x, topk_ids, topk_weights)


register_moe_backend("local", lambda w13, w2, setup: LocalMoE(w13, w2))
