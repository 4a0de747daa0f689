"""``python -m train.prepare``: corpora -> one flat token file for ``data.source=tokens``.

Text files (a document each), ``.jsonl``/``.ndjson``/``.parquet`` (a document per line or row), each
gzipped too when named ``.gz`` (not Parquet) -> OUT (raw little-endian uint16/uint32 ids, every
document ended by EOS), OUT.json (the sidecar) and OUT.tokenizer.json, the same bytes for any
``--workers``, renamed into place only at the end. Exit status: 0 done; 2 a bad argument, input or
output (one line on stderr, nothing written); 130 interrupted. See docs/TRAINING.md.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import functools
import gzip
import hashlib
import itertools
import json
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np

EOS = "<|endoftext|>"
FORMAT = "jax_nvfp4.tokens"
# 2: "vocab" is the largest id + 1 (1: the token count), with "tokenizer_sha256"; 3: "documents" counts
# documents, each ending with "eos_id" (and starting with "bos_id" unless null), with "errors"/"files_replaced".
VERSION = 3
START, END = 1, 2  # a piece of text's marks: it starts a document (BOS before it), it ends one (EOS after)
CUT_CONTEXT = 256  # characters each side of a cut that the tokenizer must encode as the two sides apart
CUT_TRIES = 256  # newlines tried for a piece's cut; past them the document is encoded whole from there
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
         type(None): "null"}  # the types json.loads returns


DEFAULT_VOCAB = 4096  # the BPE trained without --tokenizer
MAX_CHUNK_MB = 1024  # a piece is held as text and as its ids, times the workers
MAX_VOCAB = 1 << 24  # about 1 GB of the BPE trainer's tables (the largest released vocabularies: ~0.26M)


class PrepareError(ValueError):
    """A bad argument or input file; the message is one line."""


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class _Reading:
    """How undecodable input is read (``errors``: strict or replace), the text key, and the files
    read with replacements."""

    def __init__(self, errors: str = "strict", text_key: str = "text"):
        if errors not in ("strict", "replace"):
            raise PrepareError(f"--errors {errors!r}: must be strict or replace")
        self.errors, self.text_key, self.replaced = errors, text_key, set()
        self.cut_ok = None  # (text, j) -> whether a cut of text at j changes no id (or no word the BPE trainer counts)

    def bad(self, path: str, place: str, what: str) -> None:
        """Undecodable input of ``path`` at ``place``: refused, or noted (to be replaced)."""
        if self.errors == "strict":
            raise PrepareError(f"{place}: {what}; pass --errors replace to read it with U+FFFD")
        self.replaced.add(path)

    def decode(self, data: bytes, path: str, place: str, base: int = 0) -> str:
        """``data`` (bytes ``base``... of ``path``; ``place`` prefixes the offset) as UTF-8."""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            self.bad(path, f"{place}byte {base + e.start}", f"invalid UTF-8 ({e.reason})")
            return data.decode("utf-8", "replace")


def _pieces(blocks, chunk: int, cut_ok) -> Iterator[tuple]:
    """One document, its text given as ``(text, bytes of the file read so far)`` blocks, as marked
    pieces, the same cut however the text is split into blocks: each piece ends after the first
    newline at or past ``chunk`` characters where ``cut_ok(window, j)`` accepts the cut at ``j`` of
    the ``CUT_CONTEXT`` characters either side (:func:`_encodes_apart`, :func:`_splits_words`);
    after ``CUT_TRIES`` refused newlines the rest of the document is one piece."""
    buf, marks, pos, start, tries = "", START, 0, chunk - 1, 0
    for text, pos in blocks:
        buf += text
        while len(buf) >= chunk and tries < CUT_TRIES:
            j = buf.find("\n", start) + 1
            if not j or j + CUT_CONTEXT > len(buf):  # its context may go on in the next block
                break
            if not cut_ok(buf[max(0, j - CUT_CONTEXT):j + CUT_CONTEXT], min(j, CUT_CONTEXT)):
                start, tries = j, tries + 1
                continue
            yield buf[:j], marks, pos
            buf, marks, start, tries = buf[j:], 0, chunk - 1, 0
    yield buf, marks | END, pos


_READ_ERRORS = (OSError, EOFError, zlib.error)  # a corrupt or truncated gzip stream too (BadGzipFile: an OSError)


@contextlib.contextmanager
def _opened(path: str) -> Iterator[tuple]:
    """``(raw, f, gz)``: ``path`` opened to read bytes, ``f`` through gzip where it is named ``.gz``."""
    gz = path.lower().endswith(".gz")
    with open(path, "rb") as raw:
        yield raw, gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw, gz


def _text_blocks(path: str, chunk: int, rd: _Reading) -> Iterator[tuple]:
    """A text file (one document; gzip when named ``.gz``) decoded incrementally: ``(text, bytes of the file
    read)``, its (uncompressed) byte offsets known."""
    dec, pos, first = codecs.getincrementaldecoder("utf-8")("strict"), 0, True
    with _opened(path) as (raw, f, gz):
        while True:
            try:
                block = f.read(chunk)
            except _READ_ERRORS as e:
                raise PrepareError(f"{path}: cannot read{' (gzip)' if gz else ''} after "
                                   f"{'uncompressed ' if gz else ''}byte {pos}: {_first_line(e)}") from None
            try:
                text = dec.decode(block, not block)
            except UnicodeDecodeError as e:  # e.object: the bytes held back from before + block
                rd.bad(path, f"{path}: {'uncompressed ' if gz else ''}byte "
                             f"{pos - (len(e.object) - len(block)) + e.start}", f"invalid UTF-8 ({e.reason})")
                dec.errors = "replace"  # the decoder kept its state: decode the block again
                text = dec.decode(block, not block)
            if first and text:  # a byte order mark, not text (as in JSON Lines), however small the blocks
                text, first = text.removeprefix("\ufeff"), False
            pos += len(block)
            yield text, raw.tell() if gz else pos
            if not block:
                return


def _jsonl_documents(path: str, rd: _Reading) -> Iterator[list]:
    """A JSON Lines file (gzip when named ``.gz``): a document per object, under the text key, as one block."""
    key, offset, lineno = rd.text_key, 0, 0
    with _opened(path) as (raw, f, gz):
        try:
            for lineno, line in enumerate(f, 1):
                start, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                s = rd.decode(line, path, f"{where}: {'uncompressed ' if gz else ''}", start)
                if lineno == 1:  # a byte order mark is not JSON
                    s = s.removeprefix("\ufeff")
                try:
                    obj = json.loads(s)
                except ValueError as e:
                    raise PrepareError(f"{where}: not JSON ({getattr(e, 'msg', e)}, column "
                                       f"{getattr(e, 'colno', '?')})") from None
                if not isinstance(obj, dict):
                    raise PrepareError(f"{where}: a JSON {_JSON[type(obj)]}, not an object with a {key!r} key")
                if key not in obj:
                    keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
                    raise PrepareError(f"{where}: no key {key!r} (its keys: {keys}); choose one with --text-key")
                text = obj[key]
                if not isinstance(text, str):
                    raise PrepareError(f"{where}: {key!r} is a JSON {_JSON[type(text)]}, not a string")
                # An escape such as \\ud800 decodes to a lone surrogate, which is not text.
                if (b"\\u" in line or b"\\U" in line) and (m := _SURROGATE.search(text)):
                    rd.bad(path, f"{where}: {key!r}", f"a lone surrogate U+{ord(m.group()):04X} (an escape that "
                                                      "is not text)")
                    text = _SURROGATE.sub("\ufffd", text)
                yield [(text, raw.tell())]
        except _READ_ERRORS as e:
            raise PrepareError(f"{path}: cannot read{' (gzip)' if gz else ''} after line {lineno}: "
                               f"{_first_line(e)}") from None


def _parquet_documents(path: str, rd: _Reading) -> Iterator[list]:
    """A Parquet file: a document per row of the string column under the text key, as one block."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{path}: reading Parquet needs pyarrow (pip install 'jax_nvfp4[train]')") from None
    key = rd.text_key
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own types
        raise PrepareError(f"{path}: not a readable Parquet file: {_first_line(e)}") from None
    schema = pf.schema_arrow
    if key not in schema.names:
        cols = ", ".join(repr(c) for c in schema.names[:8]) or "none"
        raise PrepareError(f"{path}: no column {key!r} (its columns: {cols}); choose one with --text-key")
    typ = schema.field(key).type
    value = typ.value_type if pa.types.is_dictionary(typ) else typ  # a categorical column: its dictionary's values
    if value not in (pa.string(), pa.large_string(), pa.string_view(), pa.binary(), pa.large_binary(),
                     pa.binary_view()):
        raise PrepareError(f"{path}: column {key!r} is {typ}, not a string column")
    rows, size, row = max(1, pf.metadata.num_rows), os.path.getsize(path), 0
    try:
        for batch in pf.iter_batches(batch_size=256, columns=[key], use_threads=False):
            # As bytes, decoded here: an undecodable string is named by its byte offset.
            for v in batch.column(0).cast(pa.large_binary()).to_pylist():
                row += 1
                if v is None:
                    raise PrepareError(f"{path}: row {row}: {key!r} is null")
                yield [(rd.decode(v, path, f"{path}: row {row}: "), size * row // rows)]
    except PrepareError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file, pyarrow's own types
        raise PrepareError(f"{path}: cannot read after row {row}: {_first_line(e)}") from None


def _documents(path: str, chunk: int, rd: _Reading) -> Iterator[tuple]:
    """``(text, START|END marks, bytes of the file read so far)``: ``path``'s documents in pieces, in order."""
    low = path.lower()
    if low.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")):
        documents = _jsonl_documents(path, rd)
    elif low.endswith(".parquet"):
        documents = _parquet_documents(path, rd)
    else:
        documents = [_text_blocks(path, chunk, rd)]
    try:
        for blocks in documents:
            yield from _pieces(blocks, chunk, rd.cut_ok)
    except OSError as e:
        raise PrepareError(f"{path}: cannot read: {e.strerror or _first_line(e)}") from None


def load_tokenizer(spec: str):
    """``(Tokenizer, config)`` of a ``tokenizer.json`` or a Hugging Face tokenizer folder; ``config``:
    the folder's ``special_tokens_map.json`` updated by its ``tokenizer_config.json`` (empty for a file)."""
    from tokenizers import Tokenizer
    config, file = {}, spec
    if os.path.isdir(spec):
        file = os.path.join(spec, "tokenizer.json")
        if not os.path.isfile(file):
            raise PrepareError(f"--tokenizer {spec!r}: a folder without tokenizer.json")
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if not os.path.isfile(path := os.path.join(spec, name)):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    d = json.load(f)
            except (OSError, ValueError) as e:
                raise PrepareError(f"--tokenizer {spec!r}: cannot read {name}: {_first_line(e)}") from None
            if not isinstance(d, dict):
                raise PrepareError(f"--tokenizer {spec!r}: {name} is not a JSON object")
            config.update(d)
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
        raise PrepareError(f"--tokenizer {spec!r}: cannot load: {_first_line(e)}") from None
    return tok, config


def special_ids(tok, config: dict, eos: str | None = None) -> tuple[int | None, int]:
    """``(bos_id or None, eos_id)``. EOS: ``eos``, else the config's ``eos_token``, else ``<|endoftext|>``
    (none of them: refused). BOS: the config's ``bos_token`` where its ``add_bos_token`` says so or,
    not said, where the tokenizer's post-processor prepends it; without a ``bos_token``, the token the
    post-processor prepends, unless ``add_bos_token`` is false."""

    def token(name):
        v = config.get(name)
        v = v.get("content") if isinstance(v, dict) else v
        if v is not None and not isinstance(v, str):
            raise PrepareError(f"tokenizer_config.json {name}: {v!r} is not a token")
        return v

    def id_of(t, what):
        if (i := tok.token_to_id(t)) is None:
            raise PrepareError(f"{what} {t!r}: not a token of the tokenizer")
        return i

    if eos is not None:
        eos_id = id_of(eos, "--eos")
    elif token("eos_token") is not None:
        eos_id = id_of(token("eos_token"), "tokenizer_config.json eos_token")
    elif (eos_id := tok.token_to_id(EOS)) is None:
        raise PrepareError(f"no end-of-document token: the tokenizer has no {EOS} and no tokenizer_config.json "
                           "eos_token; pass --eos TOKEN (one of its tokens)")
    def prepended():  # the id the post-processor puts before a text (a Llama 2 style "<s> $A"), if any
        try:
            plain, special = (tok.encode("a", add_special_tokens=s).ids for s in (False, True))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode the probe adds nothing
            return None
        return special[0] if len(special) > len(plain) and special[1:1 + len(plain)] == plain else None

    bos, add = token("bos_token"), config.get("add_bos_token")
    if bos is None:
        if add:
            raise PrepareError("tokenizer_config.json: add_bos_token is true but there is no bos_token")
        return (prepended() if add is None else None), eos_id
    bos_id = id_of(bos, "tokenizer_config.json bos_token")
    return (bos_id if (prepended() == bos_id if add is None else add) else None), eos_id


def _encode_tasks(tasks, state: dict) -> list[bytes]:
    """The tokens of each of ``tasks`` (pieces of text and their marks), BOS/EOS added, as bytes. Several tasks are
    encoded together by the tokenizer's own threads (``encode_batch``), one in this thread."""
    texts = [text for texts, _ in tasks for text in texts]
    tok = state["tok"]
    if len(tasks) > 1:
        encoded = iter(tok.encode_batch(texts, add_special_tokens=False))
    else:
        encoded = (tok.encode(text, add_special_tokens=False) for text in texts)
    out = []
    for texts, marks in tasks:
        ids: list[int] = []
        for m in marks:
            if m & START and state["bos"] is not None:
                ids.append(state["bos"])
            ids += next(encoded).ids
            if m & END:
                ids.append(state["eos"])
        out.append(np.asarray(ids, state["dtype"]).tobytes())
    return out


def _tasks(paths: Sequence[str], chunk: int, rd: _Reading):
    """``((texts, marks), documents it ends, input bytes read after it)``: about ``chunk`` characters
    of pieces each, in order (the same cut for any number of workers)."""
    base = size = docs = 0
    texts, marks = [], []
    for p in paths:
        for text, m, pos in _documents(p, chunk, rd):
            texts.append(text)
            marks.append(m)
            size += len(text)
            docs += bool(m & END)
            if size >= chunk:
                yield (texts, marks), docs, base + pos
                texts, marks, size, docs = [], [], 0, 0
        base += os.path.getsize(p)
    if texts:
        yield (texts, marks), docs, base


def _encode_all(paths, chunk, rd, state, workers, f, bar) -> tuple[int, int]:
    """Encode ``paths`` into the open file ``f`` in order; ``(tokens, documents)``. With more than one
    worker, ``workers`` tasks at a time are encoded by the tokenizer's threads, on a thread of this
    process while the next ones are read (bounded memory)."""
    itemsize, t0 = state["dtype"].itemsize, time.monotonic()
    n = docs = 0

    def write(group, results) -> None:
        nonlocal n, docs
        for (_, d, pos), data in zip(group, results):
            f.write(data)
            n += len(data) // itemsize
            docs += d
            el = max(time.monotonic() - t0, 1e-9)
            bar.set_postfix_str(f"{docs:,} docs, {docs / el:,.0f} docs/s, {n / el:,.0f} tok/s", refresh=False)
            bar.update(pos - bar.n)  # redraws at most every 0.1 s

    tasks = _tasks(paths, chunk, rd)
    groups = iter(lambda: list(itertools.islice(tasks, workers)), [])
    if workers == 1:  # one by one in this thread
        for group in groups:
            write(group, _encode_tasks([task for task, _, _ in group], state))
        return n, docs
    pool, pending = ThreadPoolExecutor(1), None  # the group being encoded and its future
    try:
        for group in groups:
            future = pool.submit(_encode_tasks, [task for task, _, _ in group], state)
            if pending:
                write(pending[0], pending[1].result())
            pending = group, future
        if pending:
            write(pending[0], pending[1].result())
    finally:
        pool.shutdown(cancel_futures=True)  # after a failure the group being encoded finishes, none starts
    return n, docs


def prepare(paths: Sequence[str], out: str, *, tokenizer: str | None = None, vocab_size: int | None = None,
            chunk_mb: float = 1.0, eos: str | None = None, text_key: str = "text", errors: str = "strict",
            workers: int | None = None, progress: bool = False) -> dict:
    """Tokenize ``paths`` into ``out``, ``out.json`` and ``out.tokenizer.json``; returns the sidecar.
    Raises :class:`PrepareError` for a bad input or output (before writing, where it can tell); on any
    failure only what this call wrote is removed, and nothing appears under the final names."""
    if not paths:
        raise PrepareError("no input files")
    if not isinstance(chunk_mb, (int, float)) or not math.isfinite(chunk_mb) or not 0 < chunk_mb <= MAX_CHUNK_MB:
        raise PrepareError(f"--chunk-mb {chunk_mb}: must be a positive number of MiB, at most {MAX_CHUNK_MB}")
    if workers is None:  # the CPUs this process may use
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not isinstance(workers, int) or workers < 1:
        raise PrepareError(f"--workers {workers}: must be >= 1")
    if not text_key:
        raise PrepareError("--text-key: must not be empty")
    rd = _Reading(errors, text_key)
    for p in paths:
        if not os.path.isfile(p):
            raise PrepareError(f"input {p!r}: not a regular file")
        if not os.access(p, os.R_OK):
            raise PrepareError(f"input {p!r}: not readable")
    finals = [out, out + ".json", out + ".tokenizer.json"]
    for path in finals:
        if os.path.lexists(path):
            raise PrepareError(f"--out {out!r}: {path} exists; choose a new name (prepare never replaces a file)")
    chunk = max(1, int(chunk_mb * (1 << 20)))
    if tokenizer and vocab_size is not None:
        raise PrepareError(f"--vocab-size {vocab_size}: sizes the BPE trained without --tokenizer; --tokenizer "
                           f"{tokenizer} brings its own vocabulary: give one of them")
    if tokenizer:
        tok, config = load_tokenizer(tokenizer)
        saved, bos_id, eos_id = _for_encoding(tok, config, eos)
    elif not 257 <= (vocab_size := DEFAULT_VOCAB if vocab_size is None else vocab_size) <= MAX_VOCAB:
        raise PrepareError(f"--vocab-size {vocab_size}: must be >= 257 (256 bytes + end-of-text) and <= {MAX_VOCAB} "
                           "(the BPE trainer allocates its tables for the whole vocabulary up front)")
    parent = os.path.dirname(os.path.abspath(out))
    written: list[str] = []  # what this call created, newest first: removed on a failure (folders last)
    temps: list[str] = []
    try:
        missing, d = [], parent
        while not os.path.exists(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            os.mkdir(d)
            written.insert(0, d)
        # Temporary names nobody else uses, next to the final ones (a link stays within one file
        # system); creating them also proves the folder writable before a tokenizer is trained.
        for final in finals:
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(final)}.", suffix=".tmp", dir=parent)
            os.close(fd)
            written.insert(0, tmp)
            temps.append(tmp)
            os.chmod(tmp, 0o644)
        if not tokenizer:  # byte-level BPE, every byte in its alphabet (any text encodes); no downloads
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
            trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos or EOS], show_progress=False,
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
            rd.cut_ok = functools.partial(_splits_words, tok.pre_tokenizer)  # rd.replaced (a set) names a file once
            _interruptible(tok.train_from_iterator, (t for p in paths for t, _, _ in _documents(p, chunk, rd)),
                           trainer=trainer)
            saved, bos_id, eos_id = _for_encoding(tok, {}, eos)
        # The largest id + 1, not the token count: ids may have gaps, and the embedding needs a row for the largest.
        vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
        state = {"tok": tok, "bos": bos_id, "eos": eos_id, "dtype": dtype}
        rd.cut_ok = functools.partial(_encodes_apart, _untrimmed(tok))
        from tqdm import tqdm
        bar = tqdm(total=sum(os.path.getsize(p) for p in paths), unit="B", unit_scale=True, unit_divisor=1024,
                   desc="tokenizing", file=sys.stderr, leave=False, dynamic_ncols=True,
                   disable=None if progress else True)  # None: only on a terminal
        with open(temps[0], "wb") as f, bar:
            n, docs = _encode_all(paths, chunk, rd, state, workers, f, bar)
        if n < 2:
            raise PrepareError(f"the inputs hold {n} token(s); need at least 2")
        tok_bytes = saved.encode()
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab": int(vocab), "tokens": n,
                "documents": docs, "bos_id": bos_id, "eos_id": eos_id, "tokenizer": os.path.basename(finals[2]),
                "tokenizer_sha256": tokenizer_sha256(saved),
                "inputs": [os.path.abspath(p) for p in paths], "errors": errors, "files_replaced": len(rd.replaced)}
        for tmp, data in ((temps[2], tok_bytes), (temps[1], json.dumps(meta, indent=1).encode())):
            with open(tmp, "wb") as g:
                g.write(data)
        # Into place only where the name is still free (a link fails where a rename would replace),
        # the sidecar last: a sidecar is only ever seen with its token file.
        for i in (2, 0, 1):
            _publish(temps[i], finals[i])
            written.insert(0, finals[i])
        _remove(temps)
    except BaseException as e:
        _remove(written)
        if isinstance(e, FileExistsError):
            raise PrepareError(f"--out {out!r}: {e.filename} appeared while preparing; nothing of it replaced, "
                               "nothing written") from None
        if isinstance(e, OSError):
            raise PrepareError(f"--out {out!r}: cannot write in {parent}: {e.strerror or e}; nothing written") from None
        raise
    return meta


def tokenizer_sha256(text: str) -> str:
    """A sidecar's ``tokenizer_sha256``: the sha256 of a tokenizer's JSON as ``Tokenizer.to_str(pretty=True)`` writes
    it (``OUT.tokenizer.json``'s bytes)."""
    return hashlib.sha256(text.encode()).hexdigest()


def _for_encoding(tok, config: dict, eos: str | None) -> tuple[str, int | None, int]:
    """``(the tokenizer's JSON, for OUT.tokenizer.json, bos_id, eos_id)``; then ``tok`` has no truncation
    or padding (a tokenizer.json may carry them for serving): pieces are encoded whole; and it reads a
    special token's text in a document as text (``<|endoftext|>`` in a source file is not a document end),
    BOS's and EOS's included."""
    saved = tok.to_str(pretty=True)
    tok.no_truncation()
    tok.no_padding()
    ids = special_ids(tok, config, eos)
    from tokenizers import AddedToken
    # BOS and EOS are special here even where the tokenizer added them as plain tokens: their text inside a
    # document is text, never a document's end.
    tok.add_special_tokens([AddedToken(tok.id_to_token(i), special=True) for i in ids
                            if i is not None and i in tok.get_added_tokens_decoder()])
    tok.encode_special_tokens = True
    return (saved, *ids)


def _encodes_apart(tok, text: str, j: int) -> bool:
    """Whether ``tok`` encodes ``text[:j]`` and ``text[j:]`` one after the other as it encodes ``text``, ``j``
    falling between two of its words (pre-tokens, each of which its model encodes alone), neither of which
    touches an end of ``text``: a word's ids depend on all of it, and one reaching the window's edge may go on
    past it (300 spaces before a newline: ``\\s+(?!\\S)`` makes them one word with it at the end of a piece).
    A tokenizer that keeps the text one word (no pre-tokenizer, Metaspace without split) has no such cut."""
    whole = tok.encode(text, add_special_tokens=False)
    span = {}  # word -> (its first character, past its last)
    for word, (a, b) in zip(whole.word_ids, whole.offsets):
        if a < j < b:
            return False
        if a < b:
            first, last = span.get(word, (a, b))
            span[word] = (min(first, a), max(last, b))
    left = max((w for w, (_, b) in span.items() if b <= j), key=lambda w: span[w][1], default=None)
    right = min((w for w, (a, _) in span.items() if a >= j), key=lambda w: span[w][0], default=None)
    if left is None or right is None or left == right or span[left][0] == 0 or span[right][1] == len(text):
        return False
    if tok.pre_tokenizer is not None and not _splits_words(tok.pre_tokenizer, text, j, content=False):
        return False  # the words themselves change (a whitespace run joins the newline at a piece's end)
    ids = lambda s: tok.encode(s, add_special_tokens=False).ids
    return whole.ids == ids(text[:j]) + ids(text[j:])


def _untrimmed(tok):
    """A copy of ``tok`` without its post-processor: the same ids without special tokens, and offsets that cover every
    character (a ByteLevel post-processor's ``trim_offsets`` gives whitespace tokens none)."""
    from tokenizers import Tokenizer
    copy = Tokenizer.from_str(tok.to_str())
    copy.post_processor = None
    copy.encode_special_tokens = tok.encode_special_tokens
    return copy


def _splits_words(pre_tokenizer, text: str, j: int, content: bool = True) -> bool:
    """Whether ``pre_tokenizer`` splits ``text[:j]`` and ``text[j:]`` into the words it makes of ``text`` (their
    spans; ``content``: their text too, as a Metaspace prefix changes it), the words either side of ``j`` not
    touching an end of ``text`` (see :func:`_encodes_apart`): the BPE trainer counts the same words in pieces
    cut there as in the whole document, and a tokenizer encodes the same words."""
    words = pre_tokenizer.pre_tokenize_str(text)
    before = [(w, span) for w, span in words if span[1] <= j]
    after = [(w, (a - j, b - j)) for w, (a, b) in words if a >= j]
    if len(before) + len(after) != len(words) or not before or not after or before[-1][1][0] == 0 \
            or after[0][1][1] == len(text) - j:
        return False
    key = (lambda ws: [(w, tuple(span)) for w, span in ws]) if content else (lambda ws: [tuple(s) for _, s in ws])
    return (key(pre_tokenizer.pre_tokenize_str(text[:j])) == key(before)
            and key(pre_tokenizer.pre_tokenize_str(text[j:])) == key(after))


def _interruptible(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread of its own, its exception raised here: the BPE trainer holds no
    lock the main thread needs, which stays free to take Ctrl-C or SIGTERM at once (a long word keeps the
    trainer busy for minutes; the process ends with the thread)."""
    done = {}

    def run():
        try:
            done["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            done["error"] = e

    thread = threading.Thread(target=run, name="prepare-bpe", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if "error" in done:
        raise done["error"]
    return done.get("value")


def _publish(tmp: str, final: str) -> None:
    """Give ``tmp`` the name ``final``, which must not exist (never replaces a file)."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: check, then rename
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), final) from None
        os.rename(tmp, final)


def _remove(paths: Sequence[str]) -> None:
    """Remove the files and (empty) folders ``paths``, in order, as far as possible."""
    for path in paths:
        try:
            os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        except OSError:
            pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.prepare", description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="text files (one document each), .jsonl/.ndjson (.gz too) or .parquet "
                                             "(a document per line or row)")
    p.add_argument("--out", required=True, help="the token file to write (its sidecar is OUT.json)")
    p.add_argument("--tokenizer", help="a tokenizer.json or Hugging Face tokenizer folder (default: train a BPE)")
    p.add_argument("--eos", help="the end-of-document token (default: the tokenizer's eos_token, or <|endoftext|>)")
    p.add_argument("--text-key", default="text", help="the JSON key or Parquet column of the text (default: text)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="undecodable input: refuse (strict, default) or read it with U+FFFD (replace)")
    p.add_argument("--workers", type=int, default=None, help="pieces encoded at a time, and the tokenizer's threads "
                   "(RAYON_NUM_THREADS unless set); 1: one by one in this thread (default: the CPU count)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"size of the BPE trained without --tokenizer (default: {DEFAULT_VOCAB})")
    p.add_argument("--chunk-mb", type=float, default=1.0,
                   help=f"text encoded per piece, in MiB (> 0, at most {MAX_CHUNK_MB})")
    args = p.parse_args(argv)
    if args.workers is not None and args.workers >= 1:  # the tokenizer's thread pool, sized at its first use
        os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))
    t0 = time.monotonic()
    in_main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main_thread else None  # like Ctrl-C
    try:
        meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       chunk_mb=args.chunk_mb, eos=args.eos, text_key=args.text_key, errors=args.errors,
                       workers=args.workers, progress=not args.no_progress)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted; nothing written to {args.out}", file=sys.stderr)
        return 130
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    el = max(time.monotonic() - t0, 1e-9)
    if args.errors == "replace":
        print(f"notice: --errors replace: undecodable input read as U+FFFD in {meta['files_replaced']} of "
              f"{len(args.inputs)} file(s)", file=sys.stderr)
    print(f"{args.out}: {meta['tokens']:,} tokens ({meta['dtype']}, vocab {meta['vocab']} = largest id + 1) from "
          f"{meta['documents']:,} document(s) in {len(args.inputs)} file(s), {el:.1f} s ({meta['documents'] / el:,.0f} "
          f"docs/s, {meta['tokens'] / el:,.0f} tokens/s); set data.source=tokens data.path={args.out} "
          f"model.vocab>={meta['vocab']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
