"""Pipeline schedules as data: each rank's list of actions, and a simulator that checks
and times a set of lists without a process group.

A schedule is a pure function ``(P ranks, N micro-batches, rank) -> [Action]``. The
engines run the lists (``molds.engines.dualpipev`` runs any of them); ``molds-schedule``
prints and draws them; the tests check them here.

Actions (``Action.kind``), each tagged with a chunk (the model part a rank holds: one
per rank for 1F1B, two on the V: chunk 0 is stage ``rank``, chunk 1 is stage
``2P - 1 - rank``) and a micro-batch:

    F        forward
    B        full backward: input and weight gradients
    I        input-gradient-only backward; the weight gradients are queued, keyed by
             (chunk, micro-batch), for a later W
    W        the queued weight gradients of (chunk, micro-batch)
    FB       the forward of (chunk, mb) overlapped with the full backward of
             (b_chunk, b_mb): their stages interleave, so one's all-to-all is in flight
             while the other computes
    SEND_F / RECV_F   activations of (chunk, mb) to / from pipeline rank ``peer``
    SEND_B / RECV_B   input gradients of (chunk, mb) to / from ``peer``
    COMMIT   (DeepSpeed's stock schedule only) post the queued sends and receives as one
             batch and wait for all of them

Communication semantics of molds' lists: a send or receive is posted where it stands
and never blocks; a compute waits for the receives it consumes; the end of the list
waits for everything. On each ordered pair of ranks the receives are posted in the
order the sender posts its sends (NCCL matches point-to-point messages in order, and
so does gloo for one tag), so messages never cross. ``with_communication`` derives the
sends and receives from the compute order: a send right after the compute that
produces it, a receive one compute ahead of the one that consumes it (so the transfer
overlaps that compute).

The three schedules:
- ``onef1b_actions``: 1F1B on P stages (DeepSpeed's ``TrainSchedule`` order).
- ``stock_dualpipev_actions``: DeepSpeed 0.19.8's ``DualPipeVSchedule``, translated
  instruction by instruction from DeepSpeed's own generator: full backwards only, its
  weight step an empty commit, a forward and a backward one after the other.
- ``dualpipev_actions``: molds' DualPipeV, DeepSeek's order (as in DeepSeek's DualPipe
  and torch's ``ScheduleDualPipeV``): warm-up forwards, zero-bubble input-only backwards
  whose weight gradients fill the holes, steady overlapped F&B pairs, cool-down.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPUTE = ("F", "B", "I", "W", "FB")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    kind: str
    chunk: int = 0
    mb: int = 0
    b_chunk: int = -1  # FB: the backward half
    b_mb: int = -1
    peer: int = -1  # communication: the other pipeline rank

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"F{self.chunk}.{self.mb}&B{self.b_chunk}.{self.b_mb}"
        if self.kind in COMM:
            arrow = "->" if self.kind.startswith("SEND") else "<-"
            return f"{self.kind[:-2]}{self.kind[-1]}{self.chunk}.{self.mb}{arrow}{self.peer}"
        if self.kind == "COMMIT":
            return "COMMIT"
        return f"{self.kind}{self.chunk}.{self.mb}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def forwards(self) -> list[tuple[int, int]]:
        """(chunk, mb) of the forwards this action runs."""
        return [(self.chunk, self.mb)] if self.kind in ("F", "FB") else []

    def backwards(self) -> list[tuple[int, int]]:
        """(chunk, mb) of the (input-gradient) backwards this action runs."""
        if self.kind in ("B", "I"):
            return [(self.chunk, self.mb)]
        return [(self.b_chunk, self.b_mb)] if self.kind == "FB" else []


# ---------------------------------------------------------------- topology of a schedule

@dataclass(frozen=True)
class Layout:
    """Where the chunks sit: ``v`` (two per rank, the V) or one per rank (1F1B)."""

    ranks: int
    v: bool

    @property
    def chunks(self) -> int:
        return 2 if self.v else 1

    @property
    def stages(self) -> int:
        return 2 * self.ranks if self.v else self.ranks

    def stage(self, rank: int, chunk: int) -> int:
        return 2 * self.ranks - 1 - rank if chunk == 1 else rank

    def downstream(self, rank: int, chunk: int) -> int | None:
        """The rank the chunk's activations go to (None: the next stage is on this rank,
        or this is the last stage)."""
        nxt = self.stage(rank, chunk) + 1
        return self._owner(nxt, rank)

    def upstream(self, rank: int, chunk: int) -> int | None:
        """The rank the chunk's input gradients go to (None: this rank, or the first stage)."""
        prev = self.stage(rank, chunk) - 1
        return self._owner(prev, rank)

    def _owner(self, stage: int, rank: int) -> int | None:
        if stage < 0 or stage >= self.stages:
            return None
        owner = min(stage, self.stages - 1 - stage) if self.v else stage
        return None if owner == rank else owner

    def is_loss(self, rank: int, chunk: int) -> bool:
        return self.stage(rank, chunk) == self.stages - 1


# ---------------------------------------------------------------- the schedules

def _check_sizes(ranks: int, micro_batches: int, rank: int, need_2p: bool) -> None:
    if ranks < 1 or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of {ranks} pipeline ranks")
    if need_2p and micro_batches < 2 * ranks:
        raise ValueError(f"DualPipeV needs at least 2 x {ranks} pipeline ranks = {2 * ranks} micro-batches, "
                         f"got {micro_batches}")
    if micro_batches < 1:
        raise ValueError("at least one micro-batch")


def onef1b_compute(ranks: int, micro_batches: int, rank: int) -> list[Action]:
    """1F1B: ``P - rank - 1`` warm-up forwards, then one forward and one backward in turn."""
    _check_sizes(ranks, micro_batches, rank, False)
    warm = min(ranks - rank - 1, micro_batches)
    out = [Action("F", 0, m) for m in range(warm)]
    f = warm
    for b in range(micro_batches):
        if f < micro_batches:
            out.append(Action("F", 0, f))
            f += 1
        out.append(Action("B", 0, b))
    return out


def dualpipev_compute(ranks: int, micro_batches: int, rank: int) -> list[Action]:
    """molds' DualPipeV, DeepSeek's eight steps (P ranks, N >= 2P micro-batches):

    1 nF0     2(P-r-1) forwards of chunk 0 (warm-up)
    2 nF0F1   r+1 pairs: chunk 0 forward, chunk 1 forward
    3 nI1W1F1 P-r-1 times: chunk 1 input-only backward, a queued W, chunk 1 forward
    4 nF0B1F1B0  N-2P+r+1 times: F&B pairs (chunk 0 fwd with chunk 1 bwd, then chunk 1
                 fwd with chunk 0 bwd); on the last rank the first pair runs apart
    5 nB1F1B0 P-r-1 times: chunk 1 backward, an F&B pair
    6 nB1B0   r+1 backward pairs; from the middle on, input-only (zero bubble)
    7 nWB0    P-r-1 times: a queued W, a chunk 0 input-only backward
    8 nW      the remaining queued W
    """
    _check_sizes(ranks, micro_batches, rank, True)
    p, n, r = ranks, micro_batches, rank
    nxt = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    queued: list[tuple[int, int]] = []
    out: list[Action] = []

    def fwd(c):
        m = nxt[("F", c)]
        nxt[("F", c)] += 1
        out.append(Action("F", c, m))

    def bwd(c, zero_bubble=False):
        m = nxt[("B", c)]
        nxt[("B", c)] += 1
        out.append(Action("I" if zero_bubble else "B", c, m))
        if zero_bubble:
            queued.append((c, m))

    def weight():
        if queued:
            c, m = queued.pop(0)
            out.append(Action("W", c, m))

    def fwd_bwd(cf, cb):
        mf, mb = nxt[("F", cf)], nxt[("B", cb)]
        nxt[("F", cf)] += 1
        nxt[("B", cb)] += 1
        out.append(Action("FB", cf, mf, cb, mb))

    for _ in range(2 * (p - r - 1)):  # 1
        fwd(0)
    for _ in range(r + 1):  # 2
        fwd(0)
        fwd(1)
    for _ in range(p - r - 1):  # 3
        bwd(1, zero_bubble=True)
        weight()
        fwd(1)
    for i in range(n - 2 * p + r + 1):  # 4
        if i == 0 and r == p - 1:  # the turn: chunk 1's forward needs chunk 0's output here
            fwd(0)
            bwd(1)
        else:
            fwd_bwd(0, 1)
        fwd_bwd(1, 0)
    for _ in range(p - r - 1):  # 5
        bwd(1)
        fwd_bwd(1, 0)
    zero_bubble = False
    for i in range(r + 1):  # 6
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        bwd(1, zero_bubble)
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        bwd(0, zero_bubble)
    for _ in range(p - r - 1):  # 7
        weight()
        bwd(0, zero_bubble)
    while queued:  # 8
        weight()
    return out


def dualpipev_actions(ranks: int, micro_batches: int, rank: int, prefetch: int = 1) -> list[Action]:
    layout = Layout(ranks, v=True)
    every = [dualpipev_compute(ranks, micro_batches, r) for r in range(ranks)]
    return with_communication(every, layout, prefetch)[rank]


def onef1b_actions(ranks: int, micro_batches: int, rank: int, prefetch: int = 1) -> list[Action]:
    layout = Layout(ranks, v=False)
    every = [onef1b_compute(ranks, micro_batches, r) for r in range(ranks)]
    return with_communication(every, layout, prefetch)[rank]


def forward_only_actions(ranks: int, micro_batches: int, rank: int, v: bool = True) -> list[Action]:
    """Evaluation: every micro-batch through every stage, forwards only (any N >= 1)."""
    _check_sizes(ranks, micro_batches, rank, False)
    layout = Layout(ranks, v)
    every = []
    for r in range(ranks):
        every.append([Action("F", c, m) for m in range(micro_batches) for c in range(layout.chunks)])
    return with_communication(every, layout, prefetch=1)[rank]


def stock_dualpipev_actions(ranks: int, micro_batches: int, rank: int) -> list[Action]:
    """DeepSpeed 0.19.8's ``DualPipeVSchedule`` for this rank, translated from the
    instructions DeepSpeed itself generates (so the comparison is with the real thing)."""
    from deepspeed.runtime.pipe import schedule as ds  # here: molds-schedule --help loads no DeepSpeed

    _check_sizes(ranks, micro_batches, rank, True)
    layout = Layout(ranks, v=True)
    out = []
    for step in ds.DualPipeVSchedule(micro_batches=micro_batches, stages=ranks, stage_id=rank):
        for cmd in step:
            if isinstance(cmd, ds.CommitP2P):
                out.append(Action("COMMIT"))
                continue
            if not hasattr(cmd, "phase"):
                continue  # LoadMicroBatch, ReduceTiedGrads, ReduceGrads, OptimizerStep
            c, m = cmd.phase, cmd.buffer_id - cmd.phase * micro_batches
            if isinstance(cmd, ds.ForwardPass):
                out.append(Action("F", c, m))
            elif isinstance(cmd, ds.BackwardPass):
                out.append(Action("B", c, m))
            elif isinstance(cmd, ds.SendActivation):
                out.append(Action("SEND_F", c, m, peer=layout.downstream(rank, c)))
            elif isinstance(cmd, ds.RecvActivation):
                out.append(Action("RECV_F", c, m, peer=layout.upstream(rank, c)))
            elif isinstance(cmd, ds.SendGrad):
                out.append(Action("SEND_B", c, m, peer=layout.upstream(rank, c)))
            elif isinstance(cmd, ds.RecvGrad):
                out.append(Action("RECV_B", c, m, peer=layout.downstream(rank, c)))
            else:
                raise TypeError(f"unknown DeepSpeed instruction {cmd!r}")
    return out


SCHEDULES = {"1f1b": onef1b_actions, "stock_dualpipev": stock_dualpipev_actions, "dualpipev": dualpipev_actions}


def schedule_layout(name: str, ranks: int) -> Layout:
    return Layout(ranks, v=name != "1f1b")


# ---------------------------------------------------------------- communication

def _messages(action: Action, layout: Layout, rank: int):
    """What a compute action sends: [(kind, chunk, mb, peer)], and what it receives."""
    sends, recvs = [], []
    for c, m in action.forwards():
        down, up = layout.downstream(rank, c), layout.upstream(rank, c)
        if down is not None:
            sends.append(("F", c, m, down))
        if up is not None:
            recvs.append(("F", c, m, up))
    for c, m in action.backwards():
        down, up = layout.downstream(rank, c), layout.upstream(rank, c)
        if up is not None:
            sends.append(("B", c, m, up))
        if down is not None:
            recvs.append(("B", c, m, down))
    return sends, recvs


def with_communication(computes: list[list[Action]], layout: Layout, prefetch: int = 1) -> list[list[Action]]:
    """Every rank's compute list with its sends and receives placed (see the module
    docstring): sends right after their producer, receives ``prefetch`` computes ahead
    of their consumer and, per sender, in the sender's send order."""
    ranks = layout.ranks
    order: dict[tuple[int, int], list[tuple]] = {}  # (src, dst) -> messages in send order
    for src, acts in enumerate(computes):
        for a in acts:
            for kind, c, m, dst in _messages(a, layout, src)[0]:
                order.setdefault((src, dst), []).append((kind, c, m))
    out = []
    for rank in range(ranks):
        acts = computes[rank]
        posted = {src: 0 for src in range(ranks)}  # how many of src's messages to us are posted
        position = {(src, msg): i for (src, dst), msgs in order.items() if dst == rank for i, msg in enumerate(msgs)}
        mine: list[Action] = []
        for k, a in enumerate(acts):
            for ahead in acts[k:k + 1 + prefetch]:
                for kind, c, m, src in _messages(ahead, layout, rank)[1]:
                    key = (src, (kind, c, m))
                    if key not in position:
                        raise ValueError(f"rank {rank} needs {kind}{c}.{m} from rank {src}, which never sends it")
                    while posted[src] <= position[key]:
                        pk, pc, pm = order[(src, rank)][posted[src]]
                        mine.append(Action(f"RECV_{pk}", pc, pm, peer=src))
                        posted[src] += 1
            mine.append(a)
            for kind, c, m, dst in _messages(a, layout, rank)[0]:
                mine.append(Action(f"SEND_{kind}", c, m, peer=dst))
        out.append(mine)
    return out


# ---------------------------------------------------------------- checking and timing

class ScheduleError(AssertionError):
    pass


def check_counts(actions: list[Action], layout: Layout, micro_batches: int, rank: int) -> None:
    """N forwards and N backwards per chunk, every I's weight step exactly once and after
    it, every backward after its forward."""
    fwd, bwd, queued, done_w = set(), set(), set(), set()
    for a in actions:
        for key in a.forwards():
            if key in fwd:
                raise ScheduleError(f"rank {rank}: forward {key} twice")
            fwd.add(key)
        for key in a.backwards():
            if key not in fwd:
                raise ScheduleError(f"rank {rank}: backward {key} before its forward")
            if key in bwd:
                raise ScheduleError(f"rank {rank}: backward {key} twice")
            bwd.add(key)
        if a.kind == "I":
            queued.add((a.chunk, a.mb))
        if a.kind == "W":
            key = (a.chunk, a.mb)
            if key not in queued or key in done_w:
                raise ScheduleError(f"rank {rank}: W{key} without a pending input-only backward")
            done_w.add(key)
    want = {(c, m) for c in range(layout.chunks) for m in range(micro_batches)}
    if fwd != want or (bwd and bwd != want):
        raise ScheduleError(f"rank {rank}: forwards {sorted(want - fwd)} / backwards {sorted(want - bwd)} missing")
    if queued != done_w:
        raise ScheduleError(f"rank {rank}: weight steps missing for {sorted(queued - done_w)}")


@dataclass
class Timeline:
    """A simulated (or measured) run: per rank, (start, end, action) of each compute."""

    ranks: int
    spans: list[list[tuple[float, float, Action]]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((s[-1][1] for s in self.spans if s), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(e - s for s, e, _ in self.spans[rank])

    def idle(self, rank: int) -> float:
        return self.makespan - self.busy(rank)

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Idle time over the step's time: one rank's, or the mean over ranks."""
        span = self.makespan or 1.0
        if rank is not None:
            return self.idle(rank) / span
        return sum(self.idle(r) for r in range(self.ranks)) / (self.ranks * span)


def action_cost(a: Action, costs: dict, scale: float = 1.0, b_costs: dict | None = None) -> float:
    """Seconds of a compute action: ``costs`` gives F, B (full), I, W and optionally FB
    (default F + B: nothing hidden) for one chunk; ``scale`` for chunks twice as large
    (1F1B on P ranks holds 2P stages' work in P). An F&B pair whose backward half is another
    stage's (``b_costs``): that stage's B after this one's F, less the mean of what each
    stage's own pair hides."""
    if a.kind == "FB":
        if b_costs is not None and b_costs is not costs:
            hidden = [c["F"] + c["B"] - c.get("FB", c["F"] + c["B"]) for c in (costs, b_costs)]
            return scale * (costs["F"] + b_costs["B"] - sum(hidden) / 2)
        return scale * costs.get("FB", costs["F"] + costs["B"])
    return scale * costs[a.kind]


def simulate(lists: list[list[Action]], layout: Layout, costs: dict | None = None, scale: float = 1.0,
             latency: float = 0.0, stage_costs: list[dict] | None = None) -> Timeline:
    """Run every rank's list against the others under rendezvous semantics: a message is
    delivered when both its send and its receive are posted (the k-th send from a to b
    meets the k-th receive on b from a, and they must be the same message); a compute
    waits for the receives it consumes; ``COMMIT`` posts the queued operations and waits
    for all of them; the end of a list waits for everything. Raises ``ScheduleError`` on
    a crossed message or a deadlock; returns the timeline (compute spans per rank).
    ``stage_costs`` (one costs dict per stage of ``layout``, measured per stage) replaces
    ``costs`` and ``scale``: each action costs what its own stage does."""
    costs = costs or {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    ranks = layout.ranks
    if stage_costs is not None and len(stage_costs) != layout.stages:
        raise ValueError(f"stage_costs: {len(stage_costs)} entries for a layout of {layout.stages} stages")

    def cost(rank: int, a: Action) -> float:
        if stage_costs is None:
            return action_cost(a, costs, scale)
        own = stage_costs[layout.stage(rank, a.chunk)]
        return action_cost(a, own, 1.0, stage_costs[layout.stage(rank, a.b_chunk)] if a.kind == "FB" else None)

    commit_style = [any(a.kind == "COMMIT" for a in acts) for acts in lists]
    pc = [0] * ranks
    clock = [0.0] * ranks
    sends: dict[tuple[int, int], list] = {}  # (src, dst) -> [(msg, post time)]
    recvs: dict[tuple[int, int], list] = {}
    queued: list[list] = [[] for _ in range(ranks)]  # commit style: not yet posted
    outstanding: list[list] = [[] for _ in range(ranks)]  # posted, not waited: (pair, index, is_send)
    arrived: list[dict] = [dict() for _ in range(ranks)]  # rank -> msg -> (pair, index)
    timeline = Timeline(ranks, [[] for _ in range(ranks)])

    def post(rank, a, t):
        msg = (a.kind[-1], a.chunk, a.mb)
        if a.kind.startswith("SEND"):
            pair = (rank, a.peer)
            sends.setdefault(pair, []).append((msg, t))
            outstanding[rank].append((pair, len(sends[pair]) - 1, True))
        else:
            pair = (a.peer, rank)
            recvs.setdefault(pair, []).append((msg, t))
            index = len(recvs[pair]) - 1
            outstanding[rank].append((pair, index, False))
            arrived[rank][msg] = (pair, index)

    def done_at(pair, index):
        """When message ``index`` on ``pair`` is delivered, or None if a side is not posted."""
        s, r = sends.get(pair, []), recvs.get(pair, [])
        if index >= len(s) or index >= len(r):
            return None
        if s[index][0] != r[index][0]:
            raise ScheduleError(f"ranks {pair}: message {index} is sent as {s[index][0]} but received as "
                                f"{r[index][0]}")
        return max(s[index][1], r[index][1]) + latency

    progress = True
    while progress:
        progress = False
        for rank in range(ranks):
            acts = lists[rank]
            while pc[rank] < len(acts):
                a = acts[pc[rank]]
                if a.kind in COMM:
                    if commit_style[rank]:
                        queued[rank].append(a)
                    else:
                        post(rank, a, clock[rank])
                elif a.kind == "COMMIT":
                    for q in queued[rank]:
                        post(rank, q, clock[rank])
                    queued[rank] = []
                    times = [done_at(pair, i) for pair, i, _ in outstanding[rank]]
                    if any(t is None for t in times):
                        break
                    clock[rank] = max([clock[rank]] + times)
                    outstanding[rank] = []
                else:
                    if not commit_style[rank]:
                        needs = [arrived[rank].get((k, c, m)) for k, c, m, _ in _messages(a, layout, rank)[1]]
                        if any(n is None for n in needs):
                            raise ScheduleError(f"rank {rank}: {a} runs before its receive is posted")
                        times = [done_at(*n) for n in needs]
                        if any(t is None for t in times):
                            break
                        clock[rank] = max([clock[rank]] + times)
                    start = clock[rank]
                    clock[rank] += cost(rank, a)
                    timeline.spans[rank].append((start, clock[rank], a))
                pc[rank] += 1
                progress = True
    for rank in range(ranks):  # the end of the list waits for everything it posted
        if pc[rank] == len(lists[rank]):
            times = [done_at(pair, i) for pair, i, _ in outstanding[rank]]
            if any(t is None for t in times) or queued[rank]:
                pc[rank] = -1
    stuck = {r: str(lists[r][pc[r]]) if 0 <= pc[r] < len(lists[r]) else "end (unmatched messages)"
             for r in range(ranks) if pc[r] != len(lists[r])}
    if stuck:
        raise ScheduleError(f"deadlock: {stuck}")
    return timeline


def held_activations(actions: list[Action]) -> int:
    """The most (chunk, micro-batch) activations one rank's list holds at once, in chunks
    (1F1B's chunk is its whole stage; DualPipeV's is half of one).

    A forward keeps what its backward reads until that chunk's weight gradients are done:
    its full backward (B), or the W after its input-only backward (I), which keeps the
    products' inputs and output gradients (an upper bound: an I frees the rest). In an F&B
    pair the forward's activations grow while the backward's shrink, so the pair counts
    both at its peak."""
    held = peak = 0
    for a in actions:
        if a.kind == "F":
            held += 1
        elif a.kind == "FB":
            held += 1
            peak = max(peak, held)
            held -= 1
        elif a.kind in ("B", "W"):
            held -= 1
        peak = max(peak, held)
    return peak


def build(name: str, ranks: int, micro_batches: int) -> tuple[list[list[Action]], Layout]:
    """Every rank's list of schedule ``name`` (1f1b, stock_dualpipev, dualpipev)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r} ({', '.join(SCHEDULES)})")
    return [SCHEDULES[name](ranks, micro_batches, r) for r in range(ranks)], schedule_layout(name, ranks)


def formula_bubble(name: str, ranks: int, costs: dict) -> float:
    """The published bubble per rank, in the costs of one V chunk (model / 2P).
    1F1B on P ranks (each holding two V chunks' work): (P-1)(F+B) in its own chunks."""
    f, b, w = costs["F"], costs["B"], costs["W"]
    fb = costs.get("FB", f + b)
    if name == "1f1b":
        return (ranks - 1) * 2 * (f + b)
    if name == "dualpipev":
        return (ranks - 1) * (fb + b - 3 * w)
    raise ValueError(name)
