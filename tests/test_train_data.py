"""Training data: the three record forms and their loss masks, packing, deterministic resumable batches, and
clear messages for bad data."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import linnet_jax
from linnet_jax import train
from linnet_jax.train.data import Batches, DataError, Document, encode_record, load_documents, pack


def write_jsonl(path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def counted_text(tokenizer, doc: Document) -> str:
    return tokenizer.decode(doc.tokens[doc.loss_mask == 1], skip_special_tokens=False)


def test_chat_counts_only_the_assistant_turns(smollm2):
    tokenizer = smollm2.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"},
                {"role": "assistant", "content": "Lima."}, {"role": "user", "content": "And of Chile?"},
                {"role": "assistant", "content": "Santiago."}]
    doc = encode_record({"messages": messages}, tokenizer, "x:1")
    assert counted_text(tokenizer, doc) == "Lima.<|im_end|>\nSantiago.<|im_end|>\n"
    assert tokenizer.decode(doc.tokens, skip_special_tokens=False) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=False)
    # The context before a reply is tokenized as generate tokenizes the prompt.
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=True)
    assert doc.tokens[:len(prompt)].tolist() == prompt and doc.loss_mask[len(prompt)] == 1


def test_prompt_completion_and_text(smollm2):
    tokenizer = smollm2.tokenizer
    doc = encode_record({"prompt": "The sky is", "completion": " blue."}, tokenizer, "x:1")
    assert counted_text(tokenizer, doc) == " blue.<|im_end|>"
    text = encode_record({"text": "Every word counts."}, tokenizer, "x:2")
    assert text.loss_mask.tolist() == [0] + [1] * (len(text.tokens) - 1)
    assert tokenizer.decode(text.tokens, skip_special_tokens=False) == "Every word counts.<|im_end|>"


@pytest.mark.parametrize("lines, message", [
    ([], "data.jsonl: the file is empty; expected JSON Lines"),
    (['{"text": "fine"}', "{not json"], "data.jsonl:2: not JSON (Expecting property name enclosed in double quotes "
                                        "at column 2); expected one JSON object per line"),
    ([{"question": "q", "answer": "a"}], 'data.jsonl:1: expected an object with "messages" (a list), "prompt" and '
                                         '"completion" (strings), or "text" (a string); got keys [\'answer\', '
                                         "'question']"),
    (["[1, 2]"], "data.jsonl:1: expected an object with"),
    ([{"messages": [{"role": "user", "content": "Hi"}]}], "data.jsonl:1: the conversation has no assistant turn"),
    ([{"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}],
     "data.jsonl:1: messages[1] has role 'bot'; expected one of ('system', 'user', 'assistant', 'tool')"),
    ([{"text": "short"}, {"text": "word " * 40}], "data.jsonl:2: the record is 42 tokens long, longer than "
                                                   "seq_len=16; raise seq_len (--seq-len)"),
])
def test_bad_data_is_named(smollm2, tmp_path, lines, message):
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    with pytest.raises(DataError) as error:
        load_documents(path, smollm2.tokenizer, 16)
    assert message in str(error.value)
    assert str(tmp_path / "data.jsonl") in str(error.value)


HELLO = json.dumps({"text": "hello"}).encode()
NESTED = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("content, message", [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "data.jsonl:1: not UTF-8 (byte 0x89 at column 1); expected UTF-8 text"),
    (HELLO + b"\n" + b'{"text": "caf\xe9"}\n', "data.jsonl:2: not UTF-8 (byte 0xE9 at column 14)"),
    ('{"text": "hello"}\n'.encode("utf-16"), "data.jsonl:1: a NUL byte at column 4, so this is a binary or UTF-16 "
                                            "file; expected UTF-8 text"),
    (HELLO + b"\n" + NESTED + b"\n", "data.jsonl:2: JSON nested too deeply to read"),
    (b'{"text": "a \\ud800 b"}\n', "data.jsonl:1: the text holds a lone surrogate, U+D800, at position 2"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}, {"role": "assistant", "content": "Hi"}]}\n',
     "data.jsonl:1: messages[0]['content'] holds a lone surrogate, U+DFFF"),
    (b'{"prompt": "Capital of Peru?", "completion": ""}\n',
     "data.jsonl:1: the completion is empty; it would teach the model to end its reply at once"),
    (b'{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}\n',
     "data.jsonl:1: messages[1] is an empty assistant turn; it would teach the model to end its turn at once"),
], ids=["binary", "latin-1", "utf-16", "nested", "surrogate", "chat-surrogate", "empty-completion", "empty-turn"])
def test_undecodable_data_and_empty_targets_are_named(smollm2, tmp_path, content, message):
    """Issue 19, items 8 and 10: each a DataError naming the file and the line, no traceback of another kind."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as error:
        load_documents(path, smollm2.tokenizer, 16)
    assert f"{tmp_path}/{message}" in str(error.value)


def test_a_utf8_byte_order_mark_is_read_past(smollm2, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + HELLO + b"\r\n" + HELLO + b"\n")
    documents, _ = load_documents(path, smollm2.tokenizer, 16)
    assert [d.source for d in documents] == [f"{path}:1", f"{path}:2"]


def test_truncation_is_counted(smollm2, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "short"}, {"text": "word " * 40}, {"text": "word " * 30}])
    with pytest.warns(UserWarning, match="2 of 3 records were truncated to seq_len=16"):
        documents, truncated = load_documents(path, smollm2.tokenizer, 16, truncate=True)
    assert truncated == 2 and [len(d.tokens) for d in documents] == [2, 16, 16]


def random_documents(vocab: int, lengths: list[int], seed: int = 0) -> list[Document]:
    rng = np.random.default_rng(seed)
    docs = []
    for i, n in enumerate(lengths):
        mask = (rng.random(n) < 0.7).astype(np.int32)
        mask[0] = 0
        docs.append(Document(rng.integers(0, vocab, n).astype(np.int32), mask, f"doc {i}"))
    return docs


def test_packed_rows_give_each_document_its_own_losses(tiny_dir):
    """Packed with others (segment ids, restarted positions) a document's token losses equal it run alone."""
    model = linnet_jax.load(tiny_dir("mistral_sliding")[1], progress=False)  # with a sliding window
    documents = random_documents(model.config.vocab_size, [11, 20, 7, 25, 30, 3])
    rows = pack(documents, 64)
    assert rows["tokens"].shape == (2, 64) and rows["segment_ids"].max() == 4
    packed, counts = map(np.asarray, train.token_losses(model.params, model.config, {k: jnp.asarray(v) for k, v in rows.items()}))
    worst, r, start = 0.0, 0, 0
    for doc in documents:
        if start + len(doc.tokens) > 64:
            r, start = r + 1, 0
        alone, alone_counts = map(np.asarray, train.token_losses(model.params, model.config, {
            "tokens": jnp.asarray(doc.tokens[None]), "loss_mask": jnp.asarray(doc.loss_mask[None])}))
        end = start + len(doc.tokens)
        assert np.array_equal(counts[r, start:end - 1], alone_counts[0])  # no target across documents
        assert counts[r, end - 1:end].sum() == 0 or end == 64
        worst = max(worst, float(np.abs(packed[r, start:end - 1] - alone[0]).max(initial=0)))
        start = end
    assert worst < 1e-5
    padded = pack(documents, 64, packing=False)
    assert padded["tokens"].shape == (6, 64) and set(np.unique(padded["segment_ids"])) == {0, 1}


def test_batches_are_deterministic_and_resume(tiny_dir):
    documents = random_documents(256, [5, 9, 12, 3, 7, 8, 10, 4, 6, 11])
    stream = Batches(documents, batch_size=3, seq_len=16, seed=7)
    batches, states = [], []
    for _ in range(8):  # several epochs
        states.append(stream.get_state())
        batches.append(next(stream))
    assert states[-1]["epoch"] >= 2
    again = Batches(documents, batch_size=3, seq_len=16, seed=7)
    again.set_state(states[5])
    for expected in batches[5:]:
        got = next(again)
        assert all(np.array_equal(got[k], expected[k]) for k in expected)
    other = next(Batches(documents, batch_size=3, seq_len=16, seed=8))
    assert not np.array_equal(other["tokens"], batches[0]["tokens"])
    epoch0 = Batches(documents, 3, 16, seed=7).rows(0)
    tokens = sorted(int(t) for t in epoch0["tokens"][epoch0["segment_ids"] > 0])
    assert tokens == sorted(int(t) for d in documents for t in d.tokens)  # an epoch holds every document once
