"""The decode core (`linnet_jax.decode`): batch-independent steps, slot independence, capacity, the platform switch."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from test_generate import agreed_steps, reference_greedy

import linnet_jax
from linnet_jax import generate
from linnet_jax.backend import XLA_DOTS, mid_width_xla_dots, plan_for_platform
from linnet_jax.decode import FREE, LENGTH, RUNNING, decode, decode_program, empty_slots, free
from linnet_jax.inputs import STOP_ID_SLOTS, extend_rows, make_requests, make_sampling, new_slots, stop_id_array
from linnet_jax.sharding import host

UPDATE_OPS = ("stablehlo.dynamic_update_slice", "stablehlo.scatter")


@dataclasses.dataclass
class Job:
    """One request for the hand-driven scheduler below."""

    prompt: list[int]
    max_new: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def request(self, model):
        sampling = make_sampling(1, self.temperature, self.top_k, self.top_p, 0.0, 1.0, [self.seed])
        return make_requests(sampling, stop_id_array(model, None, ignore_eos=True), self.max_new)

    def alone(self, model):
        return generate(model, tokens=[self.prompt], max_new_tokens=self.max_new, temperature=self.temperature,
                        top_k=self.top_k, top_p=self.top_p, seed=[self.seed], ignore_eos=True, return_details=True)[0]


def admit(model, slots, slot: int, job: Job):
    return extend_rows(model, slots, [slot], [job.prompt], [0], [job.request(model)], [True])


def serve(model, jobs: list[Job], rows: int, max_len: int, chunk: int) -> dict[int, tuple[list[int], list[float]]]:
    """Run the jobs through a `rows`-slot state: admit into free slots, decode `chunk` steps, free the finished.
    Checks on the way that an idle row's cache is never written."""
    slots, queue, owner, out = new_slots(model, rows, max_len), list(enumerate(jobs)), [None] * rows, {}
    while queue or any(o is not None for o in owner):
        for slot in range(rows):
            if owner[slot] is None and queue:
                owner[slot], job = queue.pop(0)
                slots = admit(model, slots, slot, job)
                out[owner[slot]] = ([int(slots.token[slot])], [float(slots.logprob[slot])])
        idle = [slot for slot in range(rows) if owner[slot] is None]
        heads = model.config.num_kv_heads
        before = [np.asarray(slots.cache.k[0][s * heads:(s + 1) * heads]).copy() for s in idle]
        slots, emitted = decode(model.decode_params, model.config, slots, np.int32(chunk), chunk, plan=model.plan)
        for slot, saved in zip(idle, before):
            assert np.array_equal(np.asarray(slots.cache.k[0][slot * heads:(slot + 1) * heads]), saved)
            assert host(slots.finish)[slot] == FREE
        tokens, logprobs, counts, finish = (host(a) for a in (emitted.tokens, emitted.logprobs, emitted.count,
                                                               slots.finish))
        for slot, job_id in enumerate(owner):
            if job_id is None:
                continue
            out[job_id][0].extend(tokens[slot, :counts[slot]].tolist())
            out[job_id][1].extend(logprobs[slot, :counts[slot]].tolist())
            if finish[slot] != RUNNING:
                slots, owner[slot] = free(slots, slot), None
    return out


def test_slots_are_independent(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)
    rng = np.random.default_rng(9)
    jobs = []
    for i in range(16):
        prompt = rng.integers(3, model.config.vocab_size, int(rng.integers(2, 40))).tolist()
        sampled = dict(temperature=0.8, top_k=40, top_p=0.95, seed=int(rng.integers(-2**40, 2**40))) if i % 2 else {}
        jobs.append(Job(prompt, int(rng.integers(1, 24)), **sampled))
    served = serve(model, jobs, rows=4, max_len=64, chunk=3)
    for i, job in enumerate(jobs):
        alone = job.alone(model)
        assert served[i][0] == alone.tokens, f"request {i} ({job})"
        assert np.abs(np.array(served[i][1]) - alone.logprobs).max() < 1e-5
        assert len(alone.tokens) == job.max_new and alone.stop_reason == "length"


def test_seed_per_prompt_is_the_same_alone_and_at_any_row(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    a, b, c = [5, 6, 7], [9, 10, 11, 12, 13], [30, 31]
    sampled = dict(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    batch = generate(model, tokens=[a, b, c], seed=[1, 2, 3], **sampled)
    assert batch[1] == generate(model, tokens=[b], seed=[2], **sampled)[0] == generate(model, tokens=[b], seed=2,
                                                                                          **sampled)[0]
    assert generate(model, tokens=[c, b], seed=[3, 2], **sampled) == [batch[2], batch[1]]
    assert generate(model, tokens=[b], seed=2**40, **sampled) != generate(model, tokens=[b], seed=0, **sampled)
    one_seed = generate(model, tokens=[b, b], seed=2, **sampled)
    assert one_seed[0] != one_seed[1]  # a single seed: each row its own stream


def update_ops(model, batch: int) -> int:
    slots = jax.eval_shape(lambda: empty_slots(model.config, batch, 64, STOP_ID_SLOTS, model.params.embed.dtype))
    text = decode_program().lower(model.decode_params, model.config, slots, np.int32(4), 4, plan=model.plan).as_text()
    return sum(len(re.findall(rf"{op}\b", text)) for op in UPDATE_OPS)


def test_decode_step_update_ops_do_not_grow_with_rows(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)
    one, many = update_ops(model, 1), update_ops(model, 64)
    print(f"cache-update ops in the decode program: batch 1 {one}, batch 64 {many}")
    assert one == many
    assert one >= 2 * model.config.num_layers  # every layer's keys and values are written


def test_decode_to_the_last_cache_slot(tiny_dir):
    reference, directory = tiny_dir("llama_gqa_llama3")
    model = linnet_jax.load(directory, progress=False)
    max_len, prompt = 32, np.random.default_rng(3).integers(3, 256, 10).tolist()
    slots = new_slots(model, 2, max_len)
    slots = admit(model, slots, 0, Job([4, 5, 6], 13))  # row 0 runs first, row 1 joins later
    slots, _ = decode(model.decode_params, model.config, slots, np.int32(13), 16, plan=model.plan)
    slots = admit(model, slots, 1, Job(prompt, 100))
    first = int(slots.token[1])
    slots, emitted = decode(model.decode_params, model.config, slots, np.int32(100), 128, plan=model.plan)
    ours = [first] + host(emitted.tokens)[1, :host(emitted.count)[1]].tolist()
    assert host(slots.finish)[1] == LENGTH and len(prompt) + len(ours) == max_len
    heads = model.config.num_kv_heads
    written = np.abs(host(slots.cache.k[0])[heads:2 * heads]).sum(axis=-1) > 0  # row 1's slots [G, S]
    assert written[:, :-1].all() and not written[:, -1].any()  # every slot used once, the last token never written
    theirs, gaps = reference_greedy(reference, prompt, len(ours))
    compared, agree = agreed_steps(ours, theirs, gaps)
    assert agree == compared and compared >= 16
    alone = generate(model, tokens=[prompt], max_new_tokens=len(ours), max_len=max_len, return_details=True,
                     ignore_eos=True)[0]
    assert alone.tokens == ours and alone.stop_reason == "length"



def test_a_row_reused_by_a_shorter_request_never_reads_the_longer_ones_slots(tiny_dir):
    """Slot p holds position p and nothing is cleared: a row that held a 49-position request, freed, takes a
    3-id prompt (beside a 12-id one in another row, one extend); the slots past the new request's length still
    hold the old keys, and both requests give exactly what generate gives each alone."""
    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)
    rng, heads = np.random.default_rng(11), model.config.num_kv_heads
    long, short, other = (Job(rng.integers(3, 256, n).tolist(), new, temperature=t, seed=s)
                          for n, new, t, s in ((30, 20, 0.0, 0), (3, 8, 0.9, 5), (12, 10, 0.0, 0)))
    slots = admit(model, new_slots(model, 2, 64), 0, long)
    slots, _ = decode(model.decode_params, model.config, slots, np.int32(32), 32, plan=model.plan)
    assert host(slots.finish)[0] == LENGTH and host(slots.length)[0] == 50
    slots = free(slots, 0)
    stale = host(slots.cache.k[0])[:heads].copy()  # row 0: positions 0 .. 48 of the long request
    slots = extend_rows(model, slots, [0, 1], [short.prompt, other.prompt], [0, 0],
                        [short.request(model), other.request(model)], [True, True])
    firsts = host(slots.token).tolist()
    slots, emitted = decode(model.decode_params, model.config, slots, np.int32(32), 32, plan=model.plan)
    for row, job in enumerate((short, other)):
        tokens = [firsts[row]] + host(emitted.tokens)[row, :host(emitted.count)[row]].tolist()
        assert tokens == job.alone(model).tokens, (row, job)
    row0 = host(slots.cache.k[0])[:heads]
    assert not np.array_equal(row0[:, :10], stale[:, :10])  # the short request's 10 positions, written again
    assert np.array_equal(row0[:, 10:49], stale[:, 10:49])  # the rest left as it was: masked, never read


def test_a_later_chunk_reads_the_slots_it_sees_and_equals_reading_all(tiny_dir):
    """A prompt's later chunks through the plan's `key_block` (attention over the first 128, 256 or 512 of 640 slots,
    or all) give the cache and the first token's top logprobs that attention over every slot gives, bit for bit (a
    prompt's cache does not depend on what it is batched with), for chunks that end at a span's last slot, one past
    it, and in the last span, in one dispatch with a shorter row (row 0: the span is the longest row's)."""
    model = linnet_jax.load(tiny_dir("mistral_sliding")[1], progress=False)
    every = dataclasses.replace(model)  # a fresh Model, its plan (a cached property) preset to read every slot
    every.__dict__["plan"] = dataclasses.replace(model.plan, key_block=None)
    assert model.plan.key_block == 128
    rng = np.random.default_rng(5)
    requests = [Job([], 1).request(model)] * 2
    for start, count in ((112, 16), (113, 16), (600, 32)):
        prompts = [rng.integers(3, 256, start + count - 9).tolist(), rng.integers(3, 256, start + count).tolist()]
        results = []
        for variant in (model, every):
            slots = extend_rows(variant, new_slots(variant, 2, 640), [0, 1], [p[:start] for p in prompts], [0, 0],
                                requests, [False] * 2)
            slots = extend_rows(variant, slots, [0, 1], [p[start:] for p in prompts], [start] * 2, requests,
                                [True] * 2)
            results.append([host(array) for array in (slots.top_logprobs, slots.cache.k[-1], slots.cache.v[-1])])
        for got, expected in zip(*results):  # the masked slots left out add exact zeros
            np.testing.assert_array_equal(got, expected)


def test_a_prompts_first_token_is_the_same_alone_and_beside_others(tiny_dir):
    """The first token's logits (the head at each row's last position) go through the decode step's products, whose
    sums do not depend on the rows: a prompt prefilled alone and beside three others gets the same first token and
    top logprobs, bit for bit (XLA's product sums one row in another order than several)."""
    model = linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 256, n).tolist() for n in (40, 17, 33, 25)]
    requests = [Job([], 1).request(model)] * 4
    alone = extend_rows(model, new_slots(model, 4, 64), [0], prompts[:1], [0], requests[:1], [True])
    together = extend_rows(model, new_slots(model, 4, 64), [0, 1, 2, 3], prompts, [0] * 4, requests, [True] * 4)
    for column in ("token", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(host(getattr(alone, column))[0], host(getattr(together, column))[0])


def test_the_plan_compiles_mid_width_decode_with_xla_dots(tiny_dir):
    """Without the kernels, on one AVX2 CPU the plan compiles a decode program of 8 to 24 rows without YNNPACK's
    fusions (XLA's own dots), others with them (on an AVX-512 CPU all with them); 16 rows, greedy and sampled, give
    the tokens the default program gives. With the kernels (which take these products) the options stay unset."""
    assert mid_width_xla_dots(frozenset({"avx2", "fma"})) == (8, 24)
    assert mid_width_xla_dots(frozenset({"avx2", "fma", "avx512f"})) is None
    assert plan_for_platform("cpu").matvec_kernels and plan_for_platform("cpu").xla_dot_rows is None
    model = dataclasses.replace(linnet_jax.load(tiny_dir("llama_gqa_llama3")[1], progress=False))
    model.__dict__["plan"] = dataclasses.replace(model.plan, matvec_kernels=False, xla_dot_rows=(8, 24))  # AVX2's
    assert [model.plan.decode_options(rows) for rows in (4, 8, 16, 24, 32)] == [(), XLA_DOTS, XLA_DOTS, XLA_DOTS, ()]
    rng = np.random.default_rng(4)
    jobs = [Job(rng.integers(3, 256, 5 + row).tolist(), 12, temperature=0.8 * (row % 2), seed=row) for row in range(16)]
    filled = lambda: extend_rows(model, new_slots(model, 16, 64), list(range(16)), [job.prompt for job in jobs],  # noqa: E731
                                 [0] * 16, [job.request(model) for job in jobs], [True] * 16)
    arguments = lambda: (model.decode_params, model.config, filled(), np.int32(11), 16, None, False, model.plan)  # noqa: E731
    programs = {"plan": decode_program(XLA_DOTS), "default": decode_program()}
    compiled = {name: program.lower(*arguments()).compile().as_text() for name, program in programs.items()}
    assert "ynn_fusion" in compiled["default"] and "ynn_fusion" not in compiled["plan"]
    tokens = {name: host(program(*arguments())[1].tokens) for name, program in programs.items()}
    assert np.array_equal(tokens["plan"], tokens["default"])
    assert np.array_equal(host(decode(*arguments())[1].tokens), tokens["plan"])  # `decode` runs the plan's program


def test_gpu_tpu_path_makes_no_second_copy_of_the_weights(smollm2):
    model = dataclasses.replace(smollm2)  # a fresh Model, its plan (a cached property) preset to a GPU's
    model.__dict__["plan"] = plan_for_platform("cuda")
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    live = lambda: sum(array.nbytes for array in jax.live_arrays())  # noqa: E731
    before = live()
    grown = [live() - before for _ in generate(model, "Count to ten.", max_new_tokens=24, stream=True)]
    assert model.decode_params is model.params
    print(f"live bytes beyond the weights while streaming: at most {max(grown) / 2**20:.1f} MiB "
          f"(weights {weights / 2**20:.0f} MiB)")
    assert len(grown) > 2 and max(grown) < weights / 4


def test_free_empties_a_slot(tiny_dir):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    slots = admit(model, new_slots(model, 2, 32), 1, Job([3, 4, 5], 8))
    assert host(slots.finish).tolist() == [FREE, RUNNING]
    slots = free(slots, 1)
    assert host(slots.finish).tolist() == [FREE, FREE] and (host(slots.count) == 0).all()
    before = host(slots.cache.k[0]).copy()
    slots, emitted = decode(model.decode_params, model.config, slots, np.int32(4), 4, plan=model.plan)
    assert (host(emitted.count) == 0).all() and np.array_equal(host(slots.cache.k[0]), before)  # nothing runs


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 1.5, True, "7"])
def test_seeds_outside_signed_64_bit_are_refused(tiny_dir, bad):
    model = linnet_jax.load(tiny_dir("llama_mha")[1], progress=False)
    with pytest.raises(ValueError, match="seed must be"):
        generate(model, tokens=[[1, 2]], max_new_tokens=2, seed=bad)
