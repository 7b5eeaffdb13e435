"""The paged engine's scheduler (`linnet_jax.serve.scheduler`, policy without a model: a fake runner) and its
runner (`linnet_jax.serve.runner`) together: a workload that needs more pages than the pool holds completes, each
step within its token budget, decodes first, prompts sharing full pages by reference; greedy and seeded requests
through fewer rows and pages than they need at once each equal `generate`."""

import dataclasses

import jax
import numpy as np
import pytest

import linnet_jax
from linnet_jax import generate, train
from linnet_jax.adapters import AdapterTable
from linnet_jax.inputs import sampling_options, seed_key
from linnet_jax.serve.pages import PagePool
from linnet_jax.serve.runner import PagedRunner
from linnet_jax.serve.scheduler import LENGTH, RUNNING, Scheduler, Sequence, StepResult

PAGE = 4


class FakeRunner:
    """Chooses token 100 + n for a sequence's n-th token, LENGTH at its budget; records each plan."""

    def __init__(self):
        self.plans = []

    def run(self, plan):
        self.plans.append(plan)
        tokens = [(100 + len(part.sequence.output),) for part in plan.scheduled]
        states = [LENGTH if len(part.sequence.output) + 1 >= part.sequence.budget else RUNNING
                  for part in plan.scheduled]
        return StepResult(tuple(tokens), tuple(states))


def drive(scheduler, runner, steps: int = 1000) -> list:
    finished = []
    for _ in range(steps):
        if not scheduler.busy:
            return finished
        plan = scheduler.schedule()
        finished += scheduler.update(plan, runner.run(plan))
    raise AssertionError("the workload did not finish")


def test_a_workload_larger_than_the_pool_completes_within_each_steps_budget():
    pool = PagePool(pages=12, page_size=PAGE)
    scheduler, runner = Scheduler(pool, rows=3, max_len=64, max_step_tokens=8, prefill_chunk=4), FakeRunner()
    sequences = [Sequence(list(range(i, i + 3 + 2 * i)), budget=5) for i in range(8)]  # 8 × up to 22 positions
    for sequence in sequences:
        scheduler.add(sequence)
    finished = drive(scheduler, runner)
    assert sorted(s.id for s in finished) == sorted(s.id for s in sequences)
    assert all(s.output == [100, 101, 102, 103, 104] and s.finish == "length" for s in sequences)
    for plan in runner.plans:
        assert plan.tokens <= 8 and len(plan.scheduled) <= 3
        decodes = [part.start >= len(part.sequence.prompt) for part in plan.scheduled]
        assert decodes == sorted(decodes, reverse=True)  # decoding sequences lead, prefill chunks follow
    assert max(len(plan.scheduled) for plan in runner.plans) == 3  # rows were the bound, not a slot per request
    assert pool.available == pool.pages and scheduler.promised == 0
    with pytest.raises(ValueError, match="more than the pool's 12 pages"):
        scheduler.add(Sequence(list(range(40)), budget=20))
    with pytest.raises(ValueError, match="the prompt has 64 tokens; max_len=64"):
        scheduler.add(Sequence(list(range(64)), budget=1))
    with pytest.raises(ValueError, match="must carry a token of each of the 3 rows"):
        Scheduler(pool, rows=3, max_len=64, max_step_tokens=2, prefill_chunk=4)


def test_prompts_share_their_cached_pages_by_reference():
    pool = PagePool(pages=32, page_size=PAGE)
    scheduler, runner = Scheduler(pool, rows=4, max_len=64, max_step_tokens=16, prefill_chunk=8), FakeRunner()
    system = list(range(50, 62))  # three full pages
    first = Sequence(system + [1, 2], budget=3)
    scheduler.add(first)
    drive(scheduler, runner)
    second, third = Sequence(system + [3], budget=3), Sequence(system[:8] + [9, 9, 9, 9, 9], budget=3)
    scheduler.add(second)
    scheduler.add(third)
    plan = scheduler.schedule()
    assert [part.start for part in plan.scheduled] == [12, 8]  # only the uncached tokens are computed
    assert plan.scheduled[0].pages[:3] == tuple(first.pages[:3])
    assert plan.scheduled[1].pages[:2] == tuple(first.pages[:2])
    drive(scheduler, runner)
    assert pool.counters["hit_tokens"] == 12 + 8 and pool.available == pool.pages


@pytest.fixture(scope="module")
def model(tiny_dir):
    return linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)


def request_row(model, budget: int, temperature: float, seed: int):
    options = sampling_options(model, 1, temperature=temperature, top_k=20 if temperature else 0, seed=seed,
                               ignore_eos=True)
    row = options.requests(budget)
    return row.replace(sampling=dataclasses.replace(row.sampling, keys=seed_key(seed, 0)[None]))


def test_paged_runner_and_scheduler_equal_generate_request_for_request(model):
    """12 requests (greedy and seeded, several sharing a prefix of two pages) through 4 rows and a pool of 40
    pages of 4 (160 positions, where 12 requests of up to 35 need 420): each equals generate's tokens."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, model.config.vocab_size, 8).tolist()
    prompts = [(shared if i % 3 == 0 else []) + rng.integers(0, model.config.vocab_size, 3 + 2 * i).tolist()
               for i in range(12)]
    kinds = [(0.0, 0), (0.8, 7), (1.0, 123)]
    sequences = [Sequence(prompt, budget=6 + i % 4, request=request_row(model, 6 + i % 4, *kinds[i % 3]))
                 for i, prompt in enumerate(prompts)]
    pool = PagePool(pages=40, page_size=PAGE)
    scheduler = Scheduler(pool, rows=4, max_len=64, max_step_tokens=32, prefill_chunk=16)
    runner = PagedRunner(model, rows=4, pages=40, page_size=PAGE, max_len=64, max_step_tokens=32)
    for sequence in sequences:
        scheduler.add(sequence)
    drive(scheduler, runner)
    for i, sequence in enumerate(sequences):
        temperature, seed = kinds[i % 3]
        want = generate(model, tokens=[sequence.prompt], max_new_tokens=sequence.budget, temperature=temperature,
                        top_k=20 if temperature else 0, seed=seed, ignore_eos=True, return_details=True)[0]
        assert sequence.output == want.tokens, i
    assert pool.counters["hit_tokens"] > 0 and pool.available == pool.pages


def test_one_request_of_the_whole_context_fits_and_a_step_reads_only_the_pages_in_use(model):
    """On the model with an 8,192-position context: one request of all of it (8,184 prompt tokens, 8 new) through
    a pool of exactly 8,192 positions equals generate; then requests of about 100 tokens decode over a table of 1
    column of 128 (their page), not 64 (max_len's)."""
    config = dataclasses.replace(model.config, max_position_embeddings=8192)
    model = dataclasses.replace(model, config=config)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 8184).tolist()
    row = request_row(model, 8, 0.0, 0)
    scheduler = Scheduler(PagePool(pages=64, page_size=128), rows=2, max_len=8192, max_step_tokens=2048,
                          prefill_chunk=2048)
    runner = PagedRunner(model, rows=2, pages=64, page_size=128, max_len=8192, max_step_tokens=2048)
    whole = Sequence(prompt, budget=8, request=row)
    scheduler.add(whole)
    drive(scheduler, runner)
    want = generate(model, tokens=[prompt], max_new_tokens=8, ignore_eos=True, return_details=True)[0]
    assert whole.output == want.tokens and len(prompt) + len(whole.output) == 8192
    runner.shapes.clear()
    short = [Sequence(list(range(100 + i)), budget=6, request=request_row(model, 6, 0.0, 0)) for i in range(2)]
    for sequence in short:
        scheduler.add(sequence)
    drive(scheduler, runner)
    assert runner.shapes[-1] == (16, 1) and max(columns for _, columns in runner.shapes) == 1


def test_requests_on_adapters_and_the_base_in_one_step_equal_generate_with_their_logprobs(model):
    """Two random rank-4 adapters and the base, mixed in the same packed steps (each token its request's table
    entry): each request's tokens and logprobs equal generate's with that adapter."""
    adapters = []
    for seed in (1, 2):
        lora = train.init_lora(model.config, train.LoraConfig(rank=4, alpha=8.0), jax.random.key(seed))
        adapters.append(dataclasses.replace(lora, b={name: 0.05 * jax.random.normal(jax.random.key(seed + 9), b.shape)
                                                     for name, b in lora.b.items()}))
    table = AdapterTable(model, max_loras=2, max_lora_rank=8)
    for entry, lora in enumerate(adapters, 1):
        table.put(entry, lora)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.config.vocab_size, 5 + 3 * i).tolist() for i in range(6)]
    sequences = []
    for i, prompt in enumerate(prompts):
        options = sampling_options(model, 1, ignore_eos=True)
        sequences.append(Sequence(prompt, budget=5, request=options.requests(5, adapter=i % 3)))
    scheduler = Scheduler(PagePool(pages=40, page_size=PAGE), rows=4, max_len=64, max_step_tokens=32,
                          prefill_chunk=16)
    runner = PagedRunner(model, rows=4, pages=40, page_size=PAGE, max_len=64, max_step_tokens=32)
    for sequence in sequences:
        scheduler.add(sequence)
    while scheduler.busy:
        plan = scheduler.schedule()
        scheduler.update(plan, runner.run(plan, lora=table.table))
    for i, sequence in enumerate(sequences):
        lora = None if i % 3 == 0 else adapters[i % 3 - 1]
        want = generate(model, tokens=[sequence.prompt], max_new_tokens=5, ignore_eos=True, lora=lora,
                        return_details=True)[0]
        assert sequence.output == want.tokens, i
        np.testing.assert_allclose(sequence.logprobs, want.logprobs, atol=1e-5)
