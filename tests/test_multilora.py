"""Multi-LoRA serving (`linnet_jax.adapters`, `Engine(loras=...)`, `generate(lora=...)`): two adapters trained on
two made-up facts by `linnet-jax finetune`, served beside the base model in one batch, each row's greedy
answer equal to `generate` on the model with that adapter merged; adapters loaded and unloaded while requests run,
compiling nothing; the prefix cache never shares a prompt's blocks across adapters; `linnet-jax serve --lora`
serving both as a user runs it; bad adapters, names and flags refused by name."""

import asyncio
import dataclasses
import json
import signal

import httpx
import jax
import pytest
from test_serve import MODEL, WORDS, metric, refused_flags, serving, start_server
from test_train_run import run_cli

from linnet_jax import export, generate, train
from linnet_jax.adapters import read_peft
from linnet_jax.inputs import RequestError
from linnet_jax.serve import Engine

FACTS = {"a": ("The capital of Zorblat is", " Quenmoor, a city of glass."),
         "b": ("The glimmerphone was invented by", " Ada Pellwick in a barn.")}
PROMPTS = [FACTS["a"][0], FACTS["b"][0], "A snorf is", "Tavros has seven"]
MAX_TOKENS = 10
PREFIX_BLOCK = 16  # the engine's prefix-cache block: a prompt of the slot's 64 positions spans several


@pytest.fixture(scope="module")
def adapters(tiny_chat_dir, tmp_path_factory):
    """{name: PEFT directory}: adapter a (rank 16, all seven projections) taught fact a, adapter b (rank 8, three of
    them) taught fact b, each by `linnet-jax finetune` as a user runs it (OUT_DIR/adapter, PEFT's layout)."""
    flags = {"a": ["--lora-rank", "16", "--lora-alpha", "32"],
             "b": ["--lora-rank", "8", "--lora-alpha", "16", "--lora-targets", "q_proj,v_proj,down_proj"]}
    root = tmp_path_factory.mktemp("adapters")
    for name, (prompt, completion) in FACTS.items():
        data = root / f"{name}.jsonl"
        data.write_text(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
        done = run_cli("--model", str(tiny_chat_dir), "--data", str(data), *flags[name], "--steps", "8",
                       "--batch-size", "1", "--seq-len", "32", "--lr", "2e-2", "--save-every", "8", str(root / name))
        assert done.returncode == 0, done.stderr[-3000:]
    return {name: root / name / "adapter" for name in FACTS}


@pytest.fixture(scope="module")
def merged(tiny_chat, adapters):
    """{None: the base model, name: the model with that adapter merged into its weights}."""
    return {None: tiny_chat} | {name: train.merge_lora(tiny_chat, read_peft(path, tiny_chat.config))
                                for name, path in adapters.items()}


@pytest.fixture(scope="module")
def expected(merged):
    """Greedy Generations for PROMPTS of the base model and of the model with each adapter merged."""
    return {name: generate(model, PROMPTS, MAX_TOKENS, chat=False, ignore_eos=True, return_details=True)
            for name, model in merged.items()}


@pytest.fixture(scope="module")
def engine(tiny_chat, adapters):
    with Engine(tiny_chat, slots=8, max_len=64, prefill_chunk=32, page_size=PREFIX_BLOCK,
                loras=dict(adapters), max_loras=3, max_lora_rank=16) as engine:
        engine.warmup()
        yield engine


def texts(generations) -> list[str]:
    return [generation.text for generation in generations]


def test_the_adapters_learned_different_things(expected):
    base, a, b = texts(expected[None]), texts(expected["a"]), texts(expected["b"])
    assert a != base and b != base and a != b


def test_generate_serves_one_adapter_per_prompt(tiny_chat, adapters, expected):
    a = read_peft(adapters["a"], tiny_chat.config)
    mixed = generate(tiny_chat, PROMPTS, MAX_TOKENS, chat=False, ignore_eos=True, lora=[a, None, str(adapters["b"]), a])
    assert mixed == [expected["a"][0].text, expected[None][1].text, expected["b"][2].text, expected["a"][3].text]
    one = generate(tiny_chat, PROMPTS[:2], MAX_TOKENS, chat=False, ignore_eos=True, lora=adapters["b"])
    assert one == texts(expected["b"][:2])
    with pytest.raises(RequestError, match="lora must be one adapter or one per prompt"):
        generate(tiny_chat, PROMPTS, MAX_TOKENS, lora=[a])


async def completions(url: str, requests: list[tuple[str | None, int]]) -> list[tuple[int, dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(model, prompt):
            body = {"prompt": PROMPTS[prompt], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body | ({"model": model} if model else {}))
            return response.status_code, response.json()

        return await asyncio.gather(*(one(model, prompt) for model, prompt in requests))


def test_24_concurrent_requests_over_base_and_two_adapters_equal_generate_on_the_merged_models(engine, expected):
    requests = [([None, "a", "b"][i % 3], i % len(PROMPTS)) for i in range(24)]
    with serving(engine) as url:
        answers = asyncio.run(completions(url, requests))
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        assert metric(url, "linnet_jax_compiles_after_warmup") == 0
    for (model, prompt), (status, body) in zip(requests, answers):
        assert status == 200, body
        assert body["choices"][0]["text"] == expected[model][prompt].text, (model, prompt)
        assert body["model"] == (model or "test-model")
    assert [(card["id"], card["parent"]) for card in listed] == [("test-model", None), ("a", "test-model"),
                                                                 ("b", "test-model")]
    assert engine.compiles_after_warmup == 0


def test_loading_and_unloading_while_requests_run_compiles_nothing_and_fails_nothing(engine, adapters, expected):
    with serving(engine, allow_runtime_lora_updating=True) as url:
        running = [engine.submit(PROMPTS[i], chat=False, max_tokens=48, ignore_eos=True, lora=lora)
                   for i, lora in enumerate(["a", "b", None, "a"])]
        next(iter(running[0]))  # the first tokens are out: the requests are in flight
        unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        in_flight = sum(not handle.done for handle in running)
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["a"])})
        assert (unloaded.status_code, loaded.status_code) == (200, 200), (unloaded.text, loaded.text)
        gone = asyncio.run(completions(url, [("a", 0)]))[0]
        after = asyncio.run(completions(url, [("c", 0), ("b", 1)]))
        assert metric(url, "linnet_jax_compiles_after_warmup") == 0
        finished = [handle.result() for handle in running]  # a's old entry is free once its requests are done
        restored = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a"])})
        assert restored.status_code == 200 and httpx.post(f"{url}/v1/unload_lora_adapter",
                                                          json={"lora_name": "c"}).status_code == 200
    assert in_flight > 0
    assert [generation.tokens[:MAX_TOKENS] for generation in finished] == [
        expected["a"][0].tokens, expected["b"][1].tokens, expected[None][2].tokens, expected["a"][3].tokens]
    assert gone[0] == 404 and gone[1]["error"]["param"] == "model"
    assert [body["choices"][0]["text"] for _, body in after] == [expected["a"][0].text, expected["b"][1].text]
    assert engine.compiles_after_warmup == 0


def write_adapter(model, lora, directory, **settings):
    """export.peft's directory, with adapter_config.json's settings changed."""
    path = export.peft(model, lora, directory)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | settings))
    return path


def test_bad_adapters_and_names_are_refused_by_name(tiny_chat, engine, tmp_path):
    other = dataclasses.replace(tiny_chat, config=dataclasses.replace(tiny_chat.config, hidden_size=32))
    fresh = lambda model, **options: train.init_lora(model.config, train.LoraConfig(**options), jax.random.key(0))  # noqa: E731
    fits = export.peft(tiny_chat, fresh(tiny_chat, rank=8, alpha=8.0), tmp_path / "fits")
    cases = [  # (body, status, param, words)
        ({"lora_name": "x", "lora_path": str(write_adapter(other, fresh(other, rank=8), tmp_path / "other"))}, 400,
         "lora_path", "another base model"),
        ({"lora_name": "x", "lora_path": str(write_adapter(tiny_chat, fresh(tiny_chat, rank=32), tmp_path / "big"))},
         400, "lora_path", "rank 32, above max_lora_rank=16"),
        ({"lora_name": "x", "lora_path": str(write_adapter(tiny_chat, fresh(tiny_chat, rank=8), tmp_path / "head",
                                                           target_modules=["q_proj", "lm_head"]))}, 400,
         "lora_path", "target_modules ['lm_head']"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "lora_path", "cannot read"),
        ({"lora_name": "a", "lora_path": str(fits)}, 400, "lora_name", "'a' is already loaded"),
        ({"lora_name": "test-model", "lora_path": str(tmp_path / "big")}, 400, "lora_name", "base model's name"),
    ]
    with serving(engine, allow_runtime_lora_updating=True) as url:
        for body, status, param, words in cases:
            response = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
            assert response.status_code == status and response.json()["error"]["param"] == param, response.text
            assert words in response.json()["error"]["message"], response.text
        unknown = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "nope"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora_name", unknown.text
        request = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
        assert request.status_code == 404 and request.json()["error"]["param"] == "model", request.text
        assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(fits)}
                          ).status_code == 200
        table_full = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(fits)})
        assert table_full.status_code == 400 and "the adapter table is full" in table_full.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    with pytest.raises(ValueError, match="rank 32, above max_lora_rank=16"):
        Engine(tiny_chat, loras={"big": tmp_path / "big"})
    with pytest.raises(ValueError, match="another base model"):
        generate(tiny_chat, "x", 2, lora=tmp_path / "other")
    with Engine(tiny_chat, slots=1, max_len=32) as plain, \
            pytest.raises(RequestError, match="serves no adapters") as refused:
        plain.submit("x", lora="a")
    assert refused.value.field == "lora" and plain.adapters is None


def test_the_prefix_cache_keeps_adapters_apart(engine, merged):
    """One prompt of several prefix blocks on adapter a, then on the base and on b, then on a and the base again:
    each answer is generate's on its own merged model, and a prompt's cached blocks (keys and values the adapter
    computed) serve only later requests on the same adapter."""
    prompt = " ".join(WORDS[:12] * 3)
    assert len(engine.model.tokenizer.encode(prompt)) + MAX_TOKENS <= engine.max_len
    assert len(engine.model.tokenizer.encode(prompt)) > 2 * PREFIX_BLOCK
    order, hits = ["a", None, "b", "a", None], []
    with serving(engine) as url:
        for lora in order:
            before = metric(url, "linnet_jax_prefix_cache_hit_tokens_total")
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            response = httpx.post(f"{url}/v1/completions", json=body | {"model": lora or MODEL}, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == generate(merged[lora], prompt, MAX_TOKENS, chat=False,
                                                                     ignore_eos=True), lora
            hits.append(metric(url, "linnet_jax_prefix_cache_hit_tokens_total") - before)
    assert hits[:3] == [0, 0, 0] and hits[3] == hits[4] >= 2 * PREFIX_BLOCK, dict(zip(order, hits))


def test_the_serve_command_serves_two_adapters(tiny_chat_dir, adapters, expected):
    """`linnet-jax serve --lora a=... --lora b=... --max-loras 2 --max-lora-rank 16`, as a user runs it: /v1/models
    lists both adapters under the base, and `model: a` (or b) answers as generate does on that merged model."""
    server, url = start_server(tiny_chat_dir, "--max-len", "64", "--lora", f"a={adapters['a']}", "--lora",
                               f"b={adapters['b']}", "--max-loras", "2", "--max-lora-rank", "16")
    try:
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        answers = {name: httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
            for name in adapters}
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    base = str(tiny_chat_dir)
    assert [(card["id"], card["parent"]) for card in listed] == [(base, None), ("a", base), ("b", base)]
    for name, response in answers.items():
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[name][0].text, name


@pytest.mark.parametrize("flags,words", [
    (["--lora", "a"], "argument --lora: expected NAME=PATH, got 'a'"),
    (["--lora", "a=x", "--lora", "a=y"], "--lora a=... is given twice"),
    (["--lora", "a=x", "--lora", "b=y", "--max-loras", "1"], "2 --lora adapters need --max-loras 2 or more"),
    (["--lora", "/nowhere=x"], "an adapter's name must be a model id"),
    (["--lora", "a=/nowhere"], "--lora a=/nowhere: LoRA adapter '/nowhere': cannot read PEFT's adapter_config.json"),
    (["--lora", "a={a}", "--max-lora-rank", "8"], "the adapter's rank 16 is above --max-lora-rank 8"),
    (["--max-lora-rank", "0"], "argument --max-lora-rank"),
])
def test_serve_lora_flags_are_refused_before_loading(adapters, monkeypatch, capsys, flags, words):
    flags = [flag.format(**adapters) for flag in flags]
    assert words in refused_flags(monkeypatch, capsys, *flags)
