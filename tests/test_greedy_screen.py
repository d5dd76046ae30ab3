"""The greedy screen (tc/model/greedy_screen.py): an int8 screen of a bf16 lm_head finds the token that the full
product's greedy choice finds, ties included; a step that needs more than the argmax reads every logit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tc.local import load_local_generator
from tc.model import native
from tc.model.greedy_screen import SCREEN_MAX_SHARE, GreedyScreen
from tc.model.quant import quantize_linears
from tc.sampling import SamplingParams, greedy
from tiny_model import write_tiny_model

needs_native = pytest.mark.skipif(native.kernels() is None, reason="no native int8 product on this machine")


def bf16_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 0.05).bfloat16()


def activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 rows with the outliers real hidden states have: a few channels far larger than the rest, which
    coarsen their blocks' activation codes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[:, 3] *= 30
    x[:, cols // 2 + 5] *= -12
    return x.bfloat16()


def full_choice(weight: torch.Tensor, x: torch.Tensor) -> list[int]:
    """Each row's greedy token as the head finds it without the screen: the bf16 product, widened, argmax."""
    return [greedy(row) for row in F.linear(x, weight).float()]


def screened_choice(screen: GreedyScreen, x: torch.Tensor) -> list[int] | None:
    found = screen.candidates(x.contiguous())
    if found is None:
        return None
    ids, logits = found
    return ids[logits.argmax(dim=1)].tolist()


@needs_native
def test_the_screen_finds_the_full_products_token_row_by_row_and_in_a_batch():
    weight = bf16_weight(1000, 128, seed=1)  # 1000 rows: not whole blocks of the screen's 64, the last one padded
    screen = GreedyScreen(weight, native.kernels())
    x = activations(300, 128, seed=2)
    for i in range(len(x)):
        assert screened_choice(screen, x[i:i + 1]) == full_choice(weight, x[i:i + 1]), i
    for start in range(0, 64, 8):  # a batch's rows: each its own token, from the rows kept for any of them
        assert screened_choice(screen, x[start:start + 8]) == full_choice(weight, x[start:start + 8])


@needs_native
def test_the_screen_finds_the_full_products_token_where_the_int8_logits_alone_would_not():
    # rows close to one another and activations along them: the best logits lie within the int8 copy's error
    g = torch.Generator().manual_seed(11)
    base = torch.randn(128, generator=g) * 0.05
    weight = (base + 0.02 * torch.randn(1000, 128, generator=g)).bfloat16()
    x = (base * 40 + torch.randn(300, 128, generator=g)).bfloat16()
    x[:, 3] *= 8
    screen = GreedyScreen(weight, native.kernels())
    full = full_choice(weight, x)
    int8_alone = screen.screen(x).argmax(dim=1).tolist()
    assert sum(a != b for a, b in zip(int8_alone, full)) >= 20  # the int8 logits' own argmax is often wrong here
    answered = 0
    for i in range(len(x)):
        got = screened_choice(screen, x[i:i + 1])
        if got is not None:  # else too many rows were kept: the full product answers
            assert got == full[i:i + 1], i
            answered += 1
    assert answered >= 200


def worst_share_of_the_bound(screen: GreedyScreen, x: torch.Tensor) -> float:
    """max over rows of x and of the vocabulary of |screen logit - real logit| / its bound (1 or more: broken)."""
    screened = screen.screen(x.contiguous()).double()
    real = x.double() @ screen.weight.double().t()
    worst = 0.0
    for i, row in enumerate(x.float().numpy()):
        a, b = screen.bound_terms(row)
        bound = a * screen.error_norm.double() + b * screen.norm_bound.double()
        worst = max(worst, float(((screened[i] - real[i]).abs() / bound).max()))
    return worst


def int8_exact_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A bf16 weight its int8 copy holds exactly: codes up to 127 (one of each row at 127) times a power of 2."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, cols), generator=g).float()
    codes[:, 0] = 127
    return (codes * 2.0 ** -11).bfloat16()


@needs_native
def test_the_bound_covers_each_source_of_error_alone_and_together():
    # the weights exact in int8: all of the error is the activations' quantization (outliers make it large)
    weight = int8_exact_weight(512, 128, seed=12)
    screen = GreedyScreen(weight, native.kernels())
    assert float(screen.error_norm.abs().max()) == 0.0
    x = activations(64, 128, seed=13)
    assert 0.05 < worst_share_of_the_bound(screen, x) < 1
    # the activations exact in int8 (codes of +-127 times a power of 2): all of it is the weights', made large
    # by a column of outliers that coarsens every row's int8 step
    g = torch.Generator().manual_seed(14)
    exact_x = ((torch.randint(0, 2, (64, 128), generator=g) * 2 - 1) * 127 * 2.0 ** -6).bfloat16()
    weight = bf16_weight(512, 128, seed=15)
    weight[:, 7] *= 20
    screen = GreedyScreen(weight, native.kernels())
    assert 0.05 < worst_share_of_the_bound(screen, exact_x) < 1
    assert 0.05 < worst_share_of_the_bound(screen, x) < 1


def signs(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1


def rows_after(best: torch.Tensor, second: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A vocabulary of 64 bf16 rows: `best` at 5, `second` at 9, and the rest with logits far below theirs for x
    (its first activation times the largest weight of the opposite sign, the other weights 0)."""
    weight = torch.zeros(64, len(best))
    weight[:, 0] = -float(x[0].sign()) * 127 * 2.0 ** -11
    weight[5], weight[9] = best, second
    return weight.bfloat16()


def assert_the_screen_keeps_row_5(weight: torch.Tensor, x: torch.Tensor) -> None:
    """The int8 logits put row 9 first, the full product row 5, and the screen finds row 5."""
    screen = GreedyScreen(weight, native.kernels())
    assert screen.screen(x).argmax().item() == 9 and full_choice(weight, x) == [5]
    assert screened_choice(screen, x) == [5]


@needs_native
@pytest.mark.parametrize("along", ["row 5", "row 9"])
def test_a_row_that_only_the_activations_quantization_puts_below_another_is_kept(along):
    # activations half a step off their int8 codes (0.5 of a block's step of 1/64 rounds to 0), the weights exact,
    # and one row along that error (its bound's activation term, ~0.031, tight but for each block's largest): row
    # 5, whose int8 logit is then 0.030 under its real one, or row 9, 0.030 over it. Either way the int8 logits
    # put row 9 first by 0.021 and the real ones row 5 by ~0.009. The blocks' largest activations cancel in the
    # logits, which keeps them near 0, where the bf16 margin is small.
    sign = signs(64, seed=21)
    x = sign * 2.0 ** -7
    x[0], x[32] = 127 * 2.0 ** -6, -127 * 2.0 ** -6
    aligned, plain = sign * 127 * (1 if along == "row 5" else -1), torch.zeros(64)
    aligned[0], aligned[32] = 127, 127
    plain[0], plain[32] = (127, 105) if along == "row 5" else (105, 127)
    best, second = (aligned, plain) if along == "row 5" else (plain, aligned)
    weight, x = rows_after(best * 2.0 ** -11, second * 2.0 ** -11, x), x.bfloat16()[None]
    assert_the_screen_keeps_row_5(weight, x)


@needs_native
@pytest.mark.parametrize("along", ["row 5", "row 9"])
def test_a_row_that_only_its_weights_quantization_puts_below_another_is_kept(along):
    # activations exact in int8, one row's weights half a step off their codes along them (its bound's weight
    # term, ~0.031, tight): row 5's 2.5 rounding to 2, its int8 logit 0.030 under its real one, or row 9's 1.5
    # rounding to 2, 0.030 over it. Either way the int8 logits put row 9 first by 0.026 and the real ones row 5
    # by ~0.004. The first column cancels the rest in the logits, which keeps them near 0.
    sign = signs(64, seed=22)
    x = sign * 127 * 2.0 ** -6
    aligned = sign * (2.5 if along == "row 5" else 1.5)
    plain = sign * 2
    plain[1:28] += sign[1:28] * (1 if along == "row 5" else -1)
    aligned[0] = plain[0] = -sign[0] * 127
    best, second = (aligned, plain) if along == "row 5" else (plain, aligned)
    weight, x = rows_after(best * 2.0 ** -11, second * 2.0 ** -11, x), x.bfloat16()[None]
    assert_the_screen_keeps_row_5(weight, x)


@needs_native
def test_the_unrounded_int8_product_is_the_rounded_one_before_its_rounding():
    weight = bf16_weight(512, 96, seed=3)
    screen = GreedyScreen(weight, native.kernels())
    x = activations(2, 96, seed=4)
    unrounded = screen.screen(x)
    rounded = native.kernels().int8_product(x, screen.qweight, screen.scale, None, widened=True)
    assert unrounded.dtype == torch.float32
    assert torch.equal(unrounded.bfloat16().float(), rounded)
    assert not torch.equal(unrounded, rounded)  # the screen's bound counts on its sums left unrounded


@needs_native
def test_logits_that_round_equal_go_to_the_first_row_as_in_the_full_product():
    weight = bf16_weight(640, 64, seed=5)
    x = (weight[70].float() * 40).bfloat16()[None]  # row 70's logit is the largest by far
    weight[300] = weight[70]  # a later row with the same logit
    # an earlier row whose logit is a hair below row 70's, too little to change its bf16 value: the full product
    # finds the two equal, and takes the first
    j = int(x[0].float().abs().argmin())
    direction = -1.0 if x[0, j] > 0 else 1.0
    weight[20] = weight[70]
    weight[20, j] = (weight[70, j].float() + direction * weight[70, j].float().abs() * 2 ** -7).bfloat16()
    exact = x.float() @ weight.float().t()
    assert exact[0, 20] < exact[0, 70]
    assert F.linear(x, weight)[0, 20] == F.linear(x, weight)[0, 70] == F.linear(x, weight)[0, 300]
    assert full_choice(weight, x) == [20]
    assert screened_choice(GreedyScreen(weight, native.kernels()), x) == [20]


@needs_native
def test_logits_that_round_equal_go_to_the_first_row_where_the_bounds_alone_part_them():
    # each activation of the first block 126.5 block steps (rounds down to 126), of the second 125.5 (rounds up):
    # row 5 along the first block, its int8 logit 15.5 units (127 * 2 ** -17) under its real one, row 9 along the
    # second, 15.5 over it; their bounds (~22.3 each, tight up to a block's largest activation and the other
    # block) leave row 5's upper bound 1.4 under row 9's lower one, where their real logits (3927.5 and 3942.5
    # units) round to the same bf16 value: only the margin for the output's rounding keeps row 5
    sign = signs(64, seed=23)
    x = torch.cat([sign[:32] * 126.5, sign[32:] * 125.5]) * 2.0 ** -6
    x[0] = x[32] = 127 * 2.0 ** -6
    first, second = torch.cat([sign[:32], torch.zeros(32)]) * 127, torch.cat([torch.zeros(32), sign[32:]]) * 127
    first[0], second[32] = 6, 52
    weight, x = rows_after(first * 2.0 ** -11, second * 2.0 ** -11, x), x.bfloat16()[None]
    exact = x.float() @ weight.float().t()
    assert exact[0, 5] < exact[0, 9] and F.linear(x, weight)[0, 5] == F.linear(x, weight)[0, 9]
    assert_the_screen_keeps_row_5(weight, x)


@needs_native
def test_rows_that_are_not_finite_or_too_wide_a_choice_are_left_to_the_full_product():
    weight = bf16_weight(512, 64, seed=6)
    screen = GreedyScreen(weight, native.kernels())
    x = activations(1, 64, seed=7)
    x[0, 5] = float("inf")
    assert screen.candidates(x) is None
    same = bf16_weight(1, 64, seed=8).expand(512, 64).contiguous()  # every logit alike: every row a candidate
    assert SCREEN_MAX_SHARE > 1
    assert GreedyScreen(same, native.kernels()).candidates(activations(1, 64, seed=9)) is None


def test_a_screen_takes_only_a_bf16_weight_the_native_product_can_tile():
    kernels = native.kernels()
    with pytest.raises(ValueError, match="bf16 weight"):
        GreedyScreen(bf16_weight(512, 64, 0).float(), kernels)
    with pytest.raises(ValueError, match="bf16 weight"):
        GreedyScreen(bf16_weight(510, 64, 0), kernels)  # rows not whole tiles of 8


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("bf16"), seed=3, dtype=torch.bfloat16)


def counted(screen: GreedyScreen) -> list[int]:
    """Count the steps that ask `screen` (its answers unchanged)."""
    calls = [0]
    candidates = screen.candidates

    def counting(*args):
        calls[0] += 1
        return candidates(*args)

    screen.candidates = counting
    return calls


@needs_native
def test_greedy_generation_with_the_screen_makes_the_same_tokens(bf16_model_dir):
    generator = load_local_generator(bf16_model_dir, "bf16", pack_head=False)
    head = generator.head
    screen = head.greedy_screen or GreedyScreen(head.lm_head.weight, native.kernels())  # its probe may decline
    calls = counted(screen)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for prompt in ([5, 9, 14], [200, 3, 77, 41, 8]):
        head.greedy_screen = None
        plain = generator.generate(prompt, params)
        head.greedy_screen = screen
        before = calls[0]
        screened = generator.generate(prompt, params)
        assert screened.token_ids == plain.token_ids
        assert calls[0] - before == 24  # every token of it chosen by the screen


@needs_native
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=4, temperature=0.7, seed=1),  # sampled
    SamplingParams(max_tokens=4, temperature=0, logprobs=2),  # log-probabilities read every logit
    SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.3),  # penalties change them first
    SamplingParams(max_tokens=4, temperature=0, min_tokens=4),  # EOS held back
    SamplingParams(max_tokens=4, temperature=0, logit_bias=((5, -100.0), (9, 3.0))),  # the bias moves the argmax
])
def test_a_step_that_needs_more_than_the_argmax_reads_every_logit(bf16_model_dir, params):
    generator = load_local_generator(bf16_model_dir, "bf16", pack_head=False)
    screen = generator.head.greedy_screen = GreedyScreen(generator.head.lm_head.weight, native.kernels())
    calls = counted(screen)
    greedy_one = generator.start([5, 9, 14], SamplingParams(max_tokens=4, temperature=0))
    other = generator.start([7, 7, 2], params)
    while greedy_one.completion is None:  # one step for both: the other's choice needs the logits of all rows
        assert not any(isinstance(step, Exception)
                       for _, step in generator.step([s for s in (greedy_one, other) if s.completion is None]))
    assert calls[0] == 0
    generator.head.greedy_screen = None
    assert greedy_one.completion.token_ids == generator.generate([5, 9, 14], greedy_one.params).token_ids


@needs_native
def test_a_screen_made_for_another_lm_head_is_not_used(bf16_model_dir):
    generator = load_local_generator(bf16_model_dir, "bf16", pack_head=False)
    head = generator.head
    head.greedy_screen = GreedyScreen(head.lm_head.weight, native.kernels())
    assert head.greedy_tokens(head.embed_ids([4])) is not None
    quantize_linears(head, "int8")  # the lm_head replaced: the screen no longer says what it computes
    calls = counted(head.greedy_screen)
    hidden = head.embed_ids([4])
    assert head.greedy_tokens(hidden) == [greedy(head.logits(hidden)[0, 0])]  # the int8 lm_head's plan answers
    assert calls[0] == 0
    assert head.screen_greedy() is None and head.greedy_screen is None  # nothing to screen in an int8 lm_head


@needs_native
def test_under_a_final_softcap_logits_that_cap_equal_go_to_the_first_row_as_in_the_full_product(bf16_model_dir):
    generator = load_local_generator(bf16_model_dir, "bf16", pack_head=False)
    head = generator.head
    head.greedy_screen = GreedyScreen(head.lm_head.weight, native.kernels())
    # the tiny model's best logits are ~2: capped at 0.2, tanh(10) rounds to 1 in float32, so logits well apart
    # cap to the same 0.2, and the full product takes the first of them, not the largest
    head.final_softcap = 0.2
    hidden = torch.randn(1, 64, head.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    answered = 0
    for i in range(hidden.shape[1]):
        got = head.greedy_tokens(hidden[:, i:i + 1])
        if got is not None:
            assert got == [greedy(head.logits(hidden[:, i:i + 1])[0, 0])], i
            answered += 1
    assert answered >= 32


@needs_native
def test_the_screen_can_be_turned_off_for_the_memory_it_takes(bf16_model_dir, monkeypatch):
    generator = load_local_generator(bf16_model_dir, "bf16", pack_head=False)
    monkeypatch.setenv("TC_GREEDY_SCREEN", "0")
    generator.head.greedy_screen = GreedyScreen(generator.head.lm_head.weight, native.kernels())
    assert generator.head.screen_greedy() is None and generator.head.greedy_screen is None


@needs_native
def test_a_head_whose_screen_cannot_be_made_starts_without_it(bf16_model_dir, caplog):
    generator = load_local_generator(bf16_model_dir, "bf16", pack_head=False)
    head = generator.head
    weight = head.lm_head.weight.detach().clone()
    weight[3, 0] = float("inf")  # a row the screen cannot bound: greedy steps then read the whole lm_head
    head.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)
    assert head.screen_greedy() is None and head.greedy_screen is None
    assert "no int8 screen" in caplog.text


@needs_native
def test_demo_greedy_tokens_are_the_full_products(demo_model_dir):
    generator = load_local_generator(demo_model_dir, "bf16", pack_head=False)
    head = generator.head
    screen = head.greedy_screen or GreedyScreen(head.lm_head.weight, native.kernels())
    calls = counted(screen)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for text in ("def quicksort(arr):", "The capital of France is", "import numpy as np\n# the mean of a list"):
        prompt = generator.tokenizer.encode(text)
        head.greedy_screen = None
        plain = generator.generate(prompt, params)
        head.greedy_screen = screen
        assert generator.generate(prompt, params).token_ids == plain.token_ids, text
    assert calls[0] == 3 * 40


@needs_native
@pytest.mark.parametrize("screen_off", [False, True])
def test_the_head_never_blocks_an_lm_head_a_greedy_screen_can_take(bf16_model_dir, monkeypatch, screen_off):
    """The screen reads the rows it keeps from the plain weight, which the blocked layout replaces: where a screen
    is possible the head's probe chooses between the plain and the native product only, even where it would find
    the blocked one fastest (as it did under load; its verdict is given here); with the screen off, as before."""
    from tc.model import dense
    from tc.model.config import ModelConfig
    from tc.model.qwen2 import HeadModel
    from tc.model.weights import WeightIndex

    if screen_off:
        if not dense.can_pack():
            pytest.skip("no oneDNN blocked bf16 linear on this CPU")
        monkeypatch.setenv("TC_GREEDY_SCREEN", "0")
    other = "native" if dense.native_bf16_available() else "plain"
    asked = []
    monkeypatch.setattr(dense, "fastest_product", lambda out_f, in_f, dtype, allowed:
                        asked.append(allowed) or ("packed" if "packed" in allowed else other))
    head = HeadModel.load(ModelConfig.from_file(bf16_model_dir / "config.json"), WeightIndex.open(bf16_model_dir),
                          torch.bfloat16, pack=None)
    assert len(asked) == 1  # the lm_head, which is its own matrix here
    if screen_off:
        assert "packed" in asked[0] and isinstance(head.lm_head, dense.PackedLinear)
    else:
        assert "packed" not in asked[0] and not isinstance(head.lm_head, dense.PackedLinear)
        screen = GreedyScreen(head.lm_head.weight, native.kernels())
        x = torch.randn(1, head.config.hidden_size).bfloat16()
        ids, _ = screen.candidates(x)
        assert int(greedy(head.lm_head(x)[0])) in ids.tolist()
