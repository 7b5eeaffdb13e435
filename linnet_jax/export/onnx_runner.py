"""Run a linnet_jax ONNX export without linnet_jax or torch: onnxruntime, numpy and tokenizers only.

`linnet_jax.export.onnx` copies this file into every export as `runner.py`, next to the graphs:

    import sys; sys.path.insert(0, "path/to/export")
    import runner

    params = runner.load_weights()                            # the prefill and decode sessions
    new_ids = runner.generate(params, [1, 2, 3], max_new_tokens=16)   # greedy; stops at the export's EOS ids
    new_ids = runner.generate(params, runner.encode("The capital of France is"), max_new_tokens=16)

The graphs (manifest.json says their files, the cache's shape and dtype): `prefill.onnx` takes tokens and
positions int64 [1, T] (any T; position -1 is padding, attending to nothing) and `decode.onnx` [1, 1]; both take
the cache per layer, k.0 .. k.{L-1} [1, G, K, S + 1] and v.0 .. v.{L-1} [1, G, S + 1, K] (slot p holds position
p, slot S takes padding's writes), and return the float32 logits [1, V] of the last column and the cache written
(k_out.*, v_out.*). Both read the weights from one file (manifest "weights").
"""

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnxruntime
from tokenizers import Tokenizer

HERE = Path(__file__).resolve().parent
MIN_BUCKET = 16  # prompt widths are powers of two from here (linnet_jax.inputs.bucket): few shapes to plan


class Sessions(NamedTuple):
    """What load_weights returns and generate takes: the two graphs' sessions and the export's manifest."""

    prefill: onnxruntime.InferenceSession
    decode: onnxruntime.InferenceSession
    manifest: dict


def load_weights(directory=None, threads: int | None = None) -> Sessions:
    """The export's sessions on ONNX Runtime's CPU provider (default: the export beside this file).
    threads: intra-op threads (None: ONNX Runtime's default)."""
    directory = HERE if directory is None else Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    options = onnxruntime.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads

    def session(name: str) -> onnxruntime.InferenceSession:
        return onnxruntime.InferenceSession(str(directory / manifest["graphs"][name]), options,
                                            providers=["CPUExecutionProvider"])

    return Sessions(session("prefill"), session("decode"), manifest)


def encode(text: str, directory=None) -> list[int]:
    """The ids of text by the export's tokenizer.json (no special tokens added)."""
    tokenizer = Tokenizer.from_file(str((HERE if directory is None else Path(directory)) / "tokenizer.json"))
    return tokenizer.encode(text, add_special_tokens=False).ids


def bucket(n: int) -> int:
    """The smallest power of two >= n, and at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (max(int(n), 1) - 1).bit_length())


def empty_cache(manifest: dict) -> dict[str, np.ndarray]:
    """Zero keys and values for every layer: {"k.0": [1, G, K, S + 1], ..., "v.0": [1, G, S + 1, K], ...} in the
    cache's dtype."""
    cache = manifest["cache"]
    return {f"{kv}.{layer}": np.zeros(cache[kv], cache["dtype"])
            for kv in "kv" for layer in range(manifest["num_layers"])}


def step(session: onnxruntime.InferenceSession, tokens: np.ndarray, positions: np.ndarray,
         cache: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One graph run: (float32 logits [1, V] of the last column, the cache written)."""
    logits, *written = session.run(None, {"tokens": tokens, "positions": positions, **cache})
    return logits, dict(zip(cache, written))


def generate(params: Sessions, ids: list[int], max_new_tokens: int, stop_ids=None) -> list[int]:
    """Greedy: up to max_new_tokens new ids after the prompt `ids`, ending before the first stop id (default: the
    export's EOS ids). The prompt plus the new tokens must fit the cache's max_len slots."""
    manifest = params.manifest
    stop_ids = manifest["eos_token_ids"] if stop_ids is None else stop_ids
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not ids or len(ids) + max_new_tokens > manifest["max_len"]:
        raise ValueError(f"a prompt of {len(ids)} ids plus {max_new_tokens} new tokens does not fit the cache of "
                         f"{manifest['max_len']} positions (nor may the prompt be empty)")
    if not all(0 <= i < manifest["vocab_size"] for i in ids):
        raise ValueError(f"token ids must be in [0, {manifest['vocab_size']}), got {min(ids)}..{max(ids)}")
    width = bucket(len(ids))
    tokens, positions = np.zeros((1, width), np.int64), np.full((1, width), -1, np.int64)
    tokens[0, width - len(ids):] = ids  # left-padded: the last column is the prompt's last token
    positions[0, width - len(ids):] = np.arange(len(ids))
    logits, cache = step(params.prefill, tokens, positions, empty_cache(manifest))
    new = [int(logits[0].argmax())]
    while new[-1] not in stop_ids and len(new) < max_new_tokens:
        position = np.full((1, 1), len(ids) + len(new) - 1, np.int64)
        logits, cache = step(params.decode, np.full((1, 1), new[-1], np.int64), position, cache)
        new.append(int(logits[0].argmax()))
    return new[:-1] if new[-1] in stop_ids else new
