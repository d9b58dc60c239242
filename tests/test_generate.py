"""Hugging Face `generate()` on rgpu: the stop check runs ahead (rgpu.generation), and what the
caller gets is what local CPU torch gives — tokens, scores, the returned cache, streamed tokens,
and the random numbers drawn afterwards — while the waits no longer grow with the tokens."""

from __future__ import annotations

import copy

import pytest
import torch

import rgpu

transformers = pytest.importorskip("transformers")
from rgpu import generation  # noqa: E402

PROMPT = torch.tensor([[5, 17, 3, 42, 8, 1, 77]])


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300,
                                     n_positions=128, bos_token_id=0, eos_token_id=299,
                                     initializer_range=0.5)  # varied tokens  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=300, bos_token_id=0, eos_token_id=299,
        attn_implementation="eager", initializer_range=0.5,  # varied tokens, not one repeated
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(params=["gpt2", "llama"])
def pair(request, dev):
    """(CPU model, the same model on rgpu)."""
    cpu = _gpt2() if request.param == "gpt2" else _llama()
    return cpu, copy.deepcopy(cpu).to(dev)


@pytest.fixture(params=["gpt2", "llama"])
def slow_pair(request, proxied):
    """(CPU model, the same model on rgpu over a 60 ms round trip), and the steps each
    generate() undid: over such a link the answer "finished" arrives several steps late."""
    rgpu.connect(proxied(latency_s=0.03).url)
    cpu = _gpt2() if request.param == "gpt2" else _llama()
    undone: list[int] = []
    finish = generation.LookaheadStopCheck.finish

    def spy(self):
        undone.append(finish(self))
        return undone[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generation.LookaheadStopCheck, "finish", spy)
        yield cpu, copy.deepcopy(cpu).to("rgpu"), undone


@pytest.fixture
def lookahead():
    saved = rgpu.settings.generate_lookahead
    yield lambda n: setattr(rgpu.settings, "generate_lookahead", n)
    rgpu.settings.generate_lookahead = saved


def _eos_mid_way(cpu, prompt, at: int, **kwargs) -> int:
    """A token the CPU model emits for the first time `at` tokens into its answer: as the EOS
    token, generation stops there, mid-way through the steps it was allowed."""
    out = cpu.generate(prompt, max_new_tokens=40, pad_token_id=0, **kwargs)[0, prompt.shape[1] :]
    for i in range(at, len(out)):
        if int(out[i]) not in out[:i].tolist():
            return int(out[i])
    raise AssertionError(f"no new token after position {at} in {out.tolist()}")


def _waits(fn) -> tuple[object, int]:
    torch.rgpu.synchronize()
    before = rgpu.stats()["waits"]
    result = fn()
    return result, rgpu.stats()["waits"] - before


def test_greedy_tokens_equal_the_cpu_and_stop_at_the_eos(pair):
    cpu, model = pair
    eos = _eos_mid_way(cpu, PROMPT, at=12)
    kwargs = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos)
    expected = cpu.generate(PROMPT, **kwargs)
    assert expected.shape[1] < PROMPT.shape[1] + 40 and int(expected[0, -1]) == eos
    got = model.generate(PROMPT.to("rgpu"), **kwargs).cpu()
    assert torch.equal(got, expected)


def test_generate_under_the_default_device_rgpu_gives_the_cpus_tokens(pair, dev):
    """With `torch.set_default_device("rgpu")` the stop check's host buffer was made on rgpu:
    generate failed at its first token ("byte_view needs a contiguous CPU tensor")."""
    cpu, model = pair
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = cpu.generate(PROMPT, **kwargs)
    torch.set_default_device(dev)
    try:
        got = model.generate(PROMPT.to(dev), **kwargs)
    finally:
        torch.set_default_device(None)
    assert torch.equal(got.cpu(), expected)


def test_a_left_padded_batch_has_the_cpus_tokens_scores_and_logits(pair):
    """The prompt's last position goes to `lm_head` as a slice (`logits_to_keep=1`): its scores
    were 1 ulp off the CPU's before `whole_ops` folded that matmul as local torch does."""
    cpu, model = pair
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(6, 300, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True,
                  output_logits=True, return_dict_in_generate=True)  # fmt: skip
    want = cpu.generate(ids, attention_mask=mask, **kwargs)
    got = model.generate(ids.to("rgpu"), attention_mask=mask.to("rgpu"), **kwargs)
    assert torch.equal(got.sequences.cpu(), want.sequences)
    assert len(got.scores) == len(want.scores) == len(got.logits) == 8
    for mine, theirs in zip((*got.scores, *got.logits), (*want.scores, *want.logits)):
        assert torch.equal(mine.cpu(), theirs)


def test_the_waits_do_not_grow_with_the_tokens(slow_pair, lookahead):
    # over a 60 ms round trip no answer is there before its read, so each read is one wait (on
    # loopback a busy machine sometimes has the answer already, and the count moves by one)
    _, model, _ = slow_pair
    prompt = PROMPT.to("rgpu")

    def run(n):
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)

    lookahead(1000)  # never blocks in the loop: the one wait left is at the end
    (short, few), (long, many) = _waits(lambda: run(4)), _waits(lambda: run(24))
    assert many == few and long.shape[1] == short.shape[1] + 20
    lookahead(0)  # transformers' own check: one wait per token
    (_, few), (_, many) = _waits(lambda: run(4)), _waits(lambda: run(24))
    assert many - few == 20


def test_sampling_equals_the_cpu_and_leaves_the_generator_where_the_cpu_does(slow_pair):
    cpu, model, undone = slow_pair
    sampling = dict(do_sample=True, top_k=20)
    for seed in range(4):
        torch.manual_seed(seed)
        eos = _eos_mid_way(cpu, PROMPT, at=6, **sampling)  # where this seed's answer ends
        kwargs = dict(max_new_tokens=30, pad_token_id=0, eos_token_id=eos, **sampling)
        torch.manual_seed(seed)
        expected = cpu.generate(PROMPT, **kwargs)
        after = torch.randn(4)
        torch.manual_seed(seed)
        got = model.generate(PROMPT.to("rgpu"), **kwargs).cpu()
        assert torch.equal(got, expected), seed
        # the steps run past the end drew random numbers too: the generator is set back
        assert torch.equal(torch.randn(4, device="rgpu").cpu(), after), seed
    assert min(undone) > 0  # every run stopped on its EOS with steps to take back


def test_an_early_stop_is_undone_in_scores_and_the_returned_cache(slow_pair, lookahead):
    cpu, model, undone = slow_pair
    lookahead(16)
    eos = _eos_mid_way(cpu, PROMPT, at=5)
    kwargs = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)  # fmt: skip
    expected = cpu.generate(PROMPT, **kwargs)
    got = model.generate(PROMPT.to("rgpu"), **kwargs)
    assert torch.equal(got.sequences.cpu(), expected.sequences)
    assert len(got.scores) == len(expected.scores) == expected.sequences.shape[1] - PROMPT.shape[1]
    for a, b in zip(got.scores, expected.scores):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
    assert len(got.logits) == len(expected.logits)
    cache, ref = got.past_key_values, expected.past_key_values
    assert cache.get_seq_length() == ref.get_seq_length()
    for layer, ref_layer in zip(cache.layers, ref.layers):
        torch.testing.assert_close(layer.keys.cpu(), ref_layer.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values.cpu(), ref_layer.values, rtol=1e-5, atol=1e-5)
    assert undone[0] > 0


class Collect:
    """A streamer that keeps what it is given."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        assert value.device.type == "cpu"
        self.puts.append(value.tolist())

    def end(self) -> None:
        self.ended += 1


def test_a_streamer_gets_the_cpu_tokens_and_none_past_the_end(slow_pair, lookahead):
    cpu, model, undone = slow_pair
    lookahead(16)
    eos = _eos_mid_way(cpu, PROMPT, at=7)
    kwargs = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos)
    expected, got = Collect(), Collect()
    cpu.generate(PROMPT, streamer=expected, **kwargs)
    model.generate(PROMPT.to("rgpu"), streamer=got, **kwargs)
    assert got.puts == expected.puts and got.ended == expected.ended == 1
    assert got.puts[-1] == [eos]
    assert undone[0] > 0


def test_a_batch_whose_rows_finish_at_different_steps(slow_pair):
    cpu, model, undone = slow_pair
    prompts = torch.tensor([[0, 0, 5, 17, 3, 42], [9, 8, 7, 6, 5, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    free = cpu.generate(prompts, attention_mask=mask, max_new_tokens=30, pad_token_id=0)[:, 6:]
    first = [{}, {}]  # token -> where each row first emits it
    for row, seen in zip(free.tolist(), first):
        for i, t in enumerate(row):
            seen.setdefault(t, i)
    # a token both rows emit, past the start, at different steps: as EOS it ends them apart
    eos = min((t for t in first[0] if t in first[1] and min(first[0][t], first[1][t]) >= 3
               and first[0][t] != first[1][t]), key=lambda t: max(first[0][t], first[1][t]))  # fmt: skip
    kwargs = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=eos)
    expected = cpu.generate(prompts, attention_mask=mask, **kwargs)
    got = model.generate(prompts.to("rgpu"), attention_mask=mask.to("rgpu"), **kwargs).cpu()
    assert torch.equal(got, expected)
    assert expected.shape[1] < prompts.shape[1] + 30 and undone[0] > 0  # both rows ended early


def test_the_stop_check_is_rgpus_only_for_rgpu_tensors():
    import transformers.generation.utils as gu

    assert gu.DeferredStopCheck.rgpu_lookahead
    assert not gu.DeferredStopCheck.is_supported(torch.device("cpu"), None, False, False)
    assert gu.DeferredStopCheck.is_supported(torch.device("rgpu"), None, False, False)
    assert not gu.DeferredStopCheck.is_supported(torch.device("rgpu"), None, False, True)
    assert not generation.patch(gu)  # once is enough


def test_a_returned_sliding_window_cache_keeps_the_wait_per_token(dev):
    """A sliding-window layer forgets what an undo would need: there rgpu checks every step."""
    config = transformers.MistralConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=100, sliding_window=4,
    )  # fmt: skip
    sliding = transformers.DynamicCache(config=config)
    assert not generation.lookahead_applies(sliding, True, False)
    assert generation.lookahead_applies(sliding, False, False)  # dropped at the end: no matter
    full = transformers.DynamicCache(config=transformers.GPT2Config(n_layer=2))
    assert generation.lookahead_applies(full, True, False)


def test_a_state_the_model_keeps_itself_comes_back_as_the_cpus(proxied, lookahead):
    """RWKV has no cache after the prefill: it keeps its state under another name, where no undo
    reaches. Returned to the caller, it must hold what the CPU's holds: no steps past the EOS."""
    rgpu.connect(proxied(latency_s=0.03).url)  # answers arrive steps late: the loop runs ahead
    lookahead(8)
    torch.manual_seed(0)
    config = transformers.RwkvConfig(num_hidden_layers=2, hidden_size=32, vocab_size=300,
                                     context_length=64, attention_hidden_size=32,
                                     intermediate_size=64)  # fmt: skip
    cpu = transformers.RwkvForCausalLM(config).eval()
    model = copy.deepcopy(cpu).to("rgpu")
    eos = _eos_mid_way(cpu, PROMPT, at=3)
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=eos,
                  return_dict_in_generate=True)  # fmt: skip
    expected = cpu.generate(PROMPT, **kwargs)
    got = model.generate(PROMPT.to("rgpu"), **kwargs)
    assert torch.equal(got.sequences.cpu(), expected.sequences)
    assert expected.sequences.shape[1] < PROMPT.shape[1] + 20  # it did stop at the EOS
    assert len(got.past_key_values) == len(expected.past_key_values) == 5
    for state, ref in zip(got.past_key_values, expected.past_key_values):
        torch.testing.assert_close(state.cpu(), ref, rtol=1e-5, atol=1e-5)
    # dropped at the end, the state needs no undo: the loop may run ahead
    assert generation.lookahead_applies(None, False, False)
    assert not generation.lookahead_applies(None, True, False)


def test_a_negative_lookahead_is_refused():
    with pytest.raises(ValueError, match="generate_lookahead must be 0 or more"):
        rgpu.settings.generate_lookahead = -1


def test_a_tokens_two_requests_leave_in_one_frame(pair):
    # the generator's state is asked for unsent and goes out with the stop answer's request:
    # one frame per token (and one wake of the writer thread), not two
    from rgpu.generation import LookaheadStopCheck

    sess = rgpu.current_session()
    check = LookaheadStopCheck(sess, None, None, None, lookahead=1000)
    unfinished = torch.ones(2, dtype=torch.long, device="rgpu")
    tokens = torch.ones(2, dtype=torch.long, device="rgpu")
    torch.rgpu.synchronize()
    before = rgpu.stats()
    for step in range(5):
        assert not check(unfinished, tokens, 10 + step)
    after = rgpu.stats()
    assert after["frames"] - before["frames"] == 5
    assert check.finish() == 0
