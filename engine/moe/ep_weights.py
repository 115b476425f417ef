"""Moving experts between the ranks of an expert-parallel layer (EPLB), while serving.

Every rank computes the same new placement (from the same all-reduced load), so every rank knows, without asking,
which experts it sends to whom and receives from whom (`ExpertPlacement.moved_from`). One uneven all-to-all per layer
moves them, an expert's tensors as one row of bytes: `w13` and `w2` of a float expert, or the state (packed weights,
scales, zero points) of its two quantized linears, which have the same layout for every expert of a layer.

    sends to rank j:     the moves with src == me, dst == j, in the order of their destination slot
    receives from j:     the moves with src == j, dst == me, in the same order (so both sides agree row by row)
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from engine.moe.backend import MoEBackend
from engine.moe.ep_group import EPGroup
from engine.moe.local import LocalMoE
from engine.moe.placement import ExpertPlacement


def exchange_experts(group: EPGroup, old: ExpertPlacement, new: ExpertPlacement,
                     inner: MoEBackend) -> tuple[MoEBackend, int]:
    """This rank's executor under `old` -> (its executor under `new`, how many experts arrived from other ranks).
    A collective: every rank calls it with the same placements."""
    me, world = group.rank, group.world_size
    moves = new.moved_from(old)
    sends = sorted((m for m in moves if m.src_rank == me and m.dst_rank != me),
                   key=lambda m: (m.dst_rank, m.dst_local_slot))
    recvs = sorted((m for m in moves if m.dst_rank == me and m.src_rank != me),
                   key=lambda m: (m.src_rank, m.dst_local_slot))
    template = expert_tensors(inner, 0)
    width = sum(t.numel() * t.element_size() for t in template)
    wire = torch.stack([_to_row(expert_tensors(inner, m.src_local_slot)) for m in sends]) if sends else \
        torch.empty(0, width, dtype=torch.uint8, device=template[0].device)       # [n, bytes]
    send_rows = [sum(m.dst_rank == j for m in sends) for j in range(world)]
    recv_rows = [sum(m.src_rank == j for m in recvs) for j in range(world)]
    arrived = group.all_to_all_uneven(wire, send_rows, recv_rows)                 # [sum(recv_rows), bytes]
    row_of = {(m.src_rank, m.dst_local_slot): i for i, m in enumerate(recvs)}
    sources: list[int | list[torch.Tensor] | None] = [None] * new.slots_per_rank  # a local slot, or arrived tensors
    for m in moves:
        if m.dst_rank == me:
            sources[m.dst_local_slot] = m.src_local_slot if m.src_rank == me else \
                _from_row(arrived[row_of[(m.src_rank, m.dst_local_slot)]], template)
    return _rebuild(inner, sources), len(recvs)


def expert_tensors(inner: MoEBackend, slot: int) -> list[torch.Tensor]:
    """The tensors that make up one expert slot of a local executor, in a fixed order."""
    if isinstance(inner, LocalMoE):
        return [inner.w13[slot].detach(), inner.w2[slot].detach()]
    return [t for m in (inner.w13[slot], inner.w2[slot]) for t in m.state_dict().values()]   # QuantizedMoE


def _to_row(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])          # [bytes]


def _from_row(row: torch.Tensor, template: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in template:
        size = t.numel() * t.element_size()
        out.append(row[at:at + size].clone().view(t.dtype).view(t.shape))
        at += size
    return out


def _rebuild(inner: MoEBackend, sources: list) -> MoEBackend:
    """The executor over the new slots; an empty slot (None) is zeros (float) or a copy of slot 0 (quantized):
    no pair is ever routed to it."""
    if isinstance(inner, LocalMoE):
        w13, w2 = inner.w13.detach(), inner.w2.detach()
        new13, new2 = w13.new_zeros(len(sources), *w13.shape[1:]), w2.new_zeros(len(sources), *w2.shape[1:])
        for slot, src in enumerate(sources):
            if isinstance(src, int):
                new13[slot], new2[slot] = w13[src], w2[src]
            elif src is not None:
                new13[slot], new2[slot] = src
        return LocalMoE(new13, new2, path=inner.path)
    ups, downs = [], []
    for src in sources:
        up, down = _quantized_pair(inner, src)
        ups.append(up)
        downs.append(down)
    return type(inner)(ups, downs)


def _quantized_pair(inner: MoEBackend, src: int | list[torch.Tensor] | None) -> tuple[nn.Module, nn.Module]:
    if isinstance(src, int):
        return inner.w13[src], inner.w2[src]
    up, down = copy.deepcopy(inner.w13[0]), copy.deepcopy(inner.w2[0])
    if src is not None:
        n_up = len(up.state_dict())
        up.load_state_dict(dict(zip(up.state_dict(), src[:n_up])))
        down.load_state_dict(dict(zip(down.state_dict(), src[n_up:])))
    return up, down
