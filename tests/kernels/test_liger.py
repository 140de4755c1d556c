"""``kernels.fused_backend``: Liger Kernel's RMSNorm, SwiGLU and linear + cross-entropy in
place of molds' own, held to molds' PyTorch references (run on the CPU), forward and
backward, on odd shapes and fresh data. Liger Kernel runs on CUDA GPUs: the op tests run
there (``benchmarks/gpu_check.py`` runs this file whenever a GPU is lent); its fused linear
+ cross-entropy also runs in Triton's interpreter, so that one is checked on CPU tensors
too. Which backend a run takes, and what the start line says, is checked everywhere."""

from __future__ import annotations

import copy

import pytest
import torch

from molds.errors import RecipeError
from molds.kernels import apply_kernels, fused_backends, kernel_summary
from molds.kernels.cross_entropy import linear_cross_entropy_reference
from molds.kernels.liger import liger_available
from molds.kernels.rmsnorm import rms_norm_reference
from molds.kernels.swiglu import swiglu_reference
from molds.models.loss import CausalLMLoss
from molds.recipe.sections import KernelsConfig
from tests.kernels.test_converters import _batch, _loss_and_grads
from tests.kernels.test_fused import _compare
from tests.test_moe import moe_model

needs_liger = pytest.mark.skipif(not liger_available(), reason="liger-kernel is not installed")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger Kernel's RMSNorm and SwiGLU run on CUDA "
                                                                 "GPUs only (Triton's interpreter fails on them)")


def test_auto_takes_molds_kernels_on_a_cpu_and_liger_is_refused_there():
    assert fused_backends("auto", "cpu") == dict.fromkeys(("rms_norm", "swiglu", "linear_cross_entropy"), "molds")
    assert set(fused_backends("molds", "cuda").values()) == {"molds"}
    with pytest.raises(RecipeError, match="Liger Kernel runs on CUDA GPUs and this run is on the cpu"):
        fused_backends("liger", "cpu")
    with pytest.raises(RecipeError, match="Liger Kernel runs on CUDA GPUs"):
        apply_kernels(moe_model(), KernelsConfig(triton=True, fused_backend="liger"), CausalLMLoss(), "cpu")
    if torch.cuda.is_available():
        assert set(fused_backends("auto", "cuda").values()) == {"liger" if liger_available() else "molds"}


def test_without_the_gpu_extra_a_recipe_that_needs_it_stops_naming_it(monkeypatch):
    """A CPU install leaves Triton and Liger Kernel out (the gpu extra): kernels.triton on a
    GPU, Triton's interpreter asked for, or Liger asked for by name, stops with one line
    naming the extra; kernels.triton on a CPU takes each op's PyTorch path as before."""
    import molds.kernels as kernels
    from molds.kernels import launch, liger

    monkeypatch.setattr(launch, "triton", None)  # what an install without triton imports
    for module in (liger, kernels):  # where it is defined, and where kernels' choice reads it
        monkeypatch.setattr(module, "liger_available", lambda: False)
    monkeypatch.delenv("MOLDS_TRITON_INTERPRET", raising=False)
    model = apply_kernels(moe_model(), KernelsConfig(triton=True), CausalLMLoss(), "cpu")
    assert set(model.fused_backends.values()) == {"molds"}
    with pytest.raises(RecipeError, match=r"^kernels.triton: .*pip install 'molds\[gpu\]'"):
        apply_kernels(moe_model(), KernelsConfig(triton=True), CausalLMLoss(), "cuda")
    monkeypatch.setenv("MOLDS_TRITON_INTERPRET", "1")
    with pytest.raises(RecipeError, match=r"^MOLDS_TRITON_INTERPRET=1 .*pip install 'molds\[gpu\]'"):
        apply_kernels(moe_model(), KernelsConfig(triton=True), CausalLMLoss(), "cpu")
    monkeypatch.setattr(launch, "triton", object())  # Triton present, Liger Kernel not
    with pytest.raises(RecipeError, match=r"Liger Kernel does not import here \(pip install 'molds\[gpu\]'\)"):
        fused_backends("liger", "cuda")


def test_recipe_rule_fused_backend_needs_triton(tmp_path):
    from molds.recipe.parse import parse_recipe, validate

    base = ["--recipe", "recipes/smoke/dense_zero2.json", "--data.manifest", str(tmp_path)]
    validate(parse_recipe(base + ["--kernels.triton", "true", "--kernels.fused_backend", "molds"]), 2)
    with pytest.raises(RecipeError, match="kernels.fused_backend=liger applies with kernels.triton=true"):
        validate(parse_recipe(base + ["--kernels.fused_backend", "liger"]), 2)


@needs_liger
def test_liger_linear_cross_entropy_against_the_reference(gen, device):
    """Liger's fused LM head + loss through molds' wrapper (ignored targets, a vocabulary that
    is no power of two), on the GPU or in Triton's interpreter, against the reference."""
    from molds.kernels.liger import liger_linear_cross_entropy

    hidden = torch.randn(67, 48, generator=gen)
    weight = torch.randn(101, 48, generator=gen) * 0.1
    targets = torch.randint(0, 101, (67,), generator=gen)
    targets[::5] = -100
    _compare(lambda h, w: liger_linear_cross_entropy(h, w, targets.to(h.device)),
             lambda h, w: linear_cross_entropy_reference(h, w, targets), [hidden, weight], gen, 1e-5, 1e-5, device)


@needs_liger
@on_gpu
@pytest.mark.parametrize("shape,dtype", [((1023, 777), torch.float32), ((5, 7, 300), torch.bfloat16)])
def test_liger_rms_norm_against_the_reference(shape, dtype, gen, device):
    from molds.kernels.liger import liger_rms_norm

    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=gen)
    # bf16: the output is rounded to bf16 before it is widened to the promoted dtype
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1.6e-2, 1e-2)
    _compare(lambda x, w: liger_rms_norm(x, w, 1e-6), lambda x, w: rms_norm_reference(x, w, 1e-6), [x, w], gen,
             *tol, device)


@needs_liger
@on_gpu
@pytest.mark.parametrize("shape,dtype", [((1023, 777), torch.float32), ((3, 5, 4099), torch.bfloat16)])
def test_liger_swiglu_against_the_reference(shape, dtype, gen, device):
    from molds.kernels.liger import liger_swiglu

    a, b = (torch.randn(shape, generator=gen) * 2).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1.6e-2, 1e-2)
    _compare(liger_swiglu, swiglu_reference, [a, b], gen, *tol, device)


@needs_liger
@on_gpu
def test_a_whole_moe_decoder_through_liger_equals_molds_kernels():
    reference = moe_model(shared_expert_size=16)
    batch = {k: v.cuda() for k, v in _batch().items()}
    results = {}
    for backend in ("molds", "liger"):
        model, loss = copy.deepcopy(reference).cuda(), CausalLMLoss()
        apply_kernels(model, KernelsConfig(triton=True, fused_backend=backend), loss, "cuda")
        if backend == "liger":
            assert "rms_norm x13 (Liger Kernel), swiglu x6 (Liger Kernel)" in kernel_summary(model, "cuda")
            assert "linear_cross_entropy x1 (Liger Kernel)" in kernel_summary(model, "cuda")
        results[backend] = _loss_and_grads(model, loss, batch)
    (a, ga), (b, gb) = results["liger"], results["molds"]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in gb:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-5 * float(gb[name].abs().max()), msg=name)
