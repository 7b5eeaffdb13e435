"""lm-evaluation-harness in process: `LM`, an `lm_eval.api.model.LM` over a loaded model (registered with lm-eval as
"linnet"), and `evaluate`, lm-eval's `simple_evaluate` with it (`linnet-jax eval`, and finetune's eval_tasks).

Requests are tokenized as lm-eval's `hf` model tokenizes them (its TemplateLM: a context's trailing spaces move
to the continuation, the continuation is what encoding context + continuation adds, an empty context is the
prefix token, BOS or else EOS). `loglikelihood` scores context + continuation, cut to the last max_length + 1
ids, with `linnet_jax.score` (full forwards, batched: what the server's `echo` reports); `loglikelihood_rolling`
scores lm-eval's disjoint windows of max_length tokens the same way and sums them; `generate_until` runs
`linnet_jax.generate` on the context (cut to its last max_length - max_gen_toks ids) with the request's stop
strings and the EOS text, and cuts the text at the first of them as lm-eval does.
"""

from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as error:  # an optional dependency: the `eval` extra
    raise ImportError(f"linnet_jax.eval needs lm-eval ({error}); install it with pip install 'linnet_jax[eval]'"
                      ) from error

from linnet_jax.generate import generate
from linnet_jax.loaded import Model
from linnet_jax.score import score

SCORED_PER_CALL = 64  # sequences per `score` call: each result holds a vocabulary-sized distribution
# lm-eval's generation keywords -> generate's (do_sample, until and max_gen_toks are read before).
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "seed": "seed"}


@register_model("linnet")
class LM(TemplateLM):
    """lm-eval's model interface over a linnet_jax Model.

    pretrained: a loaded Model, or what `linnet_jax.load` takes (an HF directory, hub id or .gguf; lm-eval's
    `--model linnet --model_args pretrained=DIR,dtype=float32`), loaded with `dtype`. batch_size: prompts
    generated together. max_length: the most ids a scored window holds (default the model's
    max_position_embeddings, as lm-eval's `hf` model). max_gen_toks: generate_until's default budget.
    """

    def __init__(self, pretrained: "Model | str | Path | None" = None, *, dtype: str | None = None,
                 batch_size: int | str = 16, max_length: int | None = None, max_gen_toks: int = 256):
        super().__init__()
        if isinstance(pretrained, Model):
            if dtype is not None:
                raise ValueError("dtype is a load option; LM got a loaded Model (load it with that dtype instead)")
            self.model = pretrained
        else:
            from linnet_jax.load import load

            self.model = load(pretrained, dtype=dtype, progress=False)
        if self.model.tokenizer is None:
            raise ValueError("LM needs a model with a tokenizer to encode the requests")
        self.tokenizer = self.model.tokenizer
        self.batch_size = positive(batch_size, "batch_size")
        self.max_length = positive(max_length or self.model.config.max_position_embeddings, "max_length")
        self.max_gen_toks = positive(max_gen_toks, "max_gen_toks")

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is (lm-eval's `hf`): BOS, or EOS when the tokenizer has none."""
        return self.eot_token_id if self.tokenizer.bos_token_id is None else self.tokenizer.bos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """The ids of `string` (`hf`'s: the tokenizer's special tokens unless add_special_tokens=False or the string
        starts with the BOS text), the last left_truncate_len of them when given."""
        if add_special_tokens is None:
            bos = self.tokenizer.bos_token
            add_special_tokens = not (bos and string.startswith(bos))
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation) or None, context ids, continuation ids) → (the continuation's log-probability
        after the context, whether each of its tokens is the most likely one) for each request, in order."""
        sequences = []
        for _, context, continuation in requests:
            if not 0 < len(continuation) <= self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens; expected 1 to max_length "
                                 f"({self.max_length})")
            sequences.append((context + continuation)[-(self.max_length + 1):])
        order = sorted(range(len(requests)), key=lambda i: -len(sequences[i]))  # similar lengths share a dispatch
        results: list[tuple[float, bool]] = [None] * len(requests)  # type: ignore[list-item]
        for start in tqdm(range(0, len(order), SCORED_PER_CALL), desc="linnet loglikelihood", disable=disable_tqdm):
            chunk = order[start:start + SCORED_PER_CALL]
            for i, scored in zip(chunk, score(self.model, [sequences[i] for i in chunk])):
                continuation, first = requests[i][2], len(sequences[i]) - len(requests[i][2])
                greedy = all(scored.top[first - 1 + k][0][0] == token for k, token in enumerate(continuation))
                results[i] = (float(sum(scored.logprobs[first - 1:])), greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability: the sum over lm-eval's disjoint windows of max_length tokens, the first
        after the prefix token, each later one with the most context that fits."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, 1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation from `generate` (greedy unless do_sample), ended by max_gen_toks or the
        first of the request's `until` strings or the EOS text, which it is cut before."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(request.args[1]), []).append(i)
        results: list[str] = [None] * len(requests)  # type: ignore[list-item]
        bar = tqdm(total=len(requests), desc="linnet generate_until", disable=disable_tqdm)
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise ValueError(f"max_gen_toks {max_gen_toks} leaves no room for a context in max_length "
                                 f"{self.max_length}")
            sampling = sampling_options(kwargs)
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                contexts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen_toks)
                            for i in chunk]
                done = generate(self.model, tokens=contexts, max_new_tokens=max_gen_toks, stop=until,
                                return_details=True, **sampling)
                for i, generation in zip(chunk, done):
                    results[i] = postprocess_generated_text(generation.text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
                bar.update(len(chunk))
        bar.close()
        return results


def sampling_options(kwargs: dict) -> dict:
    """generate's sampling keywords from lm-eval's normalized generation keywords (after until and max_gen_toks):
    greedy without do_sample; a keyword generate has no use for is a ValueError naming it."""
    do_sample = kwargs.pop("do_sample", False)
    unknown = sorted(set(kwargs) - set(SAMPLING))
    if unknown:
        raise ValueError(f"generation keywords {unknown} are not supported; expected until, max_gen_toks, do_sample "
                         f"and {', '.join(SAMPLING)}")
    options = {SAMPLING[name]: value for name, value in kwargs.items()}
    if not do_sample:
        options["temperature"] = 0.0
    return options


def positive(value, name: str) -> int:
    """An int ≥ 1 (or its digits, as lm-eval's argument strings give it), or a ValueError naming it."""
    number = int(value) if isinstance(value, str) and value.isdigit() else value
    if not (isinstance(number, int) and not isinstance(number, bool) and number >= 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return number


def evaluate(model: "Model | LM", tasks: str | Iterable[str], *, include_path=None, limit: float | None = None,
             num_fewshot: int | None = None, batch_size: int = 16, max_length: int | None = None,
             log_samples: bool = False) -> dict:
    """lm-eval's `simple_evaluate` with `LM(model)` (or the LM given) on `tasks` (names, or one comma-separated
    string), tasks of `include_path` (a directory of task YAMLs) added to lm-eval's own; limit: at most that many
    documents per task (a fraction below 1). Returns lm-eval's results dict ("results" per task and metric,
    "samples" with log_samples)."""
    from lm_eval import simple_evaluate

    names, manager = tasks_to_run(tasks, include_path)
    lm = model if isinstance(model, LM) else LM(model, batch_size=batch_size, max_length=max_length)
    return simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                           log_samples=log_samples)


def tasks_to_run(tasks: str | Iterable[str], include_path=None):
    """(the task names, lm-eval's TaskManager with include_path's tasks added); a ValueError names each task (or
    group) lm-eval does not know."""
    from lm_eval.tasks import TaskManager

    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    if not names or not all(names):
        raise ValueError(f"tasks must name at least one lm-eval task, got {tasks!r}")
    if include_path is not None and not Path(include_path).is_dir():
        raise NotADirectoryError(f"{include_path}: no such directory of task YAMLs (include_path)")
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        where = f" in {include_path} or" if include_path is not None else ""
        raise ValueError(f"no lm-eval task named {', '.join(map(repr, unknown))}{where} among lm-eval's own "
                         "(`lm_eval ls tasks` lists them; include_path (--include-path) adds a directory of yours)")
    return names, manager


def metric_values(results: dict) -> dict[str, float]:
    """The numbers of lm-eval's results as {"task/metric,filter": value} (e.g. "arc_easy/acc,none")."""
    return {f"{task}/{metric}": float(value) for task, metrics in results["results"].items()
            for metric, value in metrics.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}


__all__ = ["LM", "evaluate", "metric_values", "tasks_to_run"]
