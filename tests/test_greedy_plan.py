"""The head's greedy plan (tc/model/greedy_plan.py): an int8 lm_head's greedy tokens in a few native calls, the
tokens that the logits through the modules give, in every case that reaches it, and none where it does not take
the rows or the lm_head."""
from __future__ import annotations

import pytest
import torch

from tc.local import load_local_generator
from tc.model import native
from tc.model.greedy_plan import MAX_ROWS, GreedyPlan
from tc.model.quant import quantize_linears
from tc.sampling import SamplingParams, greedy
from tiny_model import write_tiny_model

needs_native = pytest.mark.skipif(native.kernels() is None, reason="no native int8 product on this machine")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("plan"), seed=5, dtype=torch.bfloat16)


def hidden_rows(rows: int, seed: int, width: int = 64) -> torch.Tensor:
    return (torch.randn(1, rows, width, generator=torch.Generator().manual_seed(seed)) * 4).bfloat16()


def full_tokens(head, hidden: torch.Tensor) -> list[int]:
    """Each row's token as a step without the plan finds it: the logits through the modules, sampling.greedy."""
    return [greedy(row) for row in head.logits(hidden)[0]]


def counted(monkeypatch) -> list[int]:
    calls = [0]
    tokens = GreedyPlan.tokens

    def counting(self, hidden):
        found = tokens(self, hidden)
        calls[0] += found is not None
        return found

    monkeypatch.setattr(GreedyPlan, "tokens", counting)
    return calls


@needs_native
@pytest.mark.parametrize("quant", ["int8", "int4"])  # both keep an int8 lm_head
def test_the_plan_finds_the_modules_tokens_row_by_row_and_in_a_batch(model_dir, quant):
    head = load_local_generator(model_dir, "bf16", quant=quant).head
    for rows in (1, 3, MAX_ROWS):
        for seed in range(20):
            hidden = hidden_rows(rows, seed)
            assert head.greedy_tokens(hidden) == full_tokens(head, hidden), (rows, seed)
    assert isinstance(head._greedy_plan, GreedyPlan)
    assert head.greedy_tokens(hidden_rows(MAX_ROWS + 1, 0)) is None  # more rows than its buffers: the logits then
    assert head.greedy_tokens(hidden_rows(1, 0).float()) is None  # not the bf16 rows its kernels take


@needs_native
def test_equal_logits_and_nans_go_as_greedy_has_them(model_dir):
    head = load_local_generator(model_dir, "bf16", quant="fp16", pack_head=False).head
    weight = head.lm_head.weight.detach().clone()
    weight[7] = weight[200]  # rows alike: each logit of token 200 ties with token 7's, and 7 comes first
    head.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)
    quantize_linears(head, "int8")
    hidden = torch.cat([hidden_rows(MAX_ROWS - 1, 1), weight[200].float().view(1, 1, -1).bfloat16() * 8], dim=1)
    expected = full_tokens(head, hidden)
    assert head.greedy_tokens(hidden) == expected and expected[-1] == 7  # the last row's best is the tie
    nan = hidden.clone()
    nan[0, 2, 5] = float("nan")  # a row whose logits are all NaN: the first counts as largest
    assert head.greedy_tokens(nan) == full_tokens(head, nan)
    assert head.greedy_tokens(nan)[2] == 0


@needs_native
def test_greedy_generation_with_the_plan_makes_the_same_tokens(model_dir, monkeypatch):
    generator = load_local_generator(model_dir, "bf16", quant="int4")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    calls = counted(monkeypatch)
    planned = [generator.generate(prompt, params).token_ids for prompt in ([5, 9, 14], [200, 3, 77, 41, 8])]
    assert calls[0] == 2 * 24  # every token of both chosen by the plan
    monkeypatch.setattr(GreedyPlan, "takes", staticmethod(lambda norm, lm_head: False))
    generator.head._greedy_plan = None
    plain = [generator.generate(prompt, params).token_ids for prompt in ([5, 9, 14], [200, 3, 77, 41, 8])]
    assert calls[0] == 2 * 24 and planned == plain


@needs_native
def test_a_step_that_needs_more_than_the_argmax_reads_every_logit(model_dir, monkeypatch):
    generator = load_local_generator(model_dir, "bf16", quant="int8")
    calls = counted(monkeypatch)
    greedy_one = generator.start([5, 9, 14], SamplingParams(max_tokens=4, temperature=0))
    sampled = generator.start([7, 7, 2], SamplingParams(max_tokens=4, temperature=0.7, seed=1))
    while greedy_one.completion is None:  # one step for both: the sampled one's choice needs every logit
        assert not any(isinstance(step, Exception)
                       for _, step in generator.step([s for s in (greedy_one, sampled) if s.completion is None]))
    assert calls[0] == 0
    assert greedy_one.completion.token_ids == generator.generate([5, 9, 14], greedy_one.params).token_ids
    assert calls[0] == 4


@needs_native
def test_a_plan_serves_only_the_modules_and_weights_it_was_made_for(model_dir):
    head = load_local_generator(model_dir, "bf16", quant="int8").head
    hidden = hidden_rows(2, 3)
    plans = []

    def step_makes_a_new_plan():
        assert head.greedy_tokens(hidden) == full_tokens(head, hidden)
        assert head._greedy_plan not in plans and head._greedy_plan.current(head.norm, head.lm_head)
        plans.append(head._greedy_plan)

    step_makes_a_new_plan()
    replaced = load_local_generator(model_dir, "bf16", quant="fp16").head.lm_head
    replaced.weight = torch.nn.Parameter(replaced.weight.flip(0), requires_grad=False)  # other logits, other tokens
    head.lm_head = replaced
    quantize_linears(head, "int8")
    step_makes_a_new_plan()
    head.norm.weight = torch.nn.Parameter(head.norm.weight.detach().flip(0).clone(), requires_grad=False)
    step_makes_a_new_plan()
    head.lm_head.scale.data = head.lm_head.scale.clone() * 2  # the same tensor object, its memory elsewhere
    step_makes_a_new_plan()


@needs_native
def test_a_plan_made_in_inference_mode_serves_outside_it(model_dir):
    head = load_local_generator(model_dir, "bf16", quant="int8").head
    with torch.inference_mode():
        first = head.greedy_tokens(hidden_rows(1, 5))
    assert first == full_tokens(head, hidden_rows(1, 5))
    assert head.greedy_tokens(hidden_rows(1, 6)) == full_tokens(head, hidden_rows(1, 6))


@needs_native
def test_no_plan_where_the_norm_gives_float32_rows(model_dir):
    head = load_local_generator(model_dir, "bf16", quant="int8").head
    head.norm.weight = torch.nn.Parameter(head.norm.weight.detach().float(), requires_grad=False)
    assert head.greedy_tokens(hidden_rows(1, 0)) is None and head._greedy_plan is None


@needs_native
def test_no_plan_where_the_logits_need_more_than_the_lm_head(model_dir):
    head = load_local_generator(model_dir, "bf16", quant="int8").head
    head.final_softcap = 0.2  # its rounding may tie logits the product keeps apart: the logits decide
    assert head.greedy_tokens(hidden_rows(1, 0)) is None and head._greedy_plan is None


@needs_native
@pytest.mark.parametrize("scale, planned", [(0.0625, True), (4.0, True), (0.3, False)])
@pytest.mark.parametrize("kind", ["logit_scale", "logits_scaling"])
def test_a_logit_scale_keeps_the_plan_only_where_it_scales_every_logit_exactly(model_dir, kind, scale, planned):
    """Cohere's logits times a power of two (its published scales), Granite's divided by one (8, 16): each logit
    scaled exactly, so the product's argmax is theirs; another factor's rounding may tie two logits, and then the
    logits decide."""
    head = load_local_generator(model_dir, "bf16", quant="int8").head
    setattr(head, kind, scale)
    for seed in range(10):
        hidden = hidden_rows(3, seed)
        assert head.greedy_tokens(hidden) == (full_tokens(head, hidden) if planned else None), seed
    assert isinstance(head._greedy_plan, GreedyPlan) == planned


def test_no_plan_for_an_lm_head_without_the_native_int8_product(model_dir):
    head = load_local_generator(model_dir, "bf16", quant="fp16").head
    head.greedy_screen = None
    assert head.greedy_tokens(hidden_rows(1, 0)) is None and head._greedy_plan is None
    quantize_linears(head, "int8", use_kernel=False)  # PyTorch's int8 path: nothing for the plan to call
    assert head.greedy_tokens(hidden_rows(1, 0)) is None and head._greedy_plan is None


@needs_native
def test_demo_greedy_tokens_through_the_plan_are_the_modules(demo_model_dir, monkeypatch):
    generator = load_local_generator(demo_model_dir, "bf16", quant="int4")
    calls = counted(monkeypatch)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [generator.tokenizer.encode(text) for text in ("def quicksort(arr):", "The capital of France is")]
    planned = [generator.generate(prompt, params).token_ids for prompt in prompts]
    assert calls[0] == 2 * 32
    monkeypatch.setattr(GreedyPlan, "takes", staticmethod(lambda norm, lm_head: False))
    generator.head._greedy_plan = None
    assert [generator.generate(prompt, params).token_ids for prompt in prompts] == planned
