"""A pipeline chunk run in steps, so that two micro-batches can interleave.

A chunk is the list of layers one pipeline rank holds for one stage. A layer may cut
itself at its communication boundaries (``pipeline_parts()``: an MoE block with expert
parallelism returns attention + routing, the dispatch all-to-all, the experts, the
combine all-to-all, the aggregation); every other layer runs whole. The chunk becomes a
program of two kinds of steps:

    Compute   layers (or layer parts) under autograd, between two exchanges
    Exchange  an all-to-all of one tensor of the carried state, outside autograd: its
              backward is the reverse all-to-all of the gradient

``forward`` runs the program and records a tape: before each compute step the carried
state is cut from the graph (its tensors that need gradients are detached into fresh
leaves), so the backward can run segment by segment, the reverse exchanges between them.
Both are generators that stop at every exchange they launch and wait for it when resumed:
``run`` drives one alone (each exchange is waited at once); ``run_pair`` drives the forward
of one micro-batch and the backward of another in turn, so one's all-to-all is in flight
while the other computes (DeepSeek-V3's overlap of computation and communication). On a
GPU the collectives run on the process group's own communication stream (NCCL's), and the
wait makes the compute stream wait for it.

The weight gradients of a segment's backward are deferred when the caller runs it inside
a ``WeightGradStore.deferring()`` context (molds.models.wgrad), as any backward is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

# ---------------------------------------------------------------- exchanges

class AllToAll:
    """The transport of an ``Exchange``: an asynchronous ``all_to_all_single`` over a group
    (gloo and NCCL alike)."""

    def launch(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                                      input_split_sizes=in_splits, group=group, async_op=True)
        return _Pending(out, work)


@dataclass
class _Pending:
    out: torch.Tensor
    work: Any

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.out


@dataclass
class Exchange:
    """An all-to-all of one tensor of the carried state: ``get`` / ``put`` read and replace
    it, ``prepare`` runs first (it may exchange counts: a small blocking collective) and
    ``splits`` gives (output split sizes, input split sizes); the backward swaps them."""

    name: str
    get: Callable[[Any], torch.Tensor]
    put: Callable[[Any, torch.Tensor], Any]
    splits: Callable[[Any], tuple[list[int], list[int]]]
    group: Any = None
    prepare: Callable[[Any], None] | None = None
    transport: Any = field(default_factory=AllToAll)


# ---------------------------------------------------------------- cutting the graph

def _map_tensors(obj, fn, memo: dict):
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = fn(obj)
        return memo[id(obj)]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn, memo) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn, memo) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, memo) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn, memo)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def cut(obj) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """``obj`` with every tensor that needs a gradient replaced by a detached leaf that
    needs one; returns (new obj, the originals, their leaves), in the same order."""
    outs, leaves = [], []

    def detach(t):
        if not t.requires_grad:
            return t
        leaf = t.detach().requires_grad_(True)
        outs.append(t)
        leaves.append(leaf)
        return leaf

    return _map_tensors(obj, detach, {}), outs, leaves


# ---------------------------------------------------------------- programs and tapes

@dataclass
class Compute:
    fns: list[Callable[[Any], Any]]

    def __call__(self, carry):
        for fn in self.fns:
            carry = fn(carry)
        return carry


def program(layers) -> list:
    """A chunk's layers as alternating Compute and Exchange steps (a Compute first and last)."""
    steps: list = [Compute([])]
    for layer in layers:
        parts = layer.pipeline_parts() if hasattr(layer, "pipeline_parts") else None
        for part in parts or [layer]:
            if isinstance(part, Exchange):
                steps += [part, Compute([])]
            else:
                steps[-1].fns.append(part)
    return steps


@dataclass
class _ComputeRecord:
    outs: list  # tensors the step produced that need gradients
    leaves: list  # their detached leaves, which the next steps consumed


@dataclass
class _ExchangeRecord:
    exchange: Exchange
    sent: torch.Tensor  # the leaf sent (its .grad is filled by the backward)
    received: torch.Tensor  # the leaf received (a leaf that needs a gradient)
    out_splits: list
    in_splits: list


@dataclass
class Tape:
    """What a chunk's forward left for its backward."""

    records: list = field(default_factory=list)
    output_leaves: list = field(default_factory=list)  # the chunk's outputs, detached

    def release(self) -> None:
        self.records.clear()
        self.output_leaves.clear()


def forward(steps: list, inputs, tape: Tape):
    """Generator: run ``steps`` on ``inputs`` (whose tensors needing gradients are the
    chunk's input leaves), recording into ``tape``; stops after launching each exchange.
    Its return value (``StopIteration.value``) is the chunk's output, cut from the graph
    (the leaves whose ``.grad`` the backward starts from are ``tape.output_leaves``)."""
    carry = inputs
    for step in steps:
        if isinstance(step, Exchange):
            if step.prepare is not None:
                step.prepare(carry)
            out_splits, in_splits = step.splits(carry)
            sent = step.get(carry)
            pending = step.transport.launch(sent.detach(), out_splits, in_splits, step.group)
            yield step.name
            received = pending.wait().requires_grad_(sent.requires_grad)
            carry = step.put(carry, received)
            tape.records.append(_ExchangeRecord(step, sent, received, out_splits, in_splits))
        else:
            carry = step(carry)
            carry, outs, leaves = cut(carry)
            tape.records.append(_ComputeRecord(outs, leaves))
    tape.output_leaves = tape.records[-1].leaves if tape.records and isinstance(tape.records[-1], _ComputeRecord) \
        else []
    return carry


def backward(tape: Tape):
    """Generator: the chunk's backward from the gradients set on ``tape.output_leaves``,
    segment by segment, stopping after launching each reverse exchange; the chunk's input
    leaves hold their gradients at the end."""
    for record in reversed(tape.records):
        if isinstance(record, _ExchangeRecord):
            grad = record.received.grad
            if grad is None:
                grad = torch.zeros_like(record.received)
            pending = record.exchange.transport.launch(grad, record.in_splits, record.out_splits,
                                                       record.exchange.group)
            yield record.exchange.name
            sent_grad = pending.wait()
            if record.sent.requires_grad:
                record.sent.grad = sent_grad if record.sent.grad is None else record.sent.grad + sent_grad
        else:
            pairs = [(o, leaf.grad) for o, leaf in zip(record.outs, record.leaves) if leaf.grad is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    tape.release()


def run(gen):
    """Drive one generator to its end; returns its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def run_pair(first, second):
    """Drive two generators in turn (each runs until it launches an exchange, then the
    other runs while that exchange is in flight); returns both return values."""
    gens, results = [first, second], [None, None]
    live = [True, True]
    while any(live):
        for i, gen in enumerate(gens):
            if not live[i]:
                continue
            try:
                next(gen)
            except StopIteration as stop:
                results[i] = stop.value
                live[i] = False
    return results
