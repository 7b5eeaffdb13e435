"""linnet_jax.tokenizer against transformers: SmolLM2's GGUF tokenizer (ids, decode, chat template),
transformers-format directories both ways, a sentencepiece GGUF vocabulary, and the error messages."""

import json

import jinja2
import numpy as np
import pytest
import transformers
from hypothesis import given
from hypothesis import strategies as st

from linnet_jax.gguf import read_gguf, write_gguf
from linnet_jax.text import Cursor, Detokenizer, StopPrefix
from linnet_jax.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ça va? 日本語のテキストと中文 🙂👍🏽 🇫🇷",
    "def f(x):\n    if x:\n        return x  *  2\n\treturn None\n",
    "   leading and trailing spaces   ",
    "a\n\nb\r\n\n\n  c\t\td",
    "12345 3.14159 -7e10 1,000,000 2024-01-01",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <repo_name>x",
    "don't I'll we've they're",
    "",
    " ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 日本"},
     {"role": "user", "content": "Code:\n    x = 1"}],
]


@pytest.fixture(scope="session")
def smollm2_metadata(smollm2_contents):
    return smollm2_contents[2]


@pytest.fixture(scope="session")
def ours(smollm2_metadata):
    return Tokenizer.from_gguf_metadata(smollm2_metadata)


@pytest.fixture(scope="session")
def reference(smollm2_reference_tokenizer):
    return smollm2_reference_tokenizer


def ref_ids(tokenizer, text, add_special_tokens=False):
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def ref_chat(tokenizer, messages, add_generation_prompt, tokenize):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                                         return_dict=False)


def test_special_ids(ours, reference):
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == (reference.eos_token_id,) == (2,)
    assert ours.pad_token_id == reference.pad_token_id == 2
    assert ours.vocab_size == len(reference) == 49152


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == ref_ids(reference, text)
    assert ours.encode(text, add_special_tokens=True) == ref_ids(reference, text, add_special_tokens=True)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert ours.decode(np.array(ids, dtype=np.int32)) == ours.decode(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, messages, add_generation_prompt):
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == ref_chat(reference, messages, add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True) == \
        ref_chat(reference, messages, add_generation_prompt, tokenize=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_saved_dir_loads_in_transformers_and_ours(ours, tmp_path):
    ours.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"}
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == ours.chat_template
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    again = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert ref_ids(theirs, text) == ours.encode(text) == again.encode(text)
        assert ref_ids(theirs, text, True) == ours.encode(text, True) == again.encode(text, True)
    for messages in CONVERSATIONS:
        assert ref_chat(theirs, messages, True, tokenize=False) == ours.apply_chat_template(messages) \
            == again.apply_chat_template(messages)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (1, 2, 2)
    assert (again.bos_token_id, again.eos_token_ids, again.pad_token_id, again.vocab_size) == (1, (2,), 2, 49152)


def test_transformers_saved_dir_loads_in_ours(reference, ours, tmp_path):
    reference.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.eos_token_ids == (2, 0)  # the tokenizer's eos first, then generation_config's others
    assert (loaded.bos_token_id, loaded.pad_token_id, loaded.vocab_size) == (1, 2, 49152)
    assert loaded.chat_template == reference.chat_template
    for text in TEXTS:
        assert loaded.encode(text) == ref_ids(reference, text)
        assert loaded.encode(text, True) == ref_ids(reference, text, True)
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == ref_chat(reference, messages, True, tokenize=False)


def test_gguf_metadata(ours, smollm2_metadata, reference, tmp_path):
    """From GGUF: the keys it came from. From a transformers dir: regenerated, equal to the file's."""
    assert ours.gguf_metadata() == {k: v for k, v in smollm2_metadata.items() if k.startswith("tokenizer.")}
    reference.save_pretrained(tmp_path)
    regenerated = Tokenizer.from_hf_dir(tmp_path).gguf_metadata()
    for key in ("model", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id", "padding_token_id",
                "unknown_token_id", "add_bos_token"):
        assert regenerated[f"tokenizer.ggml.{key}"] == smollm2_metadata[f"tokenizer.ggml.{key}"], key
    assert regenerated["tokenizer.ggml.pre"] == "gpt-2"  # ByteLevel's own regex, what this tokenizer.json holds
    assert regenerated["tokenizer.chat_template"] == smollm2_metadata["tokenizer.chat_template"]
    rebuilt = Tokenizer.from_gguf_metadata(regenerated)
    assert all(rebuilt.encode(text) == ours.encode(text) for text in TEXTS)


def test_sentencepiece_gguf_round_trip_matches_transformers(tmp_path):
    """A tiny "llama" (sentencepiece) vocabulary, written by write_gguf: ours equals transformers on the file."""
    pieces = ["▁", "a", "b", "c", "d", "e", "h", "l", "o", "w", "r", "▁h", "he", "ll", "llo", "▁hello", "▁w",
              "or", "▁wor", "ld", "▁world", "el", "hel", "▁he", "<tool>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    metadata = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [4],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}{{ bos_token + m['content'] + eos_token }}{% endfor %}",
    }
    config = {"model_type": "llama", "vocab_size": len(tokens), "hidden_size": 32, "intermediate_size": 32,
              "num_hidden_layers": 0, "num_attention_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 64}
    state = {"model.embed_tokens.weight": np.zeros((len(tokens), 32), np.float32)}
    path = write_gguf(tmp_path / "spm.gguf", config, state, tokenizer_metadata=metadata, progress=False)
    ours = Tokenizer.from_gguf_metadata(read_gguf(path, progress=False)[2])
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["hello world", "hello  world", " hello", "héllo wor<tool>ld", "abc\n", "<s>hi</s>", "<unk>x"]:
        ids = ours.encode(text)
        assert ids == ref_ids(theirs, text), text
        assert ours.encode(text, True) == ref_ids(theirs, text, True) == [1, *ids], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, False) == theirs.decode(ids, skip_special_tokens=False), text
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


# ---- missing pieces and errors ----

def test_nothing_to_load(tmp_path):
    assert Tokenizer.from_hf_dir(tmp_path) is None
    assert Tokenizer.from_gguf_metadata({"general.architecture": "llama"}) is None


def test_no_chat_template(ours):
    bare = Tokenizer(ours.backend, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="this tokenizer has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("messages", [
    "hi", [], ["hi"], [{"content": "hi"}], [{"role": "user"}], [{"role": 3, "content": "hi"}]])
def test_bad_messages(ours, messages):
    with pytest.raises(ValueError, match=r"messages.* must be a"):
        ours.apply_chat_template(messages)


def test_template_raise_exception(ours):
    template = "{{ raise_exception('only user messages, got ' + messages[0].role) }}"
    strict = Tokenizer(ours.backend, chat_template=template)
    with pytest.raises(jinja2.exceptions.TemplateError, match="only user messages, got system"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])


@pytest.mark.parametrize("bad", [49152, -1, 10**6])
def test_decode_out_of_vocabulary(ours, bad):
    with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \(vocab size 49152\)"):
        ours.decode([1, bad])


def test_unsupported_gguf_tokenizer_model():
    with pytest.raises(ValueError, match="GGUF tokenizer model 'bert' is not supported; supported: gpt2, llama"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="GGUF tokenizer metadata key 'tokenizer.ggml.merges' is missing"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})


# ---- incremental detokenization (linnet_jax.text.Detokenizer) ----

def random_output(ours, seed: int, length: int) -> list[int]:
    """Ids as a model might emit them: random vocabulary ids (byte tokens, halves of multi-byte characters,
    special tokens) interleaved with the ids of multilingual text."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < length:
        ids += ours.encode(TEXTS[rng.integers(len(TEXTS))]) if rng.random() < 0.5 else \
            rng.integers(0, ours.vocab_size, rng.integers(1, 8)).tolist()
    return ids[:length]


def fed(detokenizer: Detokenizer, ids: list[int], seed: int) -> str:
    """Feed ids in random chunks, as dispatches deliver them; return the text a reader was shown meanwhile."""
    rng, cursor, shown, start = np.random.default_rng(seed), Cursor(), "", 0
    while start < len(ids):
        end = start + int(rng.integers(1, 6))
        detokenizer.add(ids[start:end])
        shown += detokenizer.unread(cursor)[0]
        start = end
    return shown


def cut_at_stops(ours, ids: list[int], stops: list[str]) -> tuple[str, list[int]]:
    """The reference: the text of all the ids cut before the earliest stop string, and the longest prefix of
    the ids whose text lies wholly before the cut."""
    text = ours.decode(ids)
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not found:
        return text, ids
    text = text[:min(found)]
    return text, ids[:next(n for n in range(len(ids), -1, -1) if text.startswith(ours.decode(ids[:n])))]


@pytest.mark.parametrize("seed", range(4))
def test_detokenizer_text_equals_decode_of_all_ids(ours, seed):
    ids = random_output(ours, seed, 1500)
    detokenizer = Detokenizer(ours)
    shown = fed(detokenizer, ids, seed)
    result = detokenizer.generation("length", [0.0] * len(ids))
    assert result.text == ours.decode(ids) and result.tokens == ids
    assert result.text.startswith(shown) and len(shown) > len(result.text) - 20
    assert any(ord(c) > 0x7FF for c in result.text), "multi-byte characters are in the output"


@pytest.mark.parametrize("seed", range(6))
def test_detokenizer_stop_strings_cut_as_the_whole_text_would(ours, seed):
    ids = random_output(ours, seed, 300)
    text, rng = ours.decode(ids), np.random.default_rng(seed)
    stops = [text[i:i + int(rng.integers(1, 5))] for i in rng.integers(len(text) // 3, len(text), 2)] + ["zz-never"]
    detokenizer = Detokenizer(ours, stops)
    shown = fed(detokenizer, ids, seed)
    result = detokenizer.generation("length", list(range(len(ids))))
    want_text, want_ids = cut_at_stops(ours, ids, stops)
    assert (result.text, result.tokens, result.stop_reason) == (want_text, want_ids, "stop")
    assert result.logprobs == list(range(len(want_ids)))
    assert want_text.startswith(shown) and not any(s in shown for s in stops)


def test_detokenizer_decodes_each_id_once_not_the_whole_text_again(ours):
    """The ids passed to the tokenizer's decode grow linearly with the output (rebuilding the text from the first
    id at every step would pass n²/2 of them)."""
    class Counting:
        def __init__(self):
            self.ids = 0

        def decode(self, ids, **options):
            self.ids += len(ids)
            return ours.decode(ids, **options)

    counting, ids = Counting(), random_output(ours, 7, 4000)
    detokenizer = Detokenizer(counting, ["zz-never", "§§§"])
    for token in ids:
        detokenizer.add([token])
    assert detokenizer.generation("length", []).text == ours.decode(ids)
    assert counting.ids < 8 * len(ids), counting.ids


@given(stop=st.text("ab", min_size=1, max_size=8), pieces=st.lists(st.text("abc", max_size=6), max_size=8))
def test_stop_prefix_is_the_longest_prefix_of_the_stop_that_the_text_ends_with(stop, pieces):
    prefix, text = StopPrefix(stop), ""
    for piece in pieces:
        prefix.feed(piece)
        text += piece
        assert prefix.matched == max(n for n in range(len(stop) + 1) if text.endswith(stop[:n]))


def test_detokenizer_holds_back_in_linear_time_with_a_long_stop_string(ours):
    """How much of a stop string the text ends with is kept up to date as text arrives, not searched for again at
    each step: the stop string's characters are read O(text + stop) times (the search at each step read
    O(steps × stop), the prefixes' copies O(steps × stop²))."""
    class Counting(str):
        reads = 0

        def __getitem__(self, index):
            Counting.reads += 1
            return super().__getitem__(index)

    text = "a" * 2000
    stop = Counting("a" * 1000 + "b")
    detokenizer, cursor, shown = Detokenizer(ours, [stop]), Cursor(), ""
    for token in ours.encode(text):
        detokenizer.add([token])
        shown += detokenizer.unread(cursor)[0]
    assert len(text) - 1000 - 16 < len(shown) <= len(text) - 1000, "the last 1000 characters may begin the stop"
    assert detokenizer.generation("length", []).text == text
    assert Counting.reads < 10 * (len(text) + len(stop)), Counting.reads
