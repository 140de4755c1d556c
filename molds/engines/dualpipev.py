"""``parallel.schedule=dualpipev``: DualPipeV on DeepSpeed's pipeline, with zero-bubble
weight gradients and the MoE all-to-alls of one micro-batch hidden behind another's compute.

With P pipeline ranks the model is cut into 2P stages; rank r holds stage r (chunk 0)
and stage 2P-1-r (chunk 1), so rank 0 embeds and computes the loss. Each rank runs its
action list from ``molds.engines.schedule.dualpipev_actions`` (DeepSeek's order; the
tests check it against torch's ``ScheduleDualPipeV`` and simulate it).

What is DeepSpeed 0.19.8's and reused as is:
- ``DualPipeVModule``: the 2P-way partition (``parallel.partition_method``), the two phases
  a rank builds, the tied embedding / LM head shared on rank 0.
- ``DualPipeVEngine`` (and under it ``PipelineEngine`` / ``DeepSpeedEngine``): the loss
  stage's rank and the loss reduction (``_aggregate_total_loss``, ``_reduce_outputs``,
  ``_bcast_pipe_scalar``), the gradient reduction over data-parallel and expert-data-
  parallel groups and of tied weights (``_exec_reduce_grads``, ``_exec_reduce_tied_grads``),
  the optimizer step with ZeRO-1 or the BF16 wrapper (``_exec_optimizer_step``).

What molds replaces, and why:
- The schedule (DeepSpeed's ``DualPipeVSchedule``): it keeps weight gradients inside the
  backward pass and runs a forward and a backward one after the other. Here input-only
  backwards queue their weight gradients per (chunk, micro-batch) in this engine's
  ``WeightGradStore`` (the FP8 linears included) and W actions run them in the holes;
  F&B actions run one micro-batch's forward and another's backward interleaved at the
  MoE exchanges (``molds.engines.chunks``).
- The forward / backward instructions: a chunk runs as a program of compute steps and
  asynchronous all-to-alls instead of one ``PipelineModule.forward``, so it can be
  interleaved and its backward run segment by segment. Activation checkpointing is not
  applied here (refused by the recipe check).
- The point-to-point exchange: DeepSpeed queues operations and runs them through
  ``batch_isend_irecv``; here each send and receive is its own ``isend`` / ``irecv``
  (safe on gloo and NCCL alike), posted where the action list says (receives one compute
  ahead, in the sender's order) and waited by the compute that needs it; the shapes are
  known from the micro-batch (fixed-shape stage I/O), so no metadata is exchanged.
- Only the hidden states travel: every pipeline rank reads the same micro-batches, so
  position_ids and document_ids are taken from the local copy.
- Optimizer wrappers that accumulate through backward hooks (DeepSpeed's BF16 wrapper)
  never see deferred gradients, so every action that makes gradients (B, I, W, F&B) is
  bracketed: low-precision gradients cleared before, added into the fp32 ones after.
"""

from __future__ import annotations

import contextlib
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine as StockEngine, DualPipeVModule

from ..models.loss import has_targets
from ..models.wgrad import WeightGradStore, defer_weight_grads
from .base import StepResult
from .chunks import Compute, Tape, backward, forward, program, run, run_pair
from .pipeline import PipelineEngine
from .schedule import Layout, Timeline, dualpipev_actions, forward_only_actions


class DualPipeVEngine(PipelineEngine):
    """molds' pipeline engine with the DualPipeV schedule (same canonical checkpoints,
    same non-finite handling and clipping, same ``moe/*``; adds ``pipeline/*`` timings)."""

    @staticmethod
    def module_class():
        return DualPipeVModule

    @staticmethod
    def initialize_deepspeed(**kwargs):
        """``deepspeed.initialize``, which builds its ``DualPipeVEngine`` for a
        ``DualPipeVModule``: ours (a subclass) in its place, for this one call."""
        stock = deepspeed.DualPipeVEngine
        deepspeed.DualPipeVEngine = executor_class()
        try:
            return deepspeed.initialize(**kwargs)
        finally:
            deepspeed.DualPipeVEngine = stock

    def __init__(self, recipe, model, loss_fn, dist, plan):
        defer_weight_grads(model)  # the linears' and experts' weight gradients can wait for W
        super().__init__(recipe, model, loss_fn, dist, plan)
        self.engine.configure_molds(loss_fn, model.config.hidden_size, overlap=recipe.parallel.overlap_moe)

    def train_step(self, micro_batches: list[dict]):
        lr = self.scheduler.get_last_lr()[0]
        skipped_before = self.engine.skipped_steps
        self._skipped, self._norm = False, None
        start = time.perf_counter()
        self.engine.train_micro_batches(micro_batches)
        self._stage_seconds.append(time.perf_counter() - start)
        timeline = self.engine.last_timeline
        self._windows.append((timeline.busy(0), timeline.makespan))
        norm = self._norm if self._norm is not None else self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        skipped = self._skipped or self.engine.skipped_steps > skipped_before
        return StepResult(loss=float(self.engine.dp_group_loss), grad_norm=norm, lr=lr, skipped=skipped)

    @torch.no_grad()
    def eval_forward(self, batch: dict) -> dict:
        if not has_targets(batch):
            raise RuntimeError("the pipeline engine evaluates losses only")
        return {"loss": self.engine.eval_micro_batches([batch])}


class _Sent:
    """An ``isend`` in flight and the tensor it reads (kept alive until it completes)."""

    def __init__(self, tensor, work):
        self.tensor, self.work = tensor, work


_EXECUTOR = None


def executor_class():
    """DeepSpeed's ``DualPipeVEngine`` subclassed to run molds' action lists (built on
    first use: importing DeepSpeed is slow)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = _build_executor_class()
    return _EXECUTOR


def _build_executor_class():
    class Executor(StockEngine):
        """DeepSpeed's ``DualPipeVEngine`` running molds' action lists (see the module
        docstring for what is kept and what is replaced)."""

        def configure_molds(self, loss_fn, hidden_size: int, overlap: bool = True) -> None:
            self.molds_loss, self.hidden_size = loss_fn, hidden_size
            self.overlap = overlap
            self.layout = Layout(self.num_stages, v=True)
            self.programs = [program(self.module.phase_funcs[c]) for c in (0, 1)]
            self.wgrad = WeightGradStore()
            self.last_timeline = None
            self.last_idle_parts = {}
            # each stage's global rank, looked up once: DeepSpeed's stage_to_global scans the topology per call
            self._stage_ranks = {s: self.grid.stage_to_global(s) for s in range(self.num_stages)}
            self.io_dtype = next(p for p in self.module.parameters() if p.is_floating_point()).dtype

        # -------------------------------------------------------- one optimizer step
        def train_micro_batches(self, micro_batches: list[dict]):
            if len(micro_batches) != self.micro_batches:
                raise RuntimeError(f"{len(micro_batches)} micro-batches for a schedule of {self.micro_batches}")
            self.module.train()
            self.total_loss = None
            self.total_additional_losses = None
            self.fwd_outputs = []
            self.deferred_grads = 0  # weight-gradient products the W actions ran this step
            try:
                self._execute(dualpipev_actions(self.num_stages, self.micro_batches, self.stage_id), micro_batches,
                              train=True)
            except BaseException:
                self._abandon()
                raise
            self._exec_reduce_tied_grads()
            self._exec_reduce_grads()
            self._exec_optimizer_step()
            with torch.no_grad():
                self.agg_train_loss = self._aggregate_total_loss()
            return self.agg_train_loss

        def _exec_reduce_grads(self):
            """One data-parallel replica and a plain optimizer: nothing to reduce (and
            DeepSpeed's bucketed all-reduce refuses float64 gradients, which the float64
            equivalence tests use); otherwise DeepSpeed's reduction."""
            if self.dp_world_size == 1 and not self.zero_optimization() and not self.using_bf16_optimizer:
                return
            super()._exec_reduce_grads()

        def eval_micro_batches(self, micro_batches: list[dict]):
            self.module.eval()
            self.fwd_outputs = []
            try:
                with torch.no_grad():
                    self._execute(forward_only_actions(self.num_stages, len(micro_batches), self.stage_id),
                                  micro_batches, train=False)
            except BaseException:
                self._abandon()
                raise
            self.module.train()
            out = None
            if self.stage_id == 0:
                out = self._reduce_outputs(self.fwd_outputs, reduce="avg", micro_batches=len(micro_batches))
            out = self._bcast_pipe_scalar(out)
            self.fwd_outputs = []
            return float(out)

        # -------------------------------------------------------- the executor
        def _execute(self, actions, micro_batches, train: bool) -> None:
            """Run one rank's action list (any schedule of ``molds.engines.schedule``
            with the V layout)."""
            self._micro, self._train = micro_batches, train
            self._inputs, self._tapes, self._outputs = {}, {}, {}
            self._recvs, self._ready, self._sends = {}, {}, []
            self._loss_scale = 1.0 / len(micro_batches)
            spans = []
            waited = posted = 0.0  # where the idle time goes: waiting for peers, posting messages
            t0 = time.perf_counter()
            for a in actions:
                start = time.perf_counter()
                if a.kind == "SEND_F":
                    self._send(self._outputs[(a.chunk, a.mb)][0], a.peer)
                elif a.kind == "SEND_B":
                    self._send(self._inputs.pop((a.chunk, a.mb))[0].grad, a.peer)
                elif a.kind == "RECV_F":
                    self._recv(("F", a.chunk, a.mb), a.peer, a.mb)
                elif a.kind == "RECV_B":
                    self._recv(("B", a.chunk, a.mb), a.peer, a.mb)
                else:
                    self._await_inputs(a)  # waiting for a peer is idle time, not the action's
                    waited += time.perf_counter() - start
                    start = time.perf_counter()
                    self._compute(a)
                    spans.append((start - t0, time.perf_counter() - t0, a))
                    continue
                posted += time.perf_counter() - start
            start = time.perf_counter()
            for sent in self._sends:
                sent.work.wait()
            waited += time.perf_counter() - start
            self._sends = []
            leftover = [k for k in ("_recvs", "_ready", "_tapes") if getattr(self, k)]
            if leftover or (train and self.wgrad.pending()):
                raise RuntimeError(f"the action list left work behind: {leftover}, {self.wgrad.pending()} queued "
                                   f"weight gradients")
            self._inputs, self._outputs = {}, {}
            end = time.perf_counter() - t0
            self.last_timeline = Timeline(1, [spans + [(end, end, None)]]) if train else None
            self.last_idle_parts = {"wait_s": waited, "post_s": posted}

        def _abandon(self) -> None:
            """After a failure inside the list: drop what it held (the step is lost anyway)."""
            self.wgrad.clear()
            self._inputs, self._tapes, self._outputs, self._recvs, self._ready, self._sends = {}, {}, {}, {}, {}, []

        def _compute(self, a) -> None:
            if a.kind == "W":
                with self._gradient_pass():
                    self.deferred_grads += self.wgrad.run((a.chunk, a.mb))
                return
            if a.kind == "F":
                run(self._forward(a.chunk, a.mb))
                self._after_forward(a.chunk, a.mb)
                return
            if a.kind in ("B", "I"):
                with self._gradient_pass(), self._deferring(a):
                    run(self._backward(a.chunk, a.mb))
                self._after_backward(a.chunk, a.mb)
                return
            # FB: the forward of (chunk, mb) with the full backward of (b_chunk, b_mb)
            with self._gradient_pass():
                f, b = self._forward(a.chunk, a.mb), self._backward(a.b_chunk, a.b_mb)
                if self.overlap:
                    run_pair(f, b)
                else:
                    run(f)
                    run(b)
            self._after_forward(a.chunk, a.mb)
            self._after_backward(a.b_chunk, a.b_mb)

        def _forward(self, chunk: int, mb: int):
            """Generator: chunk ``chunk``'s forward of micro-batch ``mb``."""
            batch = self._micro[mb]
            ids = (batch["position_ids"], batch["document_ids"])
            if self.layout.stage(self.stage_id, chunk) == 0:
                inputs = (batch["input_ids"],) + ids
            elif self.layout.upstream(self.stage_id, chunk) is None:  # the turn of the V: this rank's chunk 0
                inputs = (self._outputs[(0, mb)][0],) + ids
            else:
                hidden = self._wait(("F", chunk, mb))
                inputs = (hidden.requires_grad_(self._train),) + ids
            self._inputs[(chunk, mb)] = inputs
            steps = self.programs[chunk]
            if self.layout.is_loss(self.stage_id, chunk):
                targets = {"labels": batch["labels"], "document_ids": batch["document_ids"]}
                steps = steps[:-1] + [Compute(steps[-1].fns + [lambda out: self._loss(out, targets)])]
            tape = Tape()
            if self._train:
                self._tapes[(chunk, mb)] = tape
            out = yield from forward(steps, inputs, tape)
            self._outputs[(chunk, mb)] = out if isinstance(out, tuple) else (out,)

        def _loss(self, outputs, targets):
            outputs = outputs if isinstance(outputs, dict) else {"logits": outputs}
            loss = self.molds_loss(outputs, targets)
            self.fwd_outputs.append(loss.detach())
            self.total_loss = loss.detach().clone() if self.total_loss is None else self.total_loss + loss.detach()
            return loss

        def _after_forward(self, chunk: int, mb: int) -> None:
            if not self._train:
                self._inputs.pop((chunk, mb), None)
                if self.layout.downstream(self.stage_id, chunk) is None and chunk == 1:
                    self._outputs.pop((chunk, mb), None)

        def _backward(self, chunk: int, mb: int):
            """Generator: chunk ``chunk``'s backward of micro-batch ``mb``."""
            tape = self._tapes.pop((chunk, mb))
            out = tape.output_leaves
            if self.layout.is_loss(self.stage_id, chunk):
                out[0].grad = torch.full_like(out[0], self._loss_scale)
            elif self.layout.downstream(self.stage_id, chunk) is not None:
                out[0].grad = self._wait(("B", chunk, mb))
            # else: the turn of the V, whose gradient this rank's chunk 1 left on the leaf
            yield from backward(tape)
            self._outputs.pop((chunk, mb), None)

        def _after_backward(self, chunk: int, mb: int) -> None:
            if self.layout.upstream(self.stage_id, chunk) is None:
                self._inputs.pop((chunk, mb), None)  # the first stage, or the turn (its gradient stays local)

        @contextlib.contextmanager
        def _deferring(self, a):
            if a.kind == "I":
                with self.wgrad.deferring((a.chunk, a.mb)):
                    yield
            else:
                yield

        @contextlib.contextmanager
        def _gradient_pass(self):
            """Gradients made inside reach the optimizer's accumulation (see the module docstring)."""
            bf16 = self.using_bf16_optimizer
            if bf16:
                self.optimizer.clear_lp_grads()
            self._running_engine_backward = True
            try:
                yield
            finally:
                self._running_engine_backward = False
            if bf16:
                self.optimizer.update_hp_grads(clear_lp_grads=False)

        # -------------------------------------------------------- point to point
        def _send(self, tensor, peer: int) -> None:
            tensor = tensor.detach().contiguous()
            self._sends = [s for s in self._sends if not s.work.is_completed()]  # free what has gone
            self._sends.append(_Sent(tensor, dist.isend(tensor, self._stage_ranks[peer])))

        def _recv(self, key, peer: int, mb: int) -> None:
            rows = self._micro[mb]["input_ids"].numel()  # the fixed stage shape: [B*S, hidden]
            buf = torch.empty(rows, self.hidden_size, dtype=self.io_dtype, device=self.device)
            self._recvs[key] = (buf, dist.irecv(buf, self._stage_ranks[peer]))

        def _await_inputs(self, a) -> None:
            """Wait for the receives compute action ``a`` consumes."""
            for chunk, mb in a.forwards():
                if ("F", chunk, mb) in self._recvs:
                    self._wait(("F", chunk, mb))
            for chunk, mb in a.backwards():
                if ("B", chunk, mb) in self._recvs:
                    self._wait(("B", chunk, mb))

        def _wait(self, key):
            if key in self._ready:
                return self._ready.pop(key)
            if key not in self._recvs:
                raise RuntimeError(f"pipeline rank {self.stage_id}: {key} is consumed before it is received "
                                   f"(a schedule without its receive)")
            buf, work = self._recvs.pop(key)
            work.wait()
            self._ready[key] = buf
            return buf

    return Executor
