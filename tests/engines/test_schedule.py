"""Pipeline schedules as data (molds.engines.schedule), checked without a process group:
per rank N forwards and N backwards per chunk, a W for each input-only backward, every
send met by its receive in order on each rank pair, no deadlock under rendezvous
semantics, the simulated idle time per rank against DualPipe's published bubble, and the
order against torch 2.13's own ScheduleDualPipeV."""

from __future__ import annotations

import pytest

from molds.engines.schedule import (Action, Layout, ScheduleError, build, check_counts, dualpipev_compute,
                                    formula_bubble, forward_only_actions, held_activations, simulate,
                                    stock_dualpipev_actions)

SIZES = [(p, n) for p in (1, 2, 3, 4, 8) for n in sorted({2 * p, 2 * p + 1, 3 * p + 2, 4 * p, 24})]
UNIT = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}  # DualPipe's accounting: F = I, B = I + W, F&B = F + B


@pytest.mark.parametrize("name", ["dualpipev", "stock_dualpipev", "1f1b"])
@pytest.mark.parametrize("p,n", SIZES)
def test_every_rank_runs_each_micro_batch_once_per_chunk_without_deadlock(name, p, n):
    lists, layout = build(name, p, n)
    for rank, acts in enumerate(lists):
        check_counts(acts, layout, n, rank)
        if name != "dualpipev":
            assert not any(a.kind in ("I", "W", "FB") for a in acts)
    sends = {}
    recvs = {}
    for rank, acts in enumerate(lists):
        for a in acts:
            if a.kind.startswith("SEND"):
                sends.setdefault((rank, a.peer), []).append((a.kind[-1], a.chunk, a.mb))
            elif a.kind.startswith("RECV"):
                recvs.setdefault((a.peer, rank), []).append((a.kind[-1], a.chunk, a.mb))
    assert sends == recvs  # each rank pair: the same messages, in the same order
    if p > 1:
        assert sends
    simulate(lists, layout, UNIT, scale=2.0 if name == "1f1b" else 1.0)  # raises on a crossed message or deadlock


@pytest.mark.parametrize("p,n", SIZES)
def test_input_only_backwards_each_get_one_weight_step_and_pairs_overlap(p, n):
    lists, _ = build("dualpipev", p, n)
    for rank, acts in enumerate(lists):
        i = [(a.chunk, a.mb) for a in acts if a.kind == "I"]
        w = [(a.chunk, a.mb) for a in acts if a.kind == "W"]
        assert sorted(i) == sorted(w) and i, (rank, i, w)
        assert w == i  # queued first, run first
        pairs = [a for a in acts if a.kind == "FB"]
        assert len(pairs) == 2 * (n - 2 * p + rank + 1) + (p - rank - 1) - (rank == p - 1)


@pytest.mark.parametrize("p,n", SIZES)
def test_idle_time_per_rank_is_dualpipes_published_bubble(p, n):
    """(PP/2 - 1)(F&B + B - 3W) with PP = 2P stages, in DualPipe's accounting (F = I, a
    full B = I + W, F&B = F + B): exactly, on every rank; the overlap gain of a real F&B
    (F&B < F + B) lowers it on the first ranks, and the last ranks keep the formula."""
    lists, layout = build("dualpipev", p, n)
    for costs in (UNIT, {"F": 1.0, "I": 1.0, "W": 0.5, "B": 1.5}, {"F": 2.0, "I": 2.0, "W": 1.0, "B": 3.0}):
        t = simulate(lists, layout, costs)
        want = formula_bubble("dualpipev", p, costs)
        for rank in range(p):
            assert t.idle(rank) == pytest.approx(want, abs=1e-9), (rank, costs)
        gained = simulate(lists, layout, dict(costs, FB=costs["F"] + costs["B"] - 0.4))
        idle = [gained.idle(r) for r in range(p)]
        assert max(idle) == pytest.approx(formula_bubble("dualpipev", p, dict(costs, FB=costs["F"] + costs["B"] - 0.4)))
        assert all(x <= max(idle) + 1e-9 for x in idle)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_dualpipev_beats_deepspeeds_stock_schedule_and_1f1b_in_simulation(p):
    n = 4 * p
    span = {}
    for name in ("dualpipev", "stock_dualpipev", "1f1b"):
        lists, layout = build(name, p, n)
        span[name] = simulate(lists, layout, UNIT, scale=2.0 if name == "1f1b" else 1.0).makespan
    busy = 3 * 2 * n  # per rank: 2n chunks of F + B
    assert span["dualpipev"] - busy == pytest.approx(formula_bubble("dualpipev", p, UNIT))
    assert span["1f1b"] - busy == pytest.approx(formula_bubble("1f1b", p, UNIT))
    assert span["dualpipev"] < span["stock_dualpipev"] < span["1f1b"]


@pytest.mark.parametrize("p,n", [(p, n) for p, n in SIZES if n >= 2 * p])
def test_the_order_is_torchs_schedule_dualpipev(p, n):
    """torch 2.13's ScheduleDualPipeV (an independent port of DeepSeek's) computes the same
    action order for every rank: F, I (input only), W, B (full) and overlapped F&B pairs."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV
    from torch.distributed.pipelining.schedules import _ComputationType as T

    class Sizes:  # what its planner reads (it needs no process group)
        pp_group_size, _n_microbatches = p, n

    layout = Layout(p, v=True)
    kinds = {T.FORWARD: "F", T.FULL_BACKWARD: "B", T.BACKWARD_INPUT: "I", T.BACKWARD_WEIGHT: "W"}
    for rank in range(p):
        theirs = []
        for t in ScheduleDualPipeV._calculate_single_rank_operations(Sizes(), rank):
            if t.computation_type == T.OVERLAP_F_B:
                f, b = t.sub_actions
                theirs.append(("FB", f.stage_index, f.microbatch_index, b.stage_index, b.microbatch_index))
            else:
                theirs.append((kinds[t.computation_type], t.stage_index, t.microbatch_index))
        ours = [("FB", layout.stage(rank, a.chunk), a.mb, layout.stage(rank, a.b_chunk), a.b_mb) if a.kind == "FB"
                else (a.kind, layout.stage(rank, a.chunk), a.mb) for a in dualpipev_compute(p, n, rank)]
        assert ours == theirs, rank


def test_stock_is_deepspeeds_instruction_stream():
    """The stock schedule is read off DeepSpeed's DualPipeVSchedule, not rewritten."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, DualPipeVSchedule, ForwardPass

    p, n = 4, 16
    for rank in range(p):
        ds = [(type(c).__name__[0], c.phase, c.buffer_id - c.phase * n) for step in
              DualPipeVSchedule(micro_batches=n, stages=p, stage_id=rank) for c in step
              if isinstance(c, (ForwardPass, BackwardPass))]
        ours = [(a.kind, a.chunk, a.mb) for a in stock_dualpipev_actions(p, n, rank) if a.kind in ("F", "B")]
        assert ours == ds


def test_the_checker_catches_crossed_messages_deadlocks_and_missing_weight_steps():
    lists, layout = build("dualpipev", 2, 4)
    # two receives from the same peer swapped: the messages cross
    crossed = [list(acts) for acts in lists]
    idx = [i for i, a in enumerate(crossed[1]) if a.kind.startswith("RECV")][:2]
    crossed[1][idx[0]], crossed[1][idx[1]] = crossed[1][idx[1]], crossed[1][idx[0]]
    with pytest.raises(ScheduleError, match="sent as|before its receive"):
        simulate(crossed, layout)
    # the last send dropped: its receiver waits forever
    dropped = [list(acts) for acts in lists]
    last_send = max(i for i, a in enumerate(dropped[0]) if a.kind.startswith("SEND"))
    del dropped[0][last_send]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(dropped, layout)
    # a W dropped, or one for a backward that was not input-only
    no_w = [a for a in lists[0] if not (a.kind == "W")]
    with pytest.raises(ScheduleError, match="weight steps missing"):
        check_counts(no_w, layout, 4, 0)
    with pytest.raises(ScheduleError, match="without a pending"):
        check_counts(lists[0] + [Action("W", 1, 3)], layout, 4, 0)


def test_refuses_too_few_micro_batches():
    with pytest.raises(ValueError, match="at least 2 x 3"):
        dualpipev_compute(3, 5, 0)


@pytest.mark.parametrize("p,n", [(1, 1), (2, 1), (3, 2), (4, 9)])
def test_forward_only_lists_for_evaluation(p, n):
    lists = [forward_only_actions(p, n, r) for r in range(p)]
    layout = Layout(p, v=True)
    for rank, acts in enumerate(lists):
        assert sorted((a.chunk, a.mb) for a in acts if a.kind == "F") == [(c, m) for c in (0, 1) for m in range(n)]
    simulate(lists, layout, UNIT)


@pytest.mark.parametrize("name", ["dualpipev", "stock_dualpipev", "1f1b"])
@pytest.mark.parametrize("p,n", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_per_stage_costs_all_alike_give_the_uniform_simulation(name, p, n):
    lists, layout = build(name, p, n)
    scale = 2.0 if name == "1f1b" else 1.0
    costs = {"F": 1.0, "I": 0.7, "W": 0.5, "B": 1.2, "FB": 2.0}
    uniform = simulate(lists, layout, costs, scale=scale)
    staged = simulate(lists, layout, stage_costs=[{k: scale * v for k, v in costs.items()}] * layout.stages)
    assert staged.makespan == pytest.approx(uniform.makespan)
    assert staged.bubble_fraction() == pytest.approx(uniform.bubble_fraction())


@pytest.mark.parametrize("p,n", [(2, 4), (3, 2), (3, 4), (3, 8), (4, 12)])
def test_per_stage_costs_a_slow_last_stage_sets_the_1f1b_step(p, n):
    """By hand: when the last of P stages is the slowest, 1F1B's step is the upstream
    forwards of the first micro-batch, N of the last stage's (F + B), then the upstream
    backwards of the last micro-batch."""
    fast, slow = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}, {"F": 3.0, "B": 5.0, "I": 3.0, "W": 2.0}
    lists, layout = build("1f1b", p, n)
    t = simulate(lists, layout, stage_costs=[fast] * (p - 1) + [slow])
    assert t.makespan == pytest.approx((p - 1) * fast["F"] + n * (slow["F"] + slow["B"]) + (p - 1) * fast["B"])
    with pytest.raises(ValueError, match="stages"):
        simulate(lists, layout, stage_costs=[fast] * p * 2)


def test_an_fb_pair_of_two_stages_costs_one_forward_and_the_other_backward():
    from molds.engines.schedule import action_cost

    a, b = {"F": 1.0, "B": 2.0, "FB": 2.5}, {"F": 4.0, "B": 6.0, "FB": 9.0}
    pair = Action("FB", chunk=0, mb=1, b_chunk=1, b_mb=0)
    assert action_cost(pair, a) == 2.5
    assert action_cost(pair, a, b_costs=b) == pytest.approx(1.0 + 6.0 - (0.5 + 1.0) / 2)


@pytest.mark.parametrize("p,n", SIZES)
def test_1f1b_holds_what_deepspeed_allocates_pipe_buffers_for(p, n):
    """1F1B's rank r holds min(P - r, N) micro-batches at once: DeepSpeed's TrainSchedule
    allocates that many pipe buffers for them, at least 2 (``num_pipe_buffers``: "the maximum
    number of in-flight forward passes")."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    lists, _ = build("1f1b", p, n)
    for r, actions in enumerate(lists):
        held = held_activations(actions)
        assert held == min(p - r, n)
        assert max(2, held) == TrainSchedule(micro_batches=n, stages=p, stage_id=r).num_pipe_buffers()


@pytest.mark.parametrize("name", ["dualpipev", "stock_dualpipev"])
@pytest.mark.parametrize("p,n", [(p, n) for p, n in SIZES if n >= 2 * p])
def test_dualpipev_holds_2p_plus_1_chunks_on_every_rank(name, p, n):
    """DeepSeek's DualPipe holds PP + 1 stages' activations per device (its README's table),
    a stage being 1 / PP of the model; DualPipeV, DualPipe cut in half onto P = PP / 2
    devices, runs the same 2P chunks, so every rank holds 2P + 1 of them at its peak (a
    weight-deferred chunk counted until its W). DeepSpeed's stock V, with full backwards
    only, holds as many."""
    lists, _ = build(name, p, n)
    assert [held_activations(actions) for actions in lists] == [2 * p + 1] * p


def test_held_activations_by_hand():
    """P = 2, N = 4, rank 0, traced by hand: F F (2) F F (4) I W (4, 3) F (4) F&B (5, 4)
    F&B (5, 4) B (3) F&B (4, 3) B (2) I W I W (2, 1, 1, 0)."""
    actions = dualpipev_compute(2, 4, 0)
    assert [str(a) for a in actions] == ["F0.0", "F0.1", "F0.2", "F1.0", "I1.0", "W1.0", "F1.1", "F0.3&B1.1",
                                         "F1.2&B0.0", "B1.2", "F1.3&B0.1", "B1.3", "I0.2", "W0.2", "I0.3", "W0.3"]
    assert held_activations(actions) == 5
    assert held_activations(actions[:4]) == 4  # before the first backward
    assert held_activations([Action("F", 0, 0), Action("I", 0, 0), Action("F", 0, 1)]) == 2  # I keeps it until W
