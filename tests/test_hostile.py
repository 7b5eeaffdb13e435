"""Hostile inputs, fourth round (issue 44): grammars bounded before llguidance sees them and compiled on a stack
that holds the bounds (a chain of a thousand references crashed the process), grammars that can never be completed
refused or ended with an error, never "stop" with output that does not follow them; adapters checked as base
weights are (finite, a sane scale, a bounded config) and a request that fails on its own tokens failing alone;
runtime adapter loading opt-in and confined to --lora-dir; speculation bounded before the model loads. Two fuzzes
(hypothesis) of grammar specs and of adapter directories against a live server: only 200s and 4xxs, the server
healthy, and every finished constrained output valid."""

import dataclasses
import json
import re

import httpx
import jax
import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file
from test_serve import MODEL, refused_flags, serving

from linnet_jax import export, generate, train
from linnet_jax.adapters import read_peft
from linnet_jax.inputs import RequestError
from linnet_jax.serve import Engine
from linnet_jax.structured import (MAX_CHOICES, MAX_GRAMMAR_RULES, MAX_NESTING, MAX_SCHEMA_REFERENCES, MAX_SPEC_BYTES,
                                   constraint)

PROMPT = "List a few things:"
FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def reference_chain(links: int) -> dict:
    """A schema whose root "$ref"s d0, each dK "$ref"-ing dK+1, the last an integer: links + 1 references."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
    return {"$ref": "#/$defs/d0", "$defs": defs | {f"d{links}": {"type": "integer"}}}


def rule_chain(rules: int) -> str:
    """A Lark grammar of `rules` rules, rK: "t" rK+1 | "e" (start among them)."""
    return "start: r1\n" + "".join(f'r{i}: "t" r{i + 1} | "e"\n' for i in range(1, rules - 1)) + f'r{rules - 1}: "e"\n'


def gbnf_chain(rules: int) -> str:
    return "root ::= r1\n" + "".join(f'r{i} ::= "t" r{i + 1} | "e"\n' for i in range(1, rules - 1)) \
        + f'r{rules - 1} ::= "e"\n'


def nested(levels: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.fixture(scope="module")
def engine(tiny_chat):
    with Engine(tiny_chat, slots=4, max_len=128, prefill_chunk=32, prefix_cache=False, loras={}, max_loras=2,
                max_lora_rank=8) as engine:
        yield engine


def test_grammars_at_the_bounds_compile_and_over_them_are_refused_by_name(tiny_chat):
    """A chain of MAX_SCHEMA_REFERENCES references (a thousand: it crashed the process, compiled on a thread's
    default stack) and one of MAX_GRAMMAR_RULES Lark rules compile, in generate too; one more of either, a deeper
    nesting, a longer text or more choices is a RequestError naming `structured` and the limit."""
    assert constraint(tiny_chat, {"json": reference_chain(MAX_SCHEMA_REFERENCES - 1)}).mask().any()
    assert constraint(tiny_chat, {"grammar": rule_chain(MAX_GRAMMAR_RULES)}).mask().any()
    assert constraint(tiny_chat, {"json": nested(MAX_NESTING)}).mask().any()
    text = generate(tiny_chat, PROMPT, 8, structured={"json": reference_chain(MAX_SCHEMA_REFERENCES - 1)})
    assert re.fullmatch(r"-?\d*", text)
    over = [({"json": reference_chain(MAX_SCHEMA_REFERENCES)}, f'{MAX_SCHEMA_REFERENCES + 1} "$ref"s'),
            ({"json": json.dumps(reference_chain(MAX_SCHEMA_REFERENCES))}, '"$ref"s'),
            ({"grammar": rule_chain(MAX_GRAMMAR_RULES + 1)}, f"{MAX_GRAMMAR_RULES + 1} rules"),
            ({"grammar": gbnf_chain(5000)}, "5000 rules"),
            ({"json": nested(MAX_NESTING + 1)}, f"{MAX_NESTING + 1} levels"),
            ({"json": '{"items": ' * 5000 + "{}" + "}" * 5000}, "nested too deeply"),
            ({"regex": "a" * (MAX_SPEC_BYTES + 1)}, f"{MAX_SPEC_BYTES + 1} bytes"),
            ({"choice": [str(i) for i in range(MAX_CHOICES + 1)]}, f"{MAX_CHOICES + 1} strings")]
    for spec, words in over:
        with pytest.raises(RequestError, match=re.escape(words)) as refused:
            constraint(tiny_chat, spec)
        assert refused.value.field == "structured"
        with pytest.raises(RequestError, match=re.escape(words)):
            generate(tiny_chat, PROMPT, 4, structured=spec)


UNSATISFIABLE = [{"json": {"$ref": "#"}}, {"regex": "[^\\x00-\\U0010FFFF]"}, {"grammar": 'start: a\na: a "x"\n'}]


def test_a_grammar_that_can_never_be_completed_is_a_400_never_stop(engine):
    """Each of these once came back 200 with finish "stop" and output that does not follow it ("" or "{")."""
    with serving(engine) as url:
        for spec in UNSATISFIABLE:
            [(kind, value)] = spec.items()
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "structured_outputs": {kind: value}}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 400, (spec, response.text)
            error = response.json()["error"]
            assert error["param"] == "structured_outputs" and "can never be completed" in error["message"], error
        assert httpx.get(f"{url}/health").status_code == 200
    for spec in UNSATISFIABLE:
        with pytest.raises(RequestError, match="can never be completed"):
            generate(engine.model, PROMPT, 4, structured=spec)


def test_a_grammar_found_dead_mid_output_fails_its_request_alone(engine):
    """A grammar that allows a first token but nothing after it: the request ends with "error" and a RequestError
    naming `structured` (a 400 over HTTP, streamed as an error event); a request beside it equals generate."""
    dead = {"grammar": 'start: "List" b\nb: b "x"\n'}
    beside = engine.submit(PROMPT, max_tokens=12, chat=False)
    handle = engine.submit(PROMPT, max_tokens=12, chat=False, structured=dead)
    assert handle.result(120).stop_reason == "error" and isinstance(handle.failure, RequestError)
    assert handle.failure.field == "structured" and "can never be completed" in str(handle.failure)
    assert beside.result(120).text == generate(engine.model, PROMPT, 12, chat=False)
    assert engine.failure is None
    with serving(engine) as url:
        whole = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                          "structured_outputs": {"grammar": dead["grammar"]}})
        assert whole.status_code == 400 and whole.json()["error"]["param"] == "structured_outputs", whole.text
        streamed = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                             "stream": True,
                                                             "structured_outputs": {"grammar": dead["grammar"]}})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["param"] == "structured_outputs", streamed.text


def adapter(model, directory, rank: int = 8, alpha: float = 8.0, seed: int = 0, **settings_):
    """A PEFT directory of a rank-`rank` adapter on every projection with small random weights (B too, so that it
    changes the model), adapter_config.json's settings changed by `settings_`."""
    lora = train.init_lora(model.config, train.LoraConfig(rank=rank, alpha=alpha), jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(lora.b)))
    lora = dataclasses.replace(lora, b={name: 0.01 * jax.random.normal(next(keys), b.shape, b.dtype)
                                        for name, b in lora.b.items()})
    path = export.peft(model, lora, directory)
    if settings_:
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps(config | settings_))
    return path


def poisoned(path, value: float, count: int = 1):
    """The adapter's first tensor with `count` of its entries set to `value`."""
    tensors = load_file(path / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name].reshape(-1)[:count] = value
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    return path


def test_bad_adapters_are_400s_at_load_and_the_server_serves_on(engine, tmp_path):
    """An adapter with one NaN or inf weight, weights of 3e38, lora_alpha 1e308, a config nested 100k deep or
    over a MiB, and names that are not model ids: each a 400 naming its field, none loaded, the base served."""
    model = engine.model
    cases = [(poisoned(adapter(model, tmp_path / "nan"), np.nan), "lora_path", "NaN or infinite"),
             (poisoned(adapter(model, tmp_path / "inf"), np.inf), "lora_path", "NaN or infinite"),
             (poisoned(adapter(model, tmp_path / "huge"), 3e38, 4), "lora_path", "above 10000"),
             (adapter(model, tmp_path / "alpha", lora_alpha=1e308), "lora_path", "scale (lora_alpha / r)")]
    deep = adapter(model, tmp_path / "deep")
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    large = adapter(model, tmp_path / "large")
    (large / "adapter_config.json").write_text(json.dumps({"r": 4, "pad": "x" * (1 << 20)}))
    cases += [(deep, "lora_path", "nested too deeply"), (large, "lora_path", "more than 1048576 bytes")]
    good = adapter(model, tmp_path / "good")
    with serving(engine, allow_runtime_lora_updating=True) as url:
        for path, param, words in cases:
            response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["param"] == param and words in response.json()["error"]["message"], \
                response.text
        for name in ("../../x", "a" * 10_000, "a b", "x/../y", "/abs"):
            response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(good)})
            assert response.status_code == 400 and response.json()["error"]["param"] == "lora_name", response.text
            assert "model id" in response.json()["error"]["message"] and len(response.text) < 1000
        assert engine.loras == {}
        answer = httpx.post(f"{url}/v1/completions",
                            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                            timeout=60)
        assert answer.json()["choices"][0]["text"] == generate(model, PROMPT, 8, chat=False)
    with pytest.raises(RequestError, match="NaN or infinite"):
        generate(model, PROMPT, 2, lora=tmp_path / "nan")


def test_a_request_that_fails_on_its_own_tokens_fails_alone(engine, tmp_path):
    """An adapter that gives NaN logits, written into the table past the load checks (as a fault would): its
    greedy request chooses an id outside the vocabulary and ends with "error" (a 500 naming it), the server serving
    on; once the entry holds zeros again, the next request in that slot is generate's (the failed request's NaN
    keys and values were zeroed with its slot). Before, the first such request ended the engine and the server."""
    model = engine.model
    lora = read_peft(adapter(model, tmp_path / "fault"), model.config)
    lora = dataclasses.replace(lora, b={name: np.full_like(b, np.nan) for name, b in lora.b.items()})
    entry = engine.adapters.reserve("fault", set())
    engine._on_scheduler(lambda: engine.adapters.put(entry, lora))
    engine.adapters.publish("fault", entry, None)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with serving(engine) as url:
        faulty = httpx.post(f"{url}/v1/completions", json=body | {"model": "fault"}, timeout=60)
        health = httpx.get(f"{url}/health")
        engine.unload_lora("fault")
        engine._on_scheduler(lambda: engine.adapters.put(entry, None))
        base = httpx.post(f"{url}/v1/completions", json=body | {"model": MODEL}, timeout=60)
    assert faulty.status_code == 500 and faulty.json()["error"]["code"] == "request_failed", faulty.text
    assert "outside the vocabulary" in faulty.json()["error"]["message"]
    assert health.status_code == 200 and engine.failure is None
    assert base.status_code == 200 and base.json()["choices"][0]["text"] == generate(model, PROMPT, 8, chat=False)


def test_runtime_adapter_loading_is_opt_in_and_confined_to_lora_dir(engine, tmp_path):
    """Without allow_runtime_lora_updating both endpoints are 404; with lora_dir, lora_path is relative to it,
    and a path outside it (absolute, through '..', through a link), existing or not, gets one answer that names no
    server path."""
    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    root.mkdir()
    good, secret = adapter(engine.model, root / "good"), adapter(engine.model, outside)
    (root / "link").symlink_to(outside)
    with serving(engine) as url:
        for endpoint in ("load_lora_adapter", "unload_lora_adapter"):
            response = httpx.post(f"{url}/v1/{endpoint}", json={"lora_name": "x", "lora_path": str(good)})
            assert response.status_code == 404, response.text
    with serving(engine, allow_runtime_lora_updating=True, lora_dir=root) as url:
        answers = []
        for path in (str(secret), str(tmp_path / "missing"), "../elsewhere", "../missing", "link", "/etc"):
            response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path", response.text
            answers.append(response.json()["error"]["message"].replace(repr(path), "PATH"))
        missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "nothing"})
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": "good"})
        unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "good"})
    assert len(set(answers)) == 1 and "--lora-dir" in answers[0], answers
    assert missing.status_code == 400 and str(tmp_path) not in missing.text and "'nothing'" in missing.text
    assert (loaded.status_code, unloaded.status_code) == (200, 200), (loaded.text, unloaded.text)


def test_lora_flags_and_speculation_are_checked_before_loading(monkeypatch, capsys, tmp_path):
    cases = [(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 100000}', "--max-len", "64"],
              "num_speculative_tokens must be at most 32"),
             (["--speculative-config", '{"num_speculative_tokens": 31}', "--max-len", "32"], "leaves no room"),
             (["--speculative-config", '{"num_speculative_tokens": 8}', "--slots", "16", "--max-step-tokens", "128",
               "--prefill-chunk", "64"], "16 × 9 = 144 tokens, above max_step_tokens=128"),
             (["--speculative-config", '{"prompt_lookup_max": 1000}'], "prompt_lookup_max must be at most 64"),
             (["--lora-dir", str(tmp_path)], "--lora-dir needs --allow-runtime-lora-updating"),
             (["--allow-runtime-lora-updating", "--lora-dir", str(tmp_path / "none")], "not a directory"),
             (["--lora", f"../x={tmp_path}"], "model id"),
             (["--replicas", "2", "--allow-runtime-lora-updating"], "a load would reach one replica only")]
    for flags, words in cases:
        assert words in refused_flags(monkeypatch, capsys, *flags), flags


def test_an_engine_refuses_speculation_that_does_not_fit(tiny_chat):
    with pytest.raises(ValueError, match="above max_step_tokens=32"):
        Engine(tiny_chat, slots=8, max_len=64, prefill_chunk=16, max_step_tokens=32,
               speculative={"num_speculative_tokens": 4})


# --- fuzzes ---------------------------------------------------------------------------------------------------

WORD = st.text("abcxyz", min_size=1, max_size=4)
SCHEMAS = st.recursive(
    st.sampled_from([{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}, {"enum": ["a", "b"]},
                     {"type": "string", "maxLength": 3}, {"$ref": "#"}, {"type": "null"}, {"not": {}}]),
    lambda inner: st.one_of(
        st.builds(lambda items, most: {"type": "array", "items": items, "maxItems": most}, inner, st.integers(0, 2)),
        st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                                 "additionalProperties": False}, st.dictionaries(WORD, inner, max_size=2)),
        st.builds(lambda options: {"anyOf": options}, st.lists(inner, min_size=1, max_size=2))),
    max_leaves=6)
REGEXES = st.lists(st.sampled_from(["[0-9]", "[a-c]+", "x?", "(ab|cd)", "[^\\x00-\\U0010FFFF]", "\\d{2}", "(",
                                    "[z-a]", "y{3,1}"]), min_size=1, max_size=4).map("".join)
GRAMMARS = st.one_of(st.integers(2, 3 * MAX_GRAMMAR_RULES).map(rule_chain), st.integers(2, 3000).map(gbnf_chain),
                     st.sampled_from(['start: a\na: a "x"\n', 'start: "ok" | "no"\n', "start: ", "start: (((((\n",
                                      'start: /[0-9]+/\n', "root ::= [0-9]{2}\n"]))
SPECS = st.one_of(st.builds(lambda schema: {"json": schema}, SCHEMAS),
                  st.integers(1, 2 * MAX_SCHEMA_REFERENCES).map(lambda n: {"json": reference_chain(n)}),
                  st.integers(1, 4 * MAX_NESTING).map(lambda n: {"json": nested(n)}),
                  st.builds(lambda regex: {"regex": regex}, REGEXES),
                  st.builds(lambda grammar: {"grammar": grammar}, GRAMMARS),
                  st.lists(WORD, min_size=0, max_size=3).map(lambda choices: {"choice": choices}))


def follows(spec: dict, text: str) -> bool:
    """Whether a finished output follows its spec (the kinds this fuzz can check without a grammar engine)."""
    [(kind, value)] = spec.items()
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), value)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "choice":
        return text in value
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    lark = re.fullmatch(r"start: r1\n.*", value, re.S) or re.fullmatch(r"root ::= r1\n.*", value, re.S)
    return re.fullmatch("t*e", text) is not None if lark else True


def test_fuzzed_grammar_specs_get_only_200s_and_400s_and_finished_outputs_follow_them(engine):
    with serving(engine) as url:
        @FUZZ
        @given(spec=SPECS)
        @example(spec={"json": reference_chain(1000)})  # the reproducers first: they crashed or gave "stop"
        @example(spec={"grammar": rule_chain(3000)})
        @example(spec={"grammar": gbnf_chain(5000)})
        @example(spec=UNSATISFIABLE[0])
        @example(spec=UNSATISFIABLE[1])
        @example(spec=UNSATISFIABLE[2])
        def request(spec):
            [(kind, value)] = spec.items()
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 0,
                    "structured_outputs": {kind: value}}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert response.status_code in (200, 400), (spec, response.text)
            health = httpx.get(f"{url}/health", timeout=10.0)  # a stalled server fails it (not a speed test)
            assert health.status_code == 200
            if response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "stop":
                assert follows(spec, response.json()["choices"][0]["text"]), (spec, response.text)

        request()
    assert engine.failure is None


MUTATIONS = st.sampled_from(["nan", "inf", "huge", "shape", "dtype", "drop", "extra", "truncate", "r", "alpha",
                             "targets", "peft_type", "nested", "garbage", "none"])
CONFIG_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**70), st.floats(allow_nan=True),
                          st.text(max_size=5), st.lists(st.sampled_from(["q_proj", "lm_head", 3]), max_size=3))


def mutated(model, directory, mutation: str, value, seed: int):
    """A PEFT directory with one mutation of its tensors or its config."""
    path = adapter(model, directory, seed=seed)
    weights, config_file = path / "adapter_model.safetensors", path / "adapter_config.json"
    tensors, config = load_file(weights), json.loads(config_file.read_text())
    name = sorted(tensors)[seed % len(tensors)]
    if mutation in ("nan", "inf", "huge"):
        poisoned(path, {"nan": np.nan, "inf": -np.inf, "huge": 1e30}[mutation], 1 + seed % 3)
    elif mutation in ("shape", "dtype", "drop", "extra"):
        changed = {"shape": lambda: tensors | {name: tensors[name][..., :1]},
                   "dtype": lambda: tensors | {name: tensors[name].astype(np.int8)},
                   "drop": lambda: {k: v for k, v in tensors.items() if k != name},
                   "extra": lambda: tensors | {"base_model.model.extra.weight": np.zeros(3, np.float32)}}[mutation]()
        save_file(changed, weights)
    elif mutation == "truncate":
        weights.write_bytes(weights.read_bytes()[:seed % 200])
    elif mutation in ("r", "alpha", "targets", "peft_type"):
        key = {"r": "r", "alpha": "lora_alpha", "targets": "target_modules", "peft_type": "peft_type"}[mutation]
        config_file.write_text(json.dumps(config | {key: value}))
    elif mutation == "nested":
        config_file.write_text("{\"r\": " * (1 + seed * 997 % 50_000) + "4" + "}" * (1 + seed * 997 % 50_000))
    elif mutation == "garbage":
        config_file.write_bytes(bytes(range(seed % 256)))
    return path


def test_fuzzed_adapter_directories_get_only_200s_and_400s_and_the_base_serves_on(engine, tmp_path_factory):
    expected = generate(engine.model, PROMPT, 6, chat=False)
    with serving(engine, allow_runtime_lora_updating=True) as url:
        @FUZZ
        @given(mutation=MUTATIONS, value=CONFIG_VALUES, seed=st.integers(0, 10_000))
        def load(mutation, value, seed):
            path = mutated(engine.model, tmp_path_factory.mktemp("fuzz"), mutation, value, seed)
            response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "fuzz", "lora_path": str(path)},
                                  timeout=120)
            assert response.status_code in (200, 400), (mutation, value, response.text)
            if response.status_code == 200:
                served = httpx.post(f"{url}/v1/completions", json={"model": "fuzz", "prompt": PROMPT,
                                                                   "max_tokens": 4}, timeout=60)
                assert served.status_code == 200, served.text
                assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "fuzz"}).status_code == 200
            base = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                                                               "temperature": 0},
                              timeout=60)
            assert base.json()["choices"][0]["text"] == expected

        load()
    assert engine.failure is None
