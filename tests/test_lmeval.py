"""lm-evaluation-harness against a live `linnet_jax.serve` app: `/v1/completions` with `echo` gives prompt logprobs
in OpenAI's shape, and lm-eval's `local-completions` model runs multiple choice, rolling perplexity and generation
through it (its remote tokenizer on /tokenizer_info, /tokenize and /detokenize), with the loglikelihoods that
`linnet_jax.logits` gives directly and the generations `generate` gives."""

import json

import httpx
import jax
import numpy as np
import pytest
from conftest import record_parity
from test_serve import MODEL, WORDS, serving

import linnet_jax
from linnet_jax import generate
from linnet_jax.serve import Engine

QUESTIONS = [
    {"question": "The sea is", "choices": [" blue", " a cat", " seven"], "answer": 0},
    {"question": "Birds sang of", "choices": [" rain", " bread and hills"], "answer": 1},
    {"question": "A cat ran over the", "choices": [" hills", " quiet sea", " bread"], "answer": 0},
]
TEXTS = [{"text": "the sea a cat ran over blue hills while seven quiet birds sang"},
         {"text": "of rain and bread, and the cat ran. " * 6}]
MAX_LENGTH = 32  # lm-eval's max_length: its requests hold at most 31 prompt ids
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
def url(tiny_chat):
    with Engine(tiny_chat, slots=4, max_len=128) as engine, serving(engine) as url:
        yield url


def direct_logprobs(model, ids: list[int]) -> np.ndarray:
    """Each token's logprob after the first, from one full forward (`linnet_jax.logits`)."""
    logprobs = np.asarray(jax.nn.log_softmax(linnet_jax.logits(model, [ids])[0]))
    return logprobs[np.arange(len(ids) - 1), ids[1:]]


def completion(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL} | body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_returns_prompt_logprobs_in_openai_shape(tiny_chat, url):
    tokenizer = tiny_chat.tokenizer
    ids = tokenizer.encode("the sea a cat ran over blue hills", add_special_tokens=False)
    expected = direct_logprobs(tiny_chat, ids)
    answer = completion(url, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    choice, logprobs = answer["choices"][0], answer["choices"][0]["logprobs"]
    assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert np.abs(np.array(logprobs["token_logprobs"][1:]) - expected).max() < 1e-4
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["text_offset"] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    for top, token, logprob in zip(logprobs["top_logprobs"][1:], logprobs["tokens"][1:], logprobs["token_logprobs"][1:]):
        assert len(top) == 2 and max(top.values()) >= logprob - 1e-6
        assert top.get(token, logprob) == logprob  # the chosen token, when among the most likely, has its logprob

    greedy = generate(tiny_chat, tokens=[ids], max_new_tokens=3, ignore_eos=True, return_details=True)[0]
    choice = completion(url, prompt=ids, echo=True, logprobs=2, max_tokens=3, temperature=0,
                        ignore_eos=True)["choices"][0]
    assert choice["text"] == tokenizer.decode(ids) + greedy.text
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 3 and choice["logprobs"]["token_logprobs"][0] is None
    assert np.abs(np.array(choice["logprobs"]["token_logprobs"][len(ids):]) - greedy.logprobs).max() < 1e-4
    assert choice["logprobs"]["text_offset"][len(ids)] == len(tokenizer.decode(ids))
    # lm-eval's multiple-choice request: a text prompt, echoed as sent, then one generated token
    choice = completion(url, prompt="the sea a cat", echo=True, logprobs=1, max_tokens=1, temperature=0)["choices"][0]
    assert choice["text"].startswith("the sea a cat")
    assert len(choice["logprobs"]["tokens"]) == len(tokenizer.encode("the sea a cat", add_special_tokens=False)) + 1
    plain = completion(url, prompt="the sea", echo=True, max_tokens=2)["choices"][0]
    assert plain["text"].startswith("the sea") and plain["logprobs"] is None


def test_echo_scores_a_batch_of_prompts_of_many_lengths(tiny_chat, url):
    rows = [tiny_chat.tokenizer.encode(" ".join(WORDS[:k]), add_special_tokens=False) for k in (1, 3, 11, 40, 7)]
    answer = completion(url, prompt=rows, echo=True, logprobs=0, max_tokens=0, n=2)
    assert [c["index"] for c in answer["choices"]] == list(range(2 * len(rows)))
    for i, choice in enumerate(answer["choices"]):
        ids = rows[i // 2]
        assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["tokens"]) == len(ids)
        if len(ids) > 1:
            got = np.array(choice["logprobs"]["token_logprobs"][1:])
            assert np.abs(got - direct_logprobs(tiny_chat, ids)).max() < 1e-4
    assert answer["usage"]["prompt_tokens"] == sum(map(len, rows))


def test_a_generation_ended_by_a_stop_id_keeps_its_entry(tiny_chat, url):
    """As vLLM: the stop id's entry comes last, so lm-eval's prompt + 1 entries hold even when the greedy next
    token ends the generation (lm-eval drops the last entry)."""
    ids = tiny_chat.tokenizer.encode("seven quiet birds sang of", add_special_tokens=False)
    after = np.asarray(jax.nn.log_softmax(linnet_jax.logits(tiny_chat, [ids])[0, -1]))
    stop = int(after.argmax())
    choice = completion(url, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0,
                        stop_token_ids=[stop])["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == tiny_chat.tokenizer.decode(ids)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["tokens"][-1] == tiny_chat.tokenizer.decode([stop])
    assert abs(logprobs["token_logprobs"][-1] - after[stop]) < 1e-4
    assert np.abs(np.array(logprobs["token_logprobs"][1:-1]) - direct_logprobs(tiny_chat, ids)).max() < 1e-4
    # after a generated token: scored over the prompt and that token
    first = generate(tiny_chat, tokens=[ids], max_new_tokens=1, ignore_eos=True)[0]
    after = np.asarray(jax.nn.log_softmax(linnet_jax.logits(tiny_chat, [ids + first])[0, -1]))
    stop = int(after.argmax())
    if stop != first[0]:
        choice = completion(url, prompt=ids, echo=True, logprobs=1, max_tokens=5, temperature=0, ignore_eos=True,
                            stop_token_ids=[stop])["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 2
        assert abs(choice["logprobs"]["token_logprobs"][-1] - after[stop]) < 1e-4


def test_echo_refusals(url):
    for body, field in (({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "echo": True, "stream": True}, "echo"),
                        ({"prompt": "x", "echo": True, "max_tokens": 0, "model": "other"}, "model"),
                        ({"prompt": "", "echo": True, "max_tokens": 0, "logprobs": 1}, "prompt"),
                        ({"prompt": [1] * 129, "echo": True, "max_tokens": 0, "logprobs": 1}, "prompt"),
                        ({"prompt": "x", "echo": True, "max_tokens": 0, "suffix": "y"}, "suffix")):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == field, (body, response.text)


def greedy_question(model) -> dict:
    """A question whose first choice is the model's most likely next token after it: lm-eval puts a space before a
    choice, so that token is a space and a word, which the question's ids and the word encode back to."""
    tokenizer = model.tokenizer
    for context in ("The sea is", "Birds sang of", "A cat ran over the", "Seven quiet birds", "The cat ran"):
        ids = tokenizer.encode(context, add_special_tokens=False)
        token = int(np.argmax(linnet_jax.logits(model, ids)[0, -1]))
        word = tokenizer.decode([token])
        if word[:1] == " " and word[1:].isalpha() and tokenizer.encode(context + word, add_special_tokens=False) == [
                *ids, token]:
            return {"question": context, "choices": [word[1:], "seven"], "answer": 0}
    pytest.fail("no question's likeliest next token is a space and a word")


def write_tasks(directory, questions: list[dict] = QUESTIONS) -> None:
    (directory / "choice.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    (directory / "texts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    for name, task in TASKS.items():
        spec = {"task": name, "dataset_path": "json", "test_split": "train", "output_type": task["output_type"],
                "dataset_kwargs": {"data_files": {"train": str(directory / task["data"])}},
                **{k: v for k, v in task.items() if k not in ("output_type", "data")}}
        (directory / f"{name}.yaml").write_text(json.dumps(spec))  # JSON is YAML


def test_lm_eval_runs_its_three_request_kinds_against_the_server(tiny_chat, url, tmp_path):
    """Batches of 4 prompts per request; max_length 32 makes the longer text's rolling perplexity take
    several windows; one choice is the model's own most likely next token, so lm-eval's greedy flags differ."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    write_tasks(tmp_path, QUESTIONS + [greedy_question(tiny_chat)])
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=list(TASKS), task_manager=TaskManager(include_path=str(tmp_path)),
        model_args={"base_url": f"{url}/v1/completions", "model": MODEL, "tokenizer_backend": "remote",
                    "num_concurrent": 1, "max_retries": 1, "max_length": MAX_LENGTH},
        batch_size=4, log_samples=True)
    tokenizer = tiny_chat.tokenizer
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731 (the remote tokenizer's)

    def loglikelihood(context: list[int], continuation: list[int]) -> float:
        return direct_logprobs(tiny_chat, context + continuation)[len(context) - 1:].sum()

    def greedy(context: list[int], continuation: list[int]) -> bool:
        """Whether each continuation token is the most likely one after what precedes it (lm-eval's is_greedy)."""
        logits = np.asarray(linnet_jax.logits(tiny_chat, [context + continuation])[0])
        return bool(np.all(logits[len(context) - 1:-1].argmax(-1) == continuation))

    flags = []
    for sample in results["samples"]["linnet_choice"]:
        for (context, continuation), ((got, is_greedy),) in zip(sample["arguments"], sample["resps"]):
            context_ids = encode(context)
            continuation_ids = encode(context + continuation)[len(context_ids):]
            assert abs(got - loglikelihood(context_ids, continuation_ids)) < 1e-3
            assert is_greedy == greedy(context_ids, continuation_ids)
            flags.append(is_greedy)
    assert len(set(flags)) == 2, "some continuations are greedy and some are not"
    prefix = encode(tokenizer.bos_token or tokenizer.eos_token)[0]  # lm-eval's remote prefix token: BOS, else EOS
    windows = []
    for sample in results["samples"]["linnet_rolling"]:
        ids = encode(sample["doc"]["text"])
        windows.append([make_disjoint_window(w) for w in get_rolling_token_windows(ids, prefix, MAX_LENGTH - 2, 1)])
        expected = sum(loglikelihood(context, continuation) for context, continuation in windows[-1])
        assert abs(sample["resps"][0][0] - expected) < 1e-3
    assert max(map(len, windows)) > 1, "the longer text takes several windows"
    for sample in results["samples"]["linnet_generate"]:
        context = sample["arguments"][0][0]
        want = generate(tiny_chat, tokens=[encode(context)], max_new_tokens=6, stop=["\n"], return_details=True)[0]
        assert sample["resps"][0][0] == want.text
    assert np.isfinite(results["results"]["linnet_rolling"]["word_perplexity,none"])


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tasks")
    write_tasks(directory)
    return directory


def test_in_process_lm_equals_lm_evals_hf_model(tiny_chat, tiny_chat_dir, task_dir):
    """`linnet_jax.eval.LM` and lm-eval's `hf` model on the same weights: the same loglikelihoods (and greedy
    flags), rolling loglikelihoods (several windows of 32 tokens) and greedy generations, request by request."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from linnet_jax.eval import LM, evaluate

    ours = evaluate(LM(tiny_chat, batch_size=4, max_length=MAX_LENGTH), list(TASKS), include_path=task_dir,
                    log_samples=True)
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(tiny_chat_dir), "dtype": "float32", "max_length": MAX_LENGTH},
        device="cpu", tasks=list(TASKS), task_manager=TaskManager(include_path=str(task_dir)), batch_size=4,
        log_samples=True)
    worst = 0.0
    for task in TASKS:
        samples = [sorted(results["samples"][task], key=lambda s: s["doc_id"]) for results in (ours, theirs)]
        assert len(samples[0]) == len(samples[1]) == len(TEXTS if task == "linnet_rolling" else QUESTIONS)
        for mine, hf in zip(*samples):
            assert mine["arguments"] == hf["arguments"]
            for (got,), (want,) in zip(mine["resps"], hf["resps"], strict=True):  # one response per request
                if task == "linnet_generate":
                    assert got == want
                elif task == "linnet_rolling":
                    worst = max(worst, abs(got - want))
                else:  # (loglikelihood, whether the continuation is greedy)
                    worst = max(worst, abs(got[0] - want[0]))
                    assert got[1] == want[1]
    record_parity("lm-eval: linnet_jax.eval.LM vs lm-eval's hf model, |loglikelihood difference|", float(worst))
    assert worst < 1e-3
    assert ours["results"]["linnet_choice"]["acc,none"] == theirs["results"]["linnet_choice"]["acc,none"]


def test_eval_command_and_registry(tiny_chat_dir, task_dir, tmp_path, capsys):
    """`linnet-jax eval` prints lm-eval's table and writes its results; lm-eval's registry knows "linnet"; an
    unknown task is refused before the model loads."""
    import lm_eval.api.registry

    from linnet_jax.cli import main
    from linnet_jax.eval import LM

    assert lm_eval.api.registry.get_model("linnet") is LM
    out = tmp_path / "results.json"
    common = ["eval", "--model", str(tiny_chat_dir), "--include-path", str(task_dir), "--no-compilation-cache"]
    assert main([*common, "--tasks", "linnet_choice,linnet_rolling", "--limit", "2", "--max-length", "32",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"linnet_choice", "linnet_rolling"} and "linnet_choice" in printed
    assert 0 <= results["linnet_choice"]["acc,none"] <= 1
    assert np.isfinite(results["linnet_rolling"]["word_perplexity,none"])
    with pytest.raises(SystemExit, match="no lm-eval task named 'no_such_task'"):
        main([*common, "--tasks", "no_such_task"])
    with pytest.raises(SystemExit) as exit_info:  # --output is never written over without --overwrite
        main([*common, "--tasks", "linnet_choice", "--output", str(out)])
    assert "already exists" in str(exit_info.value)
