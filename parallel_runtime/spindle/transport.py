"""Moving a Spindle step's tensors between ranks: activation pieces forward, their gradients back,
and the gradient all-reduce. The schedule (which entry runs when) is :mod:`.execute`'s.

Every transfer is point-to-point with shapes known from the plan on both sides (a move of
``n`` samples carries ``[n, tokens, hidden]``), so there is no shape handshake. A wave's
receives and sends go out as one ``batch_isend_irecv`` (one NCCL group: on NCCL a send completes
only when its receive is posted, and separate calls of two ranks that both send first block each
other), so no pair of ranks can block each other whatever order their moves are listed in. Receive
buffers are made on the device and in the dtype of the tensors sent. A move whose both ends are this
rank is a local copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from parallel_runtime.spindle.exec_plan import EntryKey, Move

Transfer = tuple[torch.Tensor, int, int]  # (tensor, peer rank, tag)


def exchange(sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
    """Every receive and send of a wave in one batch, then wait for all."""
    ops = [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in recvs]
    ops += [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sends]
    for r in dist.batch_isend_irecv(ops) if ops else []:
        r.wait()


def send_activations(moves: Sequence[Move], rank: int, outputs: Mapping[EntryKey, torch.Tensor],
                     lane_start: Callable[[EntryKey], int], sample_shape: tuple[int, ...], *,
                     like: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """Forward: carry out this rank's ends of ``moves``; returns the pieces it received, by move tag.

    ``outputs[e]`` is this rank's lane output of entry ``e`` (``[lane samples, *sample_shape]``,
    its first sample being sample ``lane_start(e)`` of the entry's batch). Every returned piece
    (``[m.stop - m.start, *sample_shape]``) is a fresh tensor, so it can be an autograd leaf of the
    receiving wave's graph: waves are independent graphs joined only by :func:`return_gradients`.
    ``like``: a tensor whose device and dtype the received pieces take (default: any output here, else CPU fp32).
    """
    kw = _like(like if like is not None else next(iter(outputs.values()), None))
    pieces: dict[int, torch.Tensor] = {}
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    for m in moves:
        if m.src == rank:
            first = lane_start(m.src_entry)
            piece = outputs[m.src_entry].detach()[m.start - first:m.stop - first]
            if m.dst == rank:
                pieces[m.tag] = piece.clone()
            else:
                sends.append((piece.contiguous(), m.dst, m.tag))
        elif m.dst == rank:
            pieces[m.tag] = torch.empty((m.stop - m.start, *sample_shape), **kw)
            recvs.append((pieces[m.tag], m.src, m.tag))
    exchange(sends, recvs)
    return pieces


def return_gradients(moves: Sequence[Move], rank: int, pieces: Mapping[int, torch.Tensor], tag_offset: int,
                     sample_shape: tuple[int, ...], *,
                     like: torch.Tensor | None = None) -> list[tuple[Move, torch.Tensor]]:
    """Backward: send each received piece's gradient back along its move (tag ``m.tag + tag_offset``);
    returns the gradients that arrive at this rank as a producer, ``(move, [samples, *sample_shape])``.

    A piece no one used has no gradient and sends zeros, so the producer always gets one message per move.
    ``like``: as in :func:`send_activations` (default: any piece here, else CPU fp32).
    """
    kw = _like(like if like is not None else next(iter(pieces.values()), None))
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    arrived: list[tuple[Move, torch.Tensor]] = []
    for m in moves:
        back = m.tag + tag_offset
        if m.dst == rank:
            g = pieces[m.tag].grad
            g = torch.zeros_like(pieces[m.tag]) if g is None else g
            if m.src == rank:
                arrived.append((m, g))
            else:
                sends.append((g.contiguous(), m.src, back))
        elif m.src == rank:
            buf = torch.empty((m.stop - m.start, *sample_shape), **kw)
            recvs.append((buf, m.dst, back))
            arrived.append((m, buf))
    exchange(sends, recvs)
    return arrived


def _like(t: torch.Tensor | None) -> dict:
    return {} if t is None else {"dtype": t.dtype, "device": t.device}


def all_reduce_grads(params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, size: int) -> None:
    """Sum the gradients of ``params`` over a group of ``size`` ranks in one flat buffer (missing ones as zeros)."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    if size > 1:
        dist.all_reduce(flat, group=group)
    off = 0
    for p in params:
        p.grad = flat[off:off + p.numel()].view_as(p).clone()
        off += p.numel()
