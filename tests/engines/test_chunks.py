"""A chunk run in steps (molds.engines.chunks), in one process with a recording transport:
the segmented forward and backward give autograd's gradients, an exchange's backward is
the reverse exchange, and an F&B pair computes one micro-batch while the other's exchange
is in flight."""

from __future__ import annotations

import torch

from molds.engines.chunks import Exchange, Tape, backward, forward, program, run, run_pair


class Recording:
    """An exchange that reverses the rows (a stand-in for an all-to-all that moves them),
    logging launches and waits."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def launch(self, x, out_splits, in_splits, group):
        assert sum(out_splits) == sum(in_splits) == x.shape[0]
        self.log.append(f"launch {self.name}")
        log, name = self.log, self.name

        class Pending:
            def wait(self):
                log.append(f"wait {name}")
                return x.flip(0).clone()

        return Pending()


class Layer(torch.nn.Module):
    """A linear, an exchange of its output rows, a second linear: a pipeline layer cut at
    its communication boundary, as an MoE block is."""

    def __init__(self, log, name, width=6):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.log, self.name = log, name

    def first(self, x):
        self.log.append(f"compute {self.name}.first")
        return torch.tanh(self.a(x))

    def second(self, x):
        self.log.append(f"compute {self.name}.second")
        return torch.tanh(self.b(x))

    def forward(self, x):  # whole: the exchange inline
        return self.second(self.first(x).flip(0))

    def pipeline_parts(self):
        return [self.first, Exchange(self.name, lambda c: c, lambda c, x: x, lambda c: ([c.shape[0]], [c.shape[0]]),
                                     transport=Recording(self.log, self.name)), self.second]


def _model(log, tag):
    torch.manual_seed(0)
    return torch.nn.ModuleList([Layer(log, f"{tag}0"), torch.nn.Linear(6, 6), Layer(log, f"{tag}1")])


def test_segmented_forward_and_backward_give_autograds_gradients():
    log = []
    layers = _model(log, "L")
    x = torch.randn(5, 6)
    ref_x = x.clone().requires_grad_()
    out = ref_x
    for layer in layers:
        out = layer(out)
    (out.square().sum()).backward()
    want = {n: p.grad.clone() for n, p in layers.named_parameters()}
    layers.zero_grad(set_to_none=True)

    steps = program(layers)
    assert [type(s).__name__ for s in steps] == ["Compute", "Exchange", "Compute", "Exchange", "Compute"]
    leaf = x.clone().requires_grad_()
    tape = Tape()
    y = run(forward(steps, leaf, tape))
    torch.testing.assert_close(y, out.detach(), rtol=0, atol=0)
    tape.output_leaves[0].grad = 2 * y.detach()  # d(sum y^2)/dy
    run(backward(tape))
    torch.testing.assert_close(leaf.grad, ref_x.grad, rtol=1e-6, atol=1e-7)
    for n, p in layers.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7, msg=n)
    assert not tape.records  # released


def test_a_pair_computes_while_the_other_exchange_is_in_flight():
    log = []
    layers = _model(log, "L")
    steps = program(layers)
    tape_b = Tape()
    yb = run(forward(steps, torch.randn(4, 6).requires_grad_(), tape_b))
    tape_b.output_leaves[0].grad = torch.ones_like(yb)
    log.clear()
    tape_f = Tape()
    run_pair(forward(steps, torch.randn(4, 6).requires_grad_(), tape_f), backward(tape_b))
    # F launches L0's exchange; B computes (its last segment) while it is in flight, and so on
    first_f_launch, first_f_wait = log.index("launch L0"), log.index("wait L0")
    assert any(e.startswith("launch L1") for e in log[first_f_launch:first_f_wait])  # B's reverse exchange
    between = log[first_f_launch + 1:first_f_wait]
    assert between and all(not e.startswith("compute L0") for e in between)
    assert log.count("launch L0") == 2 and log.count("launch L1") == 2  # each side exchanged each layer once
