"""lm-evaluation-harness against a live `linnet_jax.serve` app: `/v1/completions` with `echo` gives prompt logprobs
in OpenAI's shape, and lm-eval's `local-completions` model runs multiple choice, rolling perplexity and generation
through it (its remote tokenizer on /tokenizer_info, /tokenize and /detokenize), with the loglikelihoods that
`linnet_jax.logits` gives directly and the generations `generate` gives."""

import json

import httpx
import jax
import numpy as np
import pytest
from test_serve import MODEL, serving, tiny_chat, tiny_chat_dir  # noqa: F401 (fixtures)

import linnet_jax
from linnet_jax import generate
from linnet_jax.serve import Engine

QUESTIONS = [
    {"question": "The sea is", "choices": [" blue", " a cat", " seven"], "answer": 0},
    {"question": "Birds sang of", "choices": [" rain", " bread and hills"], "answer": 1},
    {"question": "A cat ran over the", "choices": [" hills", " quiet sea", " bread"], "answer": 0},
]
TEXTS = [{"text": "the sea a cat ran over blue hills while seven quiet birds sang"},
         {"text": "of rain and bread, and the cat ran."}]
TASKS = {
    "linnet_choice": dict(output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice="{{choices}}",
                          doc_to_target="{{answer}}", metric_list=[{"metric": "acc"}], data="choice.jsonl"),
    "linnet_rolling": dict(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                           metric_list=[{"metric": "word_perplexity"}], data="texts.jsonl"),
    "linnet_generate": dict(output_type="generate_until", doc_to_text="{{question}}", doc_to_target="{{choices[0]}}",
                            generation_kwargs={"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
                            metric_list=[{"metric": "exact_match"}], data="choice.jsonl"),
}


@pytest.fixture(scope="module")
def url(tiny_chat):  # noqa: F811
    with Engine(tiny_chat, slots=4, max_len=128) as engine, serving(engine) as url:
        yield url


def direct_logprobs(model, ids: list[int]) -> np.ndarray:
    """Each token's logprob after the first, from one full forward (`linnet_jax.logits`)."""
    logprobs = np.asarray(jax.nn.log_softmax(linnet_jax.logits(model, [ids])[0]))
    return logprobs[np.arange(len(ids) - 1), ids[1:]]


def test_echo_returns_prompt_logprobs_in_openai_shape(tiny_chat, url):  # noqa: F811
    ids = tiny_chat.tokenizer.encode("the sea a cat ran over blue hills", add_special_tokens=False)
    expected = direct_logprobs(tiny_chat, ids)
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == tiny_chat.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert np.abs(np.array(logprobs["token_logprobs"][1:]) - expected).max() < 1e-4
    assert all(len(top) <= 2 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(logprobs["top_logprobs"][1:], logprobs["token_logprobs"][1:]))
    assert len(logprobs["tokens"]) == len(ids) == len(logprobs["text_offset"])
    greedy = generate(tiny_chat, tokens=[ids], max_new_tokens=3)[0]
    body |= {"max_tokens": 3, "temperature": 0}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 3
    assert choice["text"] == tiny_chat.tokenizer.decode(ids) + tiny_chat.tokenizer.decode(greedy)
    text = httpx.post(f"{url}/v1/completions", json={"prompt": "the sea", "echo": True, "max_tokens": 2}).json()
    assert text["choices"][0]["text"].startswith("the sea") and text["choices"][0]["logprobs"] is None
    for bad, field in (({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                       ({"prompt": "x", "echo": True, "stream": True}, "echo")):
        response = httpx.post(f"{url}/v1/completions", json=bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == field


def write_tasks(directory) -> None:
    (directory / "choice.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (directory / "texts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    for name, task in TASKS.items():
        spec = {"task": name, "dataset_path": "json", "test_split": "train", "output_type": task["output_type"],
                "dataset_kwargs": {"data_files": {"train": str(directory / task["data"])}},
                **{k: v for k, v in task.items() if k not in ("output_type", "data")}}
        (directory / f"{name}.yaml").write_text(json.dumps(spec))  # JSON is YAML


def test_lm_eval_runs_its_three_request_kinds_against_the_server(tiny_chat, url, tmp_path):  # noqa: F811
    import lm_eval
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=list(TASKS), task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={"base_url": f"{url}/v1/completions", "model": MODEL, "tokenizer_backend": "remote",
                    "num_concurrent": 1, "max_retries": 1, "max_length": 128},
        log_samples=True)
    tokenizer = tiny_chat.tokenizer
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731 (the remote tokenizer's)
    for sample in results["samples"]["linnet_choice"]:
        for (context, continuation), ((loglikelihood, _),) in zip(sample["arguments"], sample["resps"]):
            context_ids = encode(context)
            whole = encode(context + continuation)
            expected = direct_logprobs(tiny_chat, whole)[len(context_ids) - 1:].sum()
            assert abs(loglikelihood - expected) < 1e-3, (context, continuation)
    prefix = encode(tokenizer.bos_token or tokenizer.eos_token)  # lm-eval's remote prefix token: BOS, else EOS
    for sample in results["samples"]["linnet_rolling"]:
        ids = prefix + encode(sample["doc"]["text"])
        assert abs(sample["resps"][0][0] - direct_logprobs(tiny_chat, ids).sum()) < 1e-3
    for sample in results["samples"]["linnet_generate"]:
        context = sample["arguments"][0][0]
        want = generate(tiny_chat, tokens=[encode(context)], max_new_tokens=6, stop=["\n"], return_details=True)[0]
        assert sample["resps"][0][0] == want.text
    assert np.isfinite(results["results"]["linnet_rolling"]["word_perplexity,none"])
