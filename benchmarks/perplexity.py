"""Perplexity of a local text under decode.py's systems: how much a quantization costs the model, against a peer's.

    python benchmarks/perplexity.py [--systems linnet_jax,linnet_jax_int8,linnet_jax_q8_0,llama_cpp_q8_0]
                                    [--text README.md] [--tokens 512]

The text's first --tokens ids (SmolLM2's tokenizer, no chat template) are scored in one forward by each system's
`logits` (decode.py's rows: the same loads, exports and peers), one system at a time in this process; perplexity
is exp(mean negative log-likelihood of each next id). Prints a markdown table.
"""

import argparse
from pathlib import Path

import numpy as np
from decode import SYSTEMS

import linnet_jax
from linnet_jax.load import default_model_path

DEFAULT_SYSTEMS = "linnet_jax,linnet_jax_int8,linnet_jax_q8_0,llama_cpp_q8_0"


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under logits[:-1] ([T, V] float32)."""
    logits = logits[:-1].astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return float(np.exp(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]])))


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--systems", default=DEFAULT_SYSTEMS)
    options.add_argument("--text", type=Path, default=Path(__file__).resolve().parent.parent / "README.md")
    options.add_argument("--tokens", type=int, default=512)
    args = options.parse_args()
    model_path = default_model_path()
    tokenizer = linnet_jax.load(model_path, progress=False).tokenizer
    ids = np.asarray(tokenizer.encode(args.text.read_text())[:args.tokens], np.int32)
    print(f"Perplexity of the first {len(ids)} ids of {args.text.name} (SmolLM2-135M-Instruct)\n")
    print("| system | perplexity |\n|---|---|")
    for name in args.systems.split(","):
        system = SYSTEMS[name](model_path, len(ids))
        system.prepare()
        system.load()
        print(f"| {system.label} | {perplexity(np.asarray(system.logits(ids)), ids):.3f} |", flush=True)


if __name__ == "__main__":
    main()
