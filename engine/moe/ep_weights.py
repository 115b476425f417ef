"""Moving experts between the ranks of an expert-parallel layer (EPLB), while serving.

Every rank computes the same new placement (from the same all-reduced load), so every rank knows, without asking,
which experts it sends to whom and receives from whom (`ExpertPlacement.moved_from`). One uneven all-to-all per layer
moves them: an expert's `w13` and `w2` rows flattened into one row of the wire.

    sends to rank j:     the moves with src == me, dst == j, in the order of their destination slot
    receives from j:     the moves with src == j, dst == me, in the same order (so both sides agree row by row)
"""
from __future__ import annotations

import torch

from engine.moe.ep_group import EPGroup
from engine.moe.placement import ExpertPlacement


def exchange_experts(group: EPGroup, old: ExpertPlacement, new: ExpertPlacement, w13: torch.Tensor,
                     w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's slot stacks `w13 [S, 2I, H]`, `w2 [S, H, I]` under `old` -> (the stacks under `new`, how many
    experts arrived from other ranks). A collective: every rank calls it with the same placements."""
    me, world = group.rank, group.world_size
    moves = new.moved_from(old)
    sends = sorted((m for m in moves if m.src_rank == me and m.dst_rank != me),
                   key=lambda m: (m.dst_rank, m.dst_local_slot))
    recvs = sorted((m for m in moves if m.dst_rank == me and m.src_rank != me),
                   key=lambda m: (m.src_rank, m.dst_local_slot))
    n13 = w13[0].numel()
    wire = torch.stack([torch.cat([w13[m.src_local_slot].reshape(-1), w2[m.src_local_slot].reshape(-1)])
                        for m in sends]) if sends else w13.new_empty(0, n13 + w2[0].numel())   # [n, D]
    send_rows = [sum(m.dst_rank == j for m in sends) for j in range(world)]
    recv_rows = [sum(m.src_rank == j for m in recvs) for j in range(world)]
    arrived = group.all_to_all_uneven(wire, send_rows, recv_rows)                 # [sum(recv_rows), D]
    slots = new.slots_per_rank
    new13, new2 = w13.new_zeros(slots, *w13.shape[1:]), w2.new_zeros(slots, *w2.shape[1:])
    row_of = {(m.src_rank, m.dst_local_slot): i for i, m in enumerate(recvs)}
    for m in moves:
        if m.dst_rank != me:
            continue
        if m.src_rank == me:
            new13[m.dst_local_slot], new2[m.dst_local_slot] = w13[m.src_local_slot], w2[m.src_local_slot]
        else:
            flat = arrived[row_of[(m.src_rank, m.dst_local_slot)]]
            new13[m.dst_local_slot] = flat[:n13].view(w13.shape[1:])
            new2[m.dst_local_slot] = flat[n13:].view(w2.shape[1:])
    return new13, new2, len(recvs)
