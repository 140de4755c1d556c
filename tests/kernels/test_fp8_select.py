"""``kernels.fp8_products=faster``: only the products FP8 measured faster on are converted,
the ranks agree on the times, a resume keeps the choice it continues, and the recipe
rules. The converted model is checked against one whose modules are swapped by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from molds.checkpoint.resume import resumed_fp8_products
from molds.errors import RecipeError
from molds.kernels import apply_kernels, kernel_summary
from molds.kernels.fp8_linear import Fp8GroupedMM, Fp8Linear
from molds.kernels.fp8_select import Fp8Choice, choose_fp8_products, model_products, time_product
from molds.models.loss import CausalLMLoss
from molds.models.moe import Experts
from molds.recipe.sections import KernelsConfig
from tests.kernels.test_converters import _batch
from tests.test_moe import moe_model

FASTER = KernelsConfig(fp8=True, fp8_products="faster")


def stub(fp8_wins):
    """Times where FP8 takes 1 s on the keys in ``fp8_wins`` and 3 s elsewhere, the plain
    product 2 s: the measurement replaced by a known answer."""
    calls = []

    def measure(key, tokens, device, dtype, fp8, options):
        calls.append((key, tokens, fp8))
        return (1.0 if key in fp8_wins else 3.0) if fp8 else 2.0

    return measure, calls


def test_only_the_products_fp8_measured_faster_are_converted():
    reference = moe_model(shared_expert_size=16, first_dense_layers=1)
    keys = model_products(reference)
    # hidden 32, 4 heads of 8, 2 kv heads: q and o 32->32, k and v 32->16; the dense MLP
    # 32->48 and 48->32; the shared expert 32->16 and 16->32; experts 4 x 32->24; the LM
    # head (32->40) is not a product unless kernels.fp8_lm_head
    assert ("linear", 32, 40) not in keys and ("experts", 4, 32, 24) in keys and ("linear", 32, 48) in keys
    wins = {("linear", 32, 16), ("experts", 4, 32, 24)}
    measure, calls = stub(wins)
    choice = choose_fp8_products(reference, FASTER, "cpu", None, 96, measure=measure)
    assert {tuple(p["key"]) for p in choice.products} == set(keys) and choice.chosen() == wins
    # a linear multiplies the micro-batch's tokens; an expert set each token top_k (2) times
    assert {c[1] for c in calls if c[0][0] == "linear"} == {96} and len(calls) == 2 * len(keys)
    assert {c[1] for c in calls if c[0][0] == "experts"} == {192}

    model, loss = copy.deepcopy(reference), CausalLMLoss()
    apply_kernels(model, FASTER, loss, "cpu", choice)
    by_hand = copy.deepcopy(reference)
    for m in by_hand.modules():
        if type(m) is nn.Linear and (m.in_features, m.out_features) == (32, 16) and m is not by_hand.lm_head:
            m.__class__, m.fp8_options = Fp8Linear, {"pow2": False, "grad_format": "e5m2"}
        elif isinstance(m, Experts):
            m.grouped_mm = Fp8GroupedMM(pow2=False, grad_format="e5m2")
    swapped = {n for n, m in model.named_modules() if type(m) is Fp8Linear}
    assert swapped == {n for n, m in by_hand.named_modules() if type(m) is Fp8Linear} and swapped
    assert all(isinstance(m.grouped_mm, Fp8GroupedMM) for m in model.modules() if isinstance(m, Experts))
    assert type(model.lm_head) is nn.Linear
    batch = _batch()
    loss = CausalLMLoss()
    assert torch.equal(loss(model(**batch), batch), loss(by_hand(**batch), batch))
    assert not torch.equal(loss(model(**batch), batch), loss(reference(**batch), batch))  # FP8 changed some products
    summary = kernel_summary(model, "cpu")
    assert f"fp8: {len(swapped)} linears" in summary, summary
    line = choice.describe()
    assert f"2 of {len(keys)} in FP8" in line and "linear 32->16 2.00x (fp8)" in line and "linear 32->48 0.67x (fp32)" in line


def test_none_faster_leaves_the_model_as_it_was():
    reference = moe_model(first_dense_layers=1)
    choice = choose_fp8_products(reference, FASTER, "cpu", torch.bfloat16, 96, measure=stub(set())[0])
    model = copy.deepcopy(reference)
    apply_kernels(model, FASTER, CausalLMLoss(), "cpu", choice)
    assert kernel_summary(model, "cpu") == "" and choice.chosen() == set()
    assert "0 of" in choice.describe() and "(bf16)" in choice.describe()


def test_the_ranks_choose_by_their_averaged_times():
    """Each rank measures its own times; the choice follows what ``agree`` returns (the
    mean over ranks), so that every rank converts the same products."""
    reference = moe_model(first_dense_layers=1)
    keys = model_products(reference)
    measure, _ = stub(set(keys))  # this rank alone: FP8 faster everywhere
    other_rank = {tuple(k): (5.0, 2.0) for k in keys}  # the other: FP8 slower everywhere

    def agree(times):
        out = []
        for i, key in enumerate(keys):
            out += [(times[2 * i] + other_rank[key][0]) / 2, (times[2 * i + 1] + other_rank[key][1]) / 2]
        return out

    choice = choose_fp8_products(reference, FASTER, "cpu", None, 96, agree=agree, measure=measure)
    assert choice.chosen() == set() and all(p["fp8_s"] == 3.0 for p in choice.products)


def test_a_resume_keeps_the_choice_of_the_run_it_continues():
    reference = moe_model(first_dense_layers=1)
    first = choose_fp8_products(reference, FASTER, "cpu", None, 96, measure=stub({("linear", 32, 48)})[0])

    def never(*a):
        raise AssertionError("a resume measured again")

    saved = {"fp8_products": first.as_dict()}

    class R:
        class checkpoint:
            fork = False

    again = choose_fp8_products(reference, FASTER, "cpu", None, 96, resumed=resumed_fp8_products(R, saved),
                                measure=never)
    assert again.kept and again.chosen() == first.chosen() == {("linear", 32, 48)}
    assert "which a resume keeps" in again.describe()
    R.checkpoint.fork = True  # a fork measures anew
    assert resumed_fp8_products(R, saved) is None
    R.checkpoint.fork = False
    assert resumed_fp8_products(R, None) is None and resumed_fp8_products(R, {"plan": {}}) is None


def test_all_or_fp8_off_measures_nothing():
    reference = moe_model(first_dense_layers=1)
    never = stub(set())[0]
    assert choose_fp8_products(reference, KernelsConfig(fp8=True), "cpu", None, 96, measure=never) is None
    assert choose_fp8_products(reference, KernelsConfig(), "cpu", None, 96, measure=never) is None
    with pytest.raises(ValueError, match="measure first"):
        apply_kernels(copy.deepcopy(reference), FASTER, CausalLMLoss(), "cpu")


@pytest.mark.parametrize("key", [("linear", 64, 32), ("experts", 4, 32, 24)])
def test_the_measurement_times_a_forward_and_backward(key):
    """The real timer on this CPU: both sides run (FP8 emulated here) and take time; the
    choice is whichever measured less."""
    options = {"pow2": False, "grad_format": "e5m2"}
    fp8 = time_product(key, 64, torch.device("cpu"), None, True, options, seconds=0.0)
    plain = time_product(key, 64, torch.device("cpu"), None, False, options, seconds=0.0)
    assert 0 < fp8 < 10 and 0 < plain < 10 and math.isfinite(fp8 / plain)


ROWWISE_FASTER = KernelsConfig(fp8=True, fp8_recipe="rowwise", fp8_grad_format="e4m3", fp8_experts=True,
                               fp8_products="faster")


@pytest.mark.parametrize("wins", [{("linear", 32, 16), ("experts", 4, 32, 32)}, {("linear", 32, 48)}, set()])
def test_torchaos_recipes_convert_only_what_measured_faster(wins):
    """kernels.fp8_recipe rowwise with the experts (fp8_experts): the products are the
    linears torchao takes and the expert sets; only the winners are converted, and the
    model is the one converted by hand with torchao's own converter (the same loss and
    gradients, bit for bit)."""
    from torchao.float8 import convert_to_float8_training

    from molds.kernels.fp8_torchao import RowwiseGroupedMM, float8_config

    reference = moe_model(shared_expert_size=16, expert_size=32, first_dense_layers=1)
    keys = model_products(reference, False, "rowwise", experts=True)
    assert ("experts", 4, 32, 32) in keys and ("linear", 32, 48) in keys and ("linear", 32, 40) not in keys
    assert ("experts", 4, 32, 32) not in model_products(reference, False, "rowwise", experts=False)
    measure, calls = stub(wins)
    choice = choose_fp8_products(reference, ROWWISE_FASTER, "cpu", None, 96, measure=measure)
    assert choice.chosen() == wins and {tuple(p["key"]) for p in choice.products} == set(keys)
    assert all(c[1] == 192 for c in calls if c[0][0] == "experts")  # top_k 2
    model, loss = copy.deepcopy(reference), CausalLMLoss()
    apply_kernels(model, ROWWISE_FASTER, loss, "cpu", choice)

    by_hand = copy.deepcopy(reference)
    shapes = {k[1:] for k in wins if k[0] == "linear"}
    convert_to_float8_training(by_hand, config=float8_config("rowwise", pow2=False, grad_format="e4m3", emulate=True),
                               module_filter_fn=lambda m, fqn: type(m) is nn.Linear and fqn != "lm_head"
                               and (m.in_features, m.out_features) in shapes)
    for m in by_hand.modules():
        if isinstance(m, Experts) and ("experts", 4, 32, 32) in wins:
            m.grouped_mm = RowwiseGroupedMM()
    got = {n: type(m).__name__ for n, m in model.named_modules()}
    assert got == {n: type(m).__name__ for n, m in by_hand.named_modules()}
    want = sum(type(m) is nn.Linear and m is not reference.lm_head and (m.in_features, m.out_features) in shapes
               for m in reference.modules())
    assert sum(v == "Float8Linear" for v in got.values()) == want and (want > 0) == bool(shapes)
    assert all(isinstance(m.grouped_mm, RowwiseGroupedMM) == (("experts", 4, 32, 32) in wins)
               for m in model.modules() if isinstance(m, Experts))
    batch = _batch()
    for m in (model, by_hand):
        m.zero_grad()
    a, b = loss(model(**batch), batch), CausalLMLoss()(by_hand(**batch), batch)
    a.backward(), b.backward()
    assert float(a.detach()) == float(b.detach())
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
    line = kernel_summary(model, "cpu")
    if not wins:
        assert "fp8" not in line  # nothing converted: the choice's own start line says so
    elif ("experts", 4, 32, 32) in wins:
        assert f"{want} linears -> torchao's emulation" in line and "expert GEMM sets (fp8_experts)" in line
        assert "linears kept their precision (kernels.fp8_products=faster)" in line
    else:
        assert line.startswith("fp8 (rowwise, torchao Float8Linear): ")
        assert "2 expert GEMM sets kept their precision (kernels.fp8_products=faster)" in line


@pytest.mark.parametrize("key", [("linear", 64, 32), ("experts", 4, 32, 32)])
def test_the_measurement_times_torchaos_modules_under_its_recipes(key, monkeypatch):
    """Under kernels.fp8_recipe rowwise the FP8 side timed is torchao's Float8Linear, or the
    experts' row-wise grouped GEMM; the plain side the module as built."""
    import molds.kernels.fp8_select as select
    from molds.kernels.fp8_torchao import RowwiseGroupedMM

    timed, real = [], select._pass
    monkeypatch.setattr(select, "_pass", lambda module, inputs: timed.append(module) or real(module, inputs))
    options = {"pow2": False, "grad_format": "e4m3", "recipe": "rowwise"}
    for fp8 in (True, False):
        assert 0 < time_product(key, 64, torch.device("cpu"), None, fp8, options, seconds=0.0) < 10
    fp8_module, plain = timed
    if key[0] == "linear":
        assert type(fp8_module[0]).__name__ == "Float8Linear" and type(plain) is nn.Linear
    else:
        assert isinstance(fp8_module.grouped_mm, RowwiseGroupedMM)
        assert plain.grouped_mm is torch.nn.functional.grouped_mm


def test_recipe_rules():
    from molds.recipe.parse import check_kernels, parse_recipe

    def recipe(**kernels):
        r = parse_recipe(["--recipe", "recipes/smoke/moe_fp8.json"])
        for k, v in kernels.items():
            setattr(r.kernels, k, v)
        return r

    with pytest.raises(RecipeError, match="kernels.fp8_products applies with kernels.fp8=true"):
        check_kernels(recipe(fp8=False, fp8_products="faster"))
    check_kernels(recipe(fp8=True, fp8_recipe="tensorwise", fp8_products="faster"))  # torchao's recipes too
    check_kernels(recipe(fp8=True, fp8_recipe="rowwise", fp8_grad_format="e4m3", fp8_experts=True,
                         fp8_products="faster"))
    check_kernels(recipe(fp8=True, fp8_products="faster"))
