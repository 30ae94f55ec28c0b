"""Every rank's ordered communication replayed under NCCL's rules: does the step finish, or where does it hang?

gloo buffers sends, so a CPU run finishes orders that hang on NCCL. The replay takes each rank's
recorded trace (:class:`~parallel_runtime.diagnostics.fake_world.CommTrace`) and executes it as NCCL
would (NVIDIA/nccl issues 479, 783; PyTorch's ProcessGroupNCCL):

* **communicators and streams**: a collective, or a ``batch_isend_irecv`` batch, runs on its process
  group's communicator; an unbatched send or receive on the pair communicator of its two ranks in that
  group. Each communicator has one stream per rank, which runs its items in the order they were posted.
* **point-to-point**: a send completes only together with its receive (the n-th send from a to b on a
  communicator meets the n-th receive at b from a); NCCL has no tags.
* **batches**: the ops of one ``batch_isend_irecv`` form one NCCL group: they start together and the
  batch leaves its stream when every op in it has met its partner.
* **collectives**: complete when they head the stream of every member (the n-th collective on a
  communicator meets the n-th of every member: same kind and size, else a *mismatched collective*).
* **the compute stream**: an op starts only after every op its rank waited on before posting it
  (``work.wait()`` makes the compute stream wait, and the next op is queued behind the compute
  stream); a device synchronize makes everything posted before it a dependency of what follows.

The replay reports the ranks and ops at the heads of the blocked streams when nothing can progress
(a deadlock), or the mismatched collectives, or that every op completed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from parallel_runtime.diagnostics.fake_world import CommOp, CommTrace

P2P = ("send", "recv")


@dataclass(eq=False)
class _Item:
    """One unit on a stream: a collective, a batch of point-to-point ops, or one unbatched op."""

    rank: int
    key: tuple  # the communicator (stream) it runs on
    ops: list[CommOp]
    after: int  # it waits for the first ``after`` entries of its rank's waited list
    done: bool = False
    met: set[int] = field(default_factory=set)  # op indices (of this rank) that met their partner

    @property
    def collective(self) -> bool:
        return self.ops[0].kind not in P2P


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """What the replay found."""

    ok: bool
    ops: int  # communication ops over all ranks
    completed: int  # ops that completed
    deadlock: tuple[str, ...] = ()  # the blocked ranks and the ops they are stuck in (empty when none)
    mismatched: tuple[str, ...] = ()  # collectives whose members disagree (empty when none)
    communicators: dict[int, int] = field(default_factory=dict)  # rank -> NCCL communicators it uses

    def summary(self) -> str:
        if self.ok:
            return f"replay: all {self.ops} communication ops of every rank complete under NCCL's rules"
        what = "mismatched collectives" if self.mismatched else "deadlock"
        lines = [f"replay: {what}: {self.completed} of {self.ops} ops complete, then nothing can progress"]
        return "\n".join(lines + [f"  {x}" for x in (self.mismatched or self.deadlock)])


def _key(rank: int, op: CommOp) -> tuple:
    if op.kind in P2P and op.batch < 0:  # unbatched point-to-point: the pair's own communicator
        return ("pair", op.comm, min(rank, op.peer), max(rank, op.peer))
    return ("comm", op.comm)


def human_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _describe(rank: int, op: CommOp) -> str:
    size = human_bytes(op.nbytes)
    where = f"on {op.comm}" if len(op.group) > 2 or op.kind not in P2P else ""
    what = {"send": f"send {size} to {op.peer}", "recv": f"recv {size} from {op.peer}"}.get(
        op.kind, f"{op.kind} {size} over {len(op.group)} ranks")
    batch = " (batched)" if op.batch >= 0 else ""
    return f"{what}{batch} {where} [#{op.index}{', ' + op.phase if op.phase else ''}]".replace("  ", " ")


class _Replay:
    def __init__(self, traces: list[CommTrace]) -> None:
        self.items: dict[int, list[_Item]] = {}
        self.streams: dict[tuple[int, tuple], list[_Item]] = defaultdict(list)
        self.head: dict[tuple[int, tuple], int] = defaultdict(int)
        self.waited: dict[int, list[_Item]] = {}
        self.wdone: dict[int, int] = {}
        self.item_of: dict[tuple[int, int], _Item] = {}  # (rank, op index) -> item
        self.partner: dict[tuple[int, int], tuple[int, int]] = {}  # (rank, op) -> (peer, op) for p2p
        self.colls: dict[tuple, list[_Item]] = {}  # ("comm", label) and n -> the members' n-th collectives
        self.unmatched: list[str] = []
        for tr in traces:
            self._load(tr)
        self._match(traces)

    def _load(self, tr: CommTrace) -> None:
        r = tr.rank
        items: list[_Item] = []
        waited: list[_Item] = []
        last: _Item | None = None
        for kind, x in tr.events:
            if kind == "op":
                op: CommOp = x
                if last is not None and op.batch >= 0 and last.ops[0].batch == op.batch:
                    last.ops.append(op)  # the same batch_isend_irecv: one group call
                else:
                    last = _Item(rank=r, key=_key(r, op), ops=[op], after=len(waited))
                    items.append(last)
                    self.streams[(r, last.key)].append(last)
                self.item_of[(r, op.index)] = last
            elif kind == "wait":
                for i in x:
                    it = self.item_of[(r, i)]
                    if not waited or waited[-1] is not it:
                        waited.append(it)
                last = None
            else:  # a device synchronize: everything posted so far comes before what follows
                waited.extend(items)
                last = None
        self.items[r], self.waited[r], self.wdone[r] = items, waited, 0

    def _match(self, traces: list[CommTrace]) -> None:
        sends: dict[tuple, list[tuple[int, CommOp]]] = defaultdict(list)
        recvs: dict[tuple, list[tuple[int, CommOp]]] = defaultdict(list)
        coll_seq: dict[tuple, list[_Item]] = defaultdict(list)
        for tr in traces:
            r = tr.rank
            per_comm: dict[tuple, int] = defaultdict(int)
            for it in self.items[r]:
                if it.collective:
                    n = per_comm[it.key]
                    per_comm[it.key] += 1
                    coll_seq[(it.key, n)].append(it)
                    continue
                for op in it.ops:
                    k = _key(r, op)
                    if op.kind == "send":
                        sends[(k, r, op.peer)].append((r, op))
                    else:
                        recvs[(k, op.peer, r)].append((r, op))
        for k in set(sends) | set(recvs):
            s, v = sends.get(k, []), recvs.get(k, [])
            for (a, so), (b, ro) in zip(s, v):
                self.partner[(a, so.index)] = (b, ro.index)
                self.partner[(b, ro.index)] = (a, so.index)
            for r, op in (s[len(v):] if len(s) > len(v) else v[len(s):]):
                self.unmatched.append(f"rank {r}: {_describe(r, op)} has no matching "
                                      f"{'receive' if op.kind == 'send' else 'send'} on rank {op.peer}")
        self.colls = dict(coll_seq)
        self.coll_index = {id(it): (key, n) for (key, n), its in self.colls.items() for it in its}

    # ---- progress ---------------------------------------------------------------------------------
    def _ready(self, it: _Item) -> bool:
        if it.done:
            return False
        stream = self.streams[(it.rank, it.key)]
        if stream[self.head[(it.rank, it.key)]] is not it:
            return False
        w, d = self.waited[it.rank], self.wdone[it.rank]
        while d < len(w) and w[d].done:
            d += 1
        self.wdone[it.rank] = d
        return d >= it.after

    def _finish(self, it: _Item) -> None:
        it.done = True
        sk = (it.rank, it.key)
        stream = self.streams[sk]
        h = self.head[sk]
        while h < len(stream) and stream[h].done:
            h += 1
        self.head[sk] = h

    def _heads(self, r: int) -> list[_Item]:
        out = []
        for (rank, key), stream in self.streams.items():
            if rank == r and self.head[(rank, key)] < len(stream):
                out.append(stream[self.head[(rank, key)]])
        return out

    def run(self) -> tuple[int, list[str]]:
        """Complete what can complete; returns the completed op count and the mismatched collectives."""
        by_rank: dict[int, list[tuple[int, tuple]]] = defaultdict(list)
        for r, key in self.streams:
            by_rank[r].append((r, key))
        mismatched: list[str] = []
        dirty = set(self.items)
        while dirty:
            r = dirty.pop()
            for sk in by_rank[r]:
                while self.head[sk] < len(self.streams[sk]):
                    it = self.streams[sk][self.head[sk]]
                    if not self._ready(it):
                        break
                    touched = self._collective(it, mismatched) if it.collective else self._p2p(it)
                    if touched is None:
                        break
                    dirty |= touched
                    if not it.done:
                        break
        done = sum(len(it.ops) for items in self.items.values() for it in items if it.done)
        return done, mismatched

    def _collective(self, it: _Item, mismatched: list[str]) -> set[int] | None:
        members = self.colls.get(self.coll_index[id(it)], [])
        group = it.ops[0].group
        if len(members) < len(group) or not all(self._ready(m) for m in members):
            return None
        sig = {(m.ops[0].kind, m.ops[0].nbytes if m.ops[0].kind in ("all_reduce", "all_gather", "broadcast")
                else 0) for m in members}
        if len(sig) > 1:
            mismatched.append(f"{it.ops[0].comm}: " + "; ".join(f"rank {m.rank} {_describe(m.rank, m.ops[0])}"
                                                                 for m in members[:6]))
            return None
        for m in members:
            self._finish(m)
        return {m.rank for m in members}

    def _p2p(self, it: _Item) -> set[int] | None:
        touched: set[int] = set()
        for op in it.ops:
            if op.index in it.met:
                continue
            p = self.partner.get((it.rank, op.index))
            if p is None:
                continue
            other = self.item_of[p]
            if not self._ready(other):
                continue
            it.met.add(op.index)
            other.met.add(p[1])
            touched.add(other.rank)
            if len(other.met) == len(other.ops):
                self._finish(other)
        if len(it.met) == len(it.ops):
            self._finish(it)
            touched.add(it.rank)
        return touched or None

    def blocked(self, limit: int = 12) -> list[str]:
        """The ranks whose streams cannot move, with the op at each head and what it waits for."""
        out = []
        for r in sorted(self.items):
            heads = [h for h in self._heads(r) if not h.done]
            if not heads:
                continue
            parts = []
            for h in heads[:3]:
                op = next((o for o in h.ops if o.index not in h.met), h.ops[0])
                why = ""
                if not self._ready(h):
                    w = self.waited[r]
                    d = self.wdone[r]
                    why = (f" (queued behind its wait on {_describe(r, w[d].ops[0])})" if d < h.after
                           else "")
                elif op.kind in P2P:
                    p = self.partner.get((r, op.index))
                    if p is not None:
                        other = self.item_of[p]
                        ahead = self.streams[(other.rank, other.key)][self.head[(other.rank, other.key)]]
                        why = (f" waits for rank {p[0]}, whose matching op is queued behind "
                               f"{_describe(ahead.rank, ahead.ops[0])}" if ahead is not other else
                               f" waits for rank {p[0]}, whose matching op waits for its compute stream")
                else:
                    members = self.colls.get(self.coll_index[id(h)], [])
                    late = sorted(set(op.group) - {m.rank for m in members if self._ready(m)})
                    why = f" waits for ranks {late[:8]}{'...' if len(late) > 8 else ''}"
                parts.append(f"{_describe(r, op)}{why}")
            out.append(f"rank {r}: " + " | ".join(parts))
            if len(out) >= limit:
                out.append("...")
                break
        return out


def communicators(traces: list[CommTrace]) -> dict[int, int]:
    """NCCL communicators each rank uses (group communicators and the pair communicators of unbatched
    point-to-point ops): each holds device buffers of its own for the rest of the run."""
    return {tr.rank: len({_key(tr.rank, op) for op in tr.ops}) for tr in traces}


def replay(traces: list[CommTrace]) -> ReplayResult:
    """Replay every rank's trace (one per rank of the world) under NCCL's rules."""
    rp = _Replay(traces)
    done, mismatched = rp.run()
    total = sum(len(tr.ops) for tr in traces)
    ok = done == total and not mismatched and not rp.unmatched
    deadlock = () if ok or mismatched else tuple(rp.unmatched[:6] + rp.blocked())
    return ReplayResult(ok=ok, ops=total, completed=done, deadlock=deadlock, mismatched=tuple(mismatched[:8]),
                        communicators=communicators(traces))
