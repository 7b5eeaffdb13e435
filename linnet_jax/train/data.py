"""Training data: JSON Lines → token documents with loss masks → rows of a fixed length → batches.

Each line of the file (UTF-8) is one record, in one of three forms:
  {"messages": [{"role": ..., "content": ...}, ...]}  chat, rendered with the model's chat template;
                                                       only the assistant turns count in the loss
  {"prompt": "...", "completion": "..."}              only the completion (and an EOS) counts
  {"text": "..."}                                     every token (and an EOS) counts

Preference data (DPO, `load_pairs`) holds {"prompt": ...} or {"messages": [...]} with "chosen" and "rejected"
replies (strings): each reply becomes its own document after the prompt, and only the reply counts.

Assistant spans are found by rendering prefixes of the conversation (most chat templates have no
`{% generation %}` markers): the text a turn adds after the generation prompt of the turns before it.
Each piece is tokenized on its own, as a prompt and its generated reply are at inference.

Rows are packed (documents share a row, each with its own segment id; positions restart in each
document and attention never crosses one) or padded (a document per row), both to seq_len with
segment id 0 as padding. `Batches` is an endless iterator over epochs, each a deterministic shuffle of
the documents (seed, epoch); its position, `get_state()`, is two ints that `set_state` restores, as
grain's checkpointable iterators do.
"""

import codecs
import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Document:
    """One record's tokens int32 [N] and loss_mask int32 [N] (1 where the token is a target), and where it came
    from ("file:line")."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    source: str


class DataError(ValueError):
    """Bad training data; the message names the file, the line and what was expected."""


def json_lines(path: Path) -> list[tuple[str, object]]:
    """The JSON value on each non-blank line of a UTF-8 file (after a UTF-8 byte-order mark, if any), with where
    it came from ("file:line"). A line that holds a NUL byte (a binary or UTF-16 file), is not UTF-8, is not
    JSON or is nested too deeply to read is a DataError naming it."""
    values = []
    for number, line in enumerate(path.read_bytes().removeprefix(codecs.BOM_UTF8).split(b"\n"), 1):
        where = f"{path}:{number}"
        if (nul := line.find(0)) >= 0:
            raise DataError(f"{where}: a NUL byte at column {nul + 1}, so this is a binary or UTF-16 file; expected "
                            "UTF-8 text")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataError(f"{where}: not UTF-8 (byte 0x{line[error.start]:02X} at column {error.start + 1}); "
                            "expected UTF-8 text") from None
        if not text.strip():
            continue
        try:
            values.append((where, json.loads(text)))
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: not JSON ({error.msg} at column {error.colno}); expected one JSON object "
                            "per line") from None
        except RecursionError:
            raise DataError(f"{where}: JSON nested too deeply to read; expected one record per line, a few levels "
                            "deep") from None
    return values


def read_jsonl(path) -> list[tuple[str, object]]:
    """The records of a JSON Lines file with where each came from ("file:line"); blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    records = json_lines(path)
    if not records:
        raise DataError(f"{path}: the file is empty; expected JSON Lines, one record per line: "
                        '{"messages": [...]}, {"prompt": ..., "completion": ...} or {"text": ...}')
    return records


def encode_record(record, tokenizer, where: str) -> Document:
    """One record as a Document (see the module docstring for the three forms)."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return chat_document(record["messages"], tokenizer, where)
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        if not record["completion"].strip():
            raise DataError(f"{where}: the completion is empty; it would teach the model to end its reply at once")
        prompt = tokenizer.encode(record["prompt"], add_special_tokens=True)
        return document([(prompt, 0), (tokenizer.encode(record["completion"]) + eos(tokenizer), 1)], where)
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return document([(tokenizer.encode(record["text"], add_special_tokens=True) + eos(tokenizer), 1)], where)
    got = f"keys {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
    raise DataError(f'{where}: expected an object with "messages" (a list), "prompt" and "completion" (strings), '
                    f'or "text" (a string); got {got}')


def eos(tokenizer) -> list[int]:
    """The end-of-sequence id that ends a text or completion (none when the tokenizer has none)."""
    return list(tokenizer.eos_token_ids[:1])


def document(pieces: list[tuple[list[int], int]], where: str) -> Document:
    """Token pieces, each counting in the loss (1) or not (0), as one Document. The first token never counts:
    nothing before it predicts it."""
    tokens = np.array([t for ids, _ in pieces for t in ids], np.int32)
    mask = np.array([counts for ids, counts in pieces for _ in ids], np.int32)
    if len(tokens):
        mask[0] = 0
    return Document(tokens, mask, where)


def chat_document(messages: list, tokenizer, where: str, *, last_only: bool = False) -> Document:
    """A conversation rendered with the chat template; the assistant turns count in the loss (the last one
    only with last_only: a preference pair's reply after its prompt conversation)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(f'{where}: messages[{i}] must be an object with a "role" and a string "content", '
                            f"got {message!r}")
        if message.get("role") not in ROLES:
            raise DataError(f"{where}: messages[{i}] has role {message.get('role')!r}; expected one of {ROLES}")
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing would be learned from it")
    for i in turns:
        if not messages[i]["content"].strip() and not messages[i].get("tool_calls"):
            raise DataError(f"{where}: messages[{i}] is an empty assistant turn; it would teach the model to end its "
                            "turn at once")
    if last_only:
        turns = turns[-1:]
    if turns[0] == 0:
        raise DataError(f"{where}: the conversation starts with an assistant turn; expected a system or user turn "
                        "before it")
    if tokenizer.chat_template is None:
        raise DataError(f"{where}: a conversation needs the model's chat template, and this tokenizer has none")
    render = tokenizer.apply_chat_template
    full = render(messages, add_generation_prompt=False)
    pieces, done = [], 0
    for i in turns:
        before = render(messages[:i], add_generation_prompt=True)
        through = render(messages[: i + 1], add_generation_prompt=False)
        if not (len(before) >= done and through.startswith(before) and full.startswith(through)):
            raise DataError(f"{where}: the chat template does not render the conversation up to messages[{i}] as a "
                            "prefix of the whole conversation, so its assistant span cannot be found")
        pieces += [(full[done:len(before)], 0), (full[len(before):len(through)], 1)]
        done = len(through)
    pieces.append((full[done:], 0))
    return document([(tokenizer.encode(text), counts) for text, counts in pieces if text], where)


def load_documents(path, tokenizer, seq_len: int, *, truncate: bool = False) -> tuple[list[Document], int]:
    """The file's records as Documents of at most seq_len tokens, and how many were truncated.

    A longer document is a DataError naming its line unless truncate=True; then it is cut to seq_len and
    counted (and a warning says how many were)."""
    return load_records(path, encode_record, tokenizer, seq_len, truncate)


def load_pairs(path, tokenizer, seq_len: int, *, truncate: bool = False) -> tuple[list[tuple[Document, Document]], int]:
    """The file's preference records (see `encode_pair`) as (chosen, rejected) Documents of at most seq_len tokens,
    and how many records were truncated; a longer one is refused or cut as `load_documents` does."""
    return load_records(path, encode_pair, tokenizer, seq_len, truncate)


def load_records(path, encode, tokenizer, seq_len: int, truncate: bool) -> tuple[list, int]:
    """Each record of the file as encode(record, tokenizer, where) gives it (a Document or a tuple of them), each
    Document fitted to seq_len (`fit`), and how many records were truncated."""
    items, truncated = [], 0
    for where, record in read_jsonl(path):
        try:
            item = encode(record, tokenizer, where)
        except DataError:
            raise
        except ValueError as error:  # the tokenizer's or the chat template's, e.g. a lone surrogate in a string
            raise DataError(f"{where}: {error}") from error
        docs = item if isinstance(item, tuple) else (item,)
        fitted = tuple(fit(doc, seq_len, truncate) for doc in docs)
        truncated += any(len(a.tokens) < len(b.tokens) for a, b in zip(fitted, docs))
        items.append(fitted if isinstance(item, tuple) else fitted[0])
    if truncated:
        warnings.warn(f"{path}: {truncated} of {len(items)} records were truncated to seq_len={seq_len}",
                      stacklevel=3)
    return items, truncated


def fit(doc: Document, seq_len: int, truncate: bool) -> Document:
    """The Document if it fits in seq_len tokens; else cut to seq_len (truncate) or a DataError naming its line.
    One with no token left that counts in the loss is a DataError."""
    if len(doc.tokens) > seq_len:
        if not truncate:
            raise DataError(f"{doc.source}: the record is {len(doc.tokens)} tokens long, longer than "
                            f"seq_len={seq_len}; raise seq_len (--seq-len), shorten it, or truncate (--truncate) and the cuts are counted")
        doc = Document(doc.tokens[:seq_len], doc.loss_mask[:seq_len], doc.source)
    if not doc.loss_mask.any():
        raise DataError(f"{doc.source}: the record has no token that counts in the loss"
                        + (" after truncation to seq_len" if len(doc.tokens) == seq_len else ""))
    return doc


def encode_pair(record, tokenizer, where: str) -> tuple[Document, Document]:
    """A preference record as its (chosen, rejected) Documents: the prompt, then the reply, which alone counts.

      {"prompt": "...", "chosen": "...", "rejected": "..."}    each reply encoded as a completion (and an EOS)
      {"messages": [...], "chosen": "...", "rejected": "..."}  each reply appended to the conversation as an
                                                               assistant turn, rendered with the chat template
    The replies differ, and the messages end before the reply (not with an assistant turn); else a DataError.
    """
    prompt = record.get("prompt") if isinstance(record, dict) else None
    messages = record.get("messages") if isinstance(record, dict) else None
    replies = isinstance(record, dict) and all(isinstance(record.get(name), str) for name in ("chosen", "rejected"))
    if not (replies and isinstance(prompt, str) != isinstance(messages, list)):
        got = f"keys {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise DataError(f'{where}: expected a preference record: "prompt" (a string) or "messages" (a list), not '
                        f'both, with "chosen" and "rejected" (strings); got {got}')
    if messages is not None and not messages:
        raise DataError(f"{where}: the messages are empty; expected the conversation the replies answer")
    if messages is not None and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        raise DataError(f'{where}: the messages end with an assistant turn; expected the conversation up to the reply, '
                        f'which "chosen" and "rejected" give')
    if record["chosen"] == record["rejected"]:
        raise DataError(f'{where}: "chosen" and "rejected" are the same reply, so the pair teaches nothing; expected '
                        f'two different replies')

    def reply(text: str) -> Document:
        if messages is None:
            return encode_record({"prompt": prompt, "completion": text}, tokenizer, where)
        return chat_document(messages + [{"role": "assistant", "content": text}], tokenizer, where, last_only=True)

    return reply(record["chosen"]), reply(record["rejected"])


def pack(documents: list[Document], seq_len: int, *, packing: bool = True) -> dict[str, np.ndarray]:
    """Documents (each at most seq_len tokens) as rows {tokens, loss_mask, segment_ids}: int32 [N, seq_len].

    packing: fill each row in order with whole documents while they fit (segment ids 1, 2, ... in the row);
    else one document per row. The rest of a row is padding: token 0, loss_mask 0, segment id 0.
    """
    rows: list[list[Document]] = []
    used = seq_len
    for doc in documents:
        if not packing or used + len(doc.tokens) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(doc)
        used += len(doc.tokens)
    out = {name: np.zeros((len(rows), seq_len), np.int32) for name in ("tokens", "loss_mask", "segment_ids")}
    for r, row in enumerate(rows):
        start = 0
        for segment, doc in enumerate(row, 1):
            end = start + len(doc.tokens)
            out["tokens"][r, start:end], out["loss_mask"][r, start:end] = doc.tokens, doc.loss_mask
            out["segment_ids"][r, start:end] = segment
            start = end
    return out


class Batches:
    """Endless batches of rows [batch_size, seq_len] over epochs. Epoch e packs the documents in the order of a
    permutation drawn from (seed, e) (in file order with shuffle=False); the rows of consecutive epochs form one
    stream. Groups of documents (preference pairs, (chosen, rejected)) are shuffled as one, each document on its
    own row (packing=False): a batch holds whole groups, consecutive rows. get_state() -> {"epoch", "row"}: the
    position of the next row; set_state(state) returns there, so a resumed run sees the same batches."""

    def __init__(self, documents: list[Document] | list[tuple[Document, ...]], batch_size: int, seq_len: int, *,
                 seed: int = 0, packing: bool = True, shuffle: bool = True):
        if not documents:
            raise DataError("no documents to make batches of")
        if isinstance(documents[0], tuple) and (packing or batch_size % len(documents[0])):
            raise ValueError(f"groups of {len(documents[0])} documents (preference pairs) go one per row, unpacked "
                             f"(packing=False), in batches of whole groups; got packing={packing}, "
                             f"batch_size={batch_size}")
        self.documents, self.batch_size, self.seq_len = documents, batch_size, seq_len
        self.seed, self.packing, self.shuffle = seed, packing, shuffle
        self.epoch, self.row = 0, 0
        self._rows: tuple[int, dict[str, np.ndarray]] | None = None

    def rows(self, epoch: int) -> dict[str, np.ndarray]:
        """The packed rows of one epoch (the last epoch's are kept)."""
        if self._rows is None or self._rows[0] != epoch:
            order = (np.random.default_rng([self.seed, epoch]).permutation(len(self.documents)) if self.shuffle
                     else np.arange(len(self.documents)))
            documents = [doc for i in order for doc in (self.documents[i] if isinstance(self.documents[i], tuple)
                                                        else (self.documents[i],))]
            self._rows = epoch, pack(documents, self.seq_len, packing=self.packing)
        return self._rows[1]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = []
        while sum(len(p["tokens"]) for p in parts) < self.batch_size:
            rows = self.rows(self.epoch)
            take = min(self.batch_size - sum(len(p["tokens"]) for p in parts), len(rows["tokens"]) - self.row)
            parts.append({name: array[self.row:self.row + take] for name, array in rows.items()})
            self.row += take
            if self.row == len(rows["tokens"]):
                self.epoch, self.row = self.epoch + 1, 0
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "row": self.row}

    def set_state(self, state: dict) -> None:
        self.epoch, self.row = int(state["epoch"]), int(state["row"])
