"""The fused Triton ops (``kernels.triton``) against their PyTorch references (run on the
CPU), forward and backward, on odd shapes and fresh data; their custom ops have fake
implementations that agree (opcheck). The kernels run compiled on a GPU where there is
one (``device``), else in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from molds.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from molds.kernels.moe_permute import moe_permute, moe_unpermute, permute_reference, unpermute_reference
from molds.kernels.rmsnorm import fused_rms_norm, rms_norm_reference
from molds.kernels.swiglu import fused_swiglu, swiglu_reference

def _forward_backward(fn, inputs, grad_out=None, gen=None, device="cpu"):
    leaves = [t.detach().clone().to(device).requires_grad_(t.is_floating_point()) for t in inputs]
    y = fn(*leaves)
    g = grad_out if grad_out is not None else torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(g.to(y.device))
    return y.detach().cpu(), [t.grad.cpu() for t in leaves if t.is_floating_point()], g


def _compare(fused, reference, inputs, gen, rtol, atol, device):
    """``fused`` on ``device`` (its Triton kernel) against ``reference`` on the CPU."""
    y, grads, g = _forward_backward(fused, inputs, gen=gen, device=device)
    y_ref, grads_ref, _ = _forward_backward(reference, inputs, grad_out=g)
    assert not y.isnan().any() and y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    for a, b in zip(grads, grads_ref):
        assert a.dtype == b.dtype and not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("shape,dtype", [((1023, 777), torch.float32), ((5, 7, 300), torch.bfloat16),
                                         ((1, 64), torch.float32)])
def test_rms_norm(shape, dtype, gen, device):
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=gen)
    # bf16: the normalized value is rounded to bf16 (as the reference does) where 1/rms may
    # differ in its last float32 bit: one bf16 unit in the last place, 2^-8 relative
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-7, 2**-7)
    _compare(lambda x, w: fused_rms_norm(x, w, 1e-6), lambda x, w: rms_norm_reference(x, w, 1e-6), [x, w], gen,
             *tol, device)


@pytest.mark.parametrize("shape,dtype", [((33, 1023), torch.float32), ((4, 5, 777), torch.bfloat16)])
def test_swiglu(shape, dtype, gen, device):
    gate, up = (torch.randn(shape, generator=gen) * 3).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    # bf16: silu(gate) and the product are each rounded to bf16, by the reference to nearest,
    # by the interpreter towards zero (its fp32 -> bf16 cast truncates): two units in the last place
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-6, 2**-6)
    _compare(fused_swiglu, swiglu_reference, [gate, up], gen, *tol, device)


def _routing(gen, tokens=77, experts=6, k=3, drop=10):
    """(token_of, weight_of) as the MoE router makes them: pairs sorted by expert, some dropped."""
    scores = torch.rand(tokens, experts, generator=gen)
    w, e = torch.topk(scores, k, dim=-1)
    order = torch.argsort(e.reshape(-1), stable=True)
    order = order[torch.randperm(len(order), generator=gen)[drop:].sort().values]  # capacity drops
    return order // k, (w / w.sum(-1, keepdim=True)).reshape(-1)[order]


def test_permute_and_unpermute(gen, device):
    token_of, weight_of = _routing(gen)
    t, w = token_of.to(device), weight_of.to(device)
    y = torch.randn(77, 65, generator=gen)
    # gathers in a fixed order: forward results equal the references bit for bit (the weighted
    # sum on a GPU within a rounding per term: the compiler fuses its multiply-adds)
    assert torch.equal(moe_permute(y.to(device), t).cpu(), permute_reference(y, token_of))
    x = torch.randn(len(token_of), 65, generator=gen)
    got, want = moe_unpermute(x.to(device), t, w, 77).cpu(), unpermute_reference(x, token_of, weight_of, 77)
    if device.type == "cuda":
        torch.testing.assert_close(got, want, rtol=2**-22, atol=2**-22 * float(want.abs().max()))
    else:
        assert torch.equal(got, want)

    def on(tensor, index):  # the index on the device the op's input is on
        return index.to(tensor.device)

    _compare(lambda y: moe_permute(y, on(y, token_of)), lambda y: permute_reference(y, token_of), [y], gen, 1e-6,
             1e-6, device)
    _compare(lambda x, w: moe_unpermute(x, on(x, token_of), w, 77),
             lambda x, w: unpermute_reference(x, token_of, w, 77), [x, weight_of], gen, 1e-5, 1e-6, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_in_chunks(dtype, gen, monkeypatch, device):
    from molds.kernels import cross_entropy

    sizes = []
    real = cross_entropy._chunk_rows
    monkeypatch.setattr(cross_entropy, "_chunk_rows", lambda t, v, *_: sizes.append(min(t, 64)) or min(t, 64))
    hidden = torch.randn(301, 96, generator=gen).to(dtype)
    weight = (torch.randn(45, 96, generator=gen) * 0.1).to(dtype)
    targets = torch.randint(0, 45, (301,), generator=gen)
    targets[::7] = -100
    loss, grads, _ = _forward_backward(lambda h, w: linear_cross_entropy(h, w, targets.to(device)),
                                       [hidden, weight], grad_out=torch.tensor(1.0), device=device)
    ref, grads_ref, _ = _forward_backward(lambda h, w: linear_cross_entropy_reference(h, w, targets),
                                          [hidden, weight], grad_out=torch.tensor(1.0))
    assert sizes == [64]  # five chunks of at most 64 rows: the full logits never existed
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
    assert real(10**6, 50_000) * 50_000 <= 1 << 22  # about 16 MiB of float32 logits per chunk by default
    # a wide model: chunks of T / ceil(V / H) rows (8 chunks here), so the weight gradient's
    # float32 sum is not re-read once per 16 MiB of logits
    assert real(8192, 32768, 4096) == 1024 and real(8192, 32768, 256) == 128
    hidden, weight, targets = hidden.to(device), weight.to(device), targets.to(device)
    with torch.no_grad():  # evaluation: the loss only
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets).cpu(), ref, rtol=tol, atol=tol)
    no_target = torch.full((3,), -100, device=device)
    assert linear_cross_entropy(hidden[:3], weight, no_target).isnan()  # no target: NaN, as torch


def test_custom_ops_have_matching_fake_implementations(gen, device):
    x, w = torch.randn(9, 40, generator=gen).to(device), torch.randn(40, generator=gen).to(device)
    token_of, weight_of = (t.to(device) for t in _routing(gen, tokens=9, experts=4, k=2, drop=2))
    rows = torch.randn(len(token_of), 40, generator=gen).to(device)
    logits = torch.randn(9, 17, generator=gen).to(device)
    targets = torch.randint(0, 17, (9,), generator=gen).to(device)
    half = torch.tensor(0.5, device=device)
    for op, args in [(torch.ops.molds.rms_norm_forward.default, (x, w, 1e-6)),
                     (torch.ops.molds.swiglu.default, (x, x.flip(0))),
                     (torch.ops.molds.moe_permute.default, (x, token_of)),
                     (torch.ops.molds.moe_unpermute.default, (rows, token_of, weight_of, 9)),
                     (torch.ops.molds.cross_entropy_rows.default, (logits, targets, half, True, -100))]:
        torch.library.opcheck(op, args)
