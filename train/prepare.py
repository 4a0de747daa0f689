"""``python -m train.prepare``: corpora -> one flat token file for ``data.source=tokens``.

Examples::

    python -m train.prepare docs/*.txt --out data/corpus.bin --vocab-size 4096   # trains a BPE
    python -m train.prepare shards/*.jsonl.gz --out data/corpus.bin --tokenizer models/llama
    python -m train.prepare data/*.parquet --text-key content --out data/corpus.bin --tokenizer tokenizer.json

Inputs, by name:

- ``*.jsonl``, ``*.jsonl.gz``: one JSON object per line, a document each, its text under
  ``--text-key`` (default ``text``); blank lines are skipped, any other line that is not such an
  object is an error naming ``FILE:LINE``;
- ``*.parquet``: a document per row of the string column ``--text-key``, read a batch of rows at
  a time;
- anything else: plain UTF-8 text, the whole file one document.

Undecodable input (invalid UTF-8, or a JSON escape of a lone surrogate) is an error naming the
file and the byte offset; ``--errors replace`` reads it with U+FFFD instead and says in how many
files it did.

The tokenizer: ``--tokenizer`` is a ``tokenizer.json`` or a Hugging Face tokenizer folder
(``tokenizer.json``, with ``tokenizer_config.json`` and/or ``special_tokens_map.json``); without
it a byte-level BPE of ``--vocab-size`` tokens is trained on the inputs with Hugging Face
``tokenizers`` (no downloads). Every document ends with the end-of-document token: ``--eos``,
else the folder's ``eos_token``, else ``<|endoftext|>`` when the vocabulary has it; with none
of these ``prepare`` refuses. A document starts with the folder's ``bos_token`` when its
``add_bos_token`` says so, or, where that is not given, when the tokenizer itself prepends that
token (its post-processor). ``add_eos_token: false`` does not remove the end token: in a token
file it is what separates documents.

Writes, next to each other:

- ``OUT``: the tokens, little-endian ``uint16`` when the vocabulary fits (<= 65536), else
  ``uint32``; no header, so ``np.memmap(OUT, dtype)`` is the whole reader;
- ``OUT.json``: the sidecar ``{"format": "jax_nvfp4.tokens", "version": 3, "dtype", "vocab",
  "tokens", "documents", "bos_id", "eos_id", "tokenizer", "tokenizer_sha256", "inputs",
  "errors", "files_replaced"}``; ``vocab`` is the tokenizer's largest id + 1 (ids may have gaps:
  a model needs ``model.vocab >= vocab``), ``bos_id`` is null where documents get no BOS, and
  ``tokenizer_sha256`` the hash of ``OUT.tokenizer.json`` (a validation file must come from the
  same tokenizer);
- ``OUT.tokenizer.json``: the tokenizer used (a copy of ``--tokenizer``'s, or the trained one),
  so a model trained on the file can be served with it (``--export-hf`` copies it).

Text is cut into pieces of about ``--chunk-mb`` after a newline (a document longer than that is
encoded piece by piece, the same for a text file and a JSON document), and pieces are encoded
by ``--workers`` processes: memory stays bounded for any corpus size, and the output is the
same bytes for any number of workers. A progress bar (documents/s, tokens/s) shows on a
terminal unless ``--no-progress``.

None of the three outputs may exist: ``prepare`` refuses before it writes anything. It writes
to temporary names in OUT's folder and renames them at the end (the sidecar last), so a failure
or an interruption leaves nothing under the final names; it removes only what it wrote itself.

Exit status: 0 done; 2 a bad argument, input or output location (one line on stderr, nothing
written); 130 interrupted (nothing written).
"""

from __future__ import annotations

import argparse
import codecs
import collections
import errno
import gzip
import hashlib
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
import zlib
from typing import Iterator, List, Sequence, Tuple

import numpy as np

EOS = "<|endoftext|>"
FORMAT = "jax_nvfp4.tokens"
# 1: "vocab" was the tokenizer's token count; 2: its largest id + 1, and the tokenizer's sha256;
# 3: "documents" counts documents (not files), each ends with "eos_id" (and starts with "bos_id"
# unless null), and "errors"/"files_replaced" say how undecodable input was read.
VERSION = 3

# A piece of text's marks: it starts a document (BOS goes before it), it ends one (EOS after).
START, END = 1, 2
# A document piece ends after the first newline past --chunk-mb; a text with no newline there is
# cut at this many chunks.
MAX_PIECE_CHUNKS = 8
_SURROGATE = re.compile("[\ud800-\udfff]")

Segment = Tuple[str, int, int]  # text, START|END marks, bytes of the file read so far


class PrepareError(ValueError):
    """A bad argument or input file; the message is one line."""


def input_kind(path: str) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"``, by the file's name."""
    low = path.lower()
    if low.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if low.endswith(".parquet"):
        return "parquet"
    return "text"


class _Reading:
    """How undecodable input is read (``errors``: strict or replace), the text key, and the
    files read with replacements."""

    def __init__(self, errors: str = "strict", text_key: str = "text"):
        if errors not in ("strict", "replace"):
            raise PrepareError(f"--errors {errors!r}: must be strict or replace")
        self.errors, self.text_key, self.replaced = errors, text_key, set()

    def bad(self, path: str, place: str, what: str) -> None:
        """Undecodable input of ``path`` at ``place``: refused, or noted (to be replaced)."""
        if self.errors == "strict":
            raise PrepareError(f"{place}: {what}; pass --errors replace to read it with U+FFFD")
        self.replaced.add(path)

    def decode(self, data: bytes, path: str, place: str, base: int = 0) -> str:
        """``data`` (bytes ``base``... of ``path``; ``place`` names where) as UTF-8."""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            self.bad(path, f"{place}byte {base + e.start}", f"invalid UTF-8 ({e.reason})")
            return data.decode("utf-8", "replace")

    def text(self, s: str, path: str, place: str) -> str:
        """``s`` without lone surrogates (JSON escapes such as ``\\ud800`` decode to them)."""
        m = _SURROGATE.search(s)
        if m is None:
            return s
        self.bad(path, place, f"a lone surrogate U+{ord(m.group()):04X} (an escape that is not text)")
        return _SURROGATE.sub("\ufffd", s)


def _cut(buf: str, chunk: int) -> int | None:
    """Where the first piece of ``buf`` ends: after the first newline at or past ``chunk``
    characters, or at ``MAX_PIECE_CHUNKS`` chunks without one; None if ``buf`` may go on."""
    if len(buf) < chunk:
        return None
    j = buf.find("\n", chunk - 1, MAX_PIECE_CHUNKS * chunk)
    if j >= 0:
        return j + 1
    return MAX_PIECE_CHUNKS * chunk if len(buf) >= MAX_PIECE_CHUNKS * chunk else None


def _pieces(text: str, chunk: int, pos: int) -> Iterator[Segment]:
    """One document ``text`` in pieces (:func:`_cut`), marked."""
    marks = START
    while (j := _cut(text, chunk)) is not None and j < len(text):
        yield text[:j], marks, pos
        text, marks = text[j:], 0
    yield text, marks | END, pos


def _text_segments(path: str, chunk: int, rd: _Reading) -> Iterator[Segment]:
    """A text file, one document, decoded incrementally (its byte offsets known)."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    buf, marks, pos = "", START, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            final = not block
            try:
                text = dec.decode(block, final)
            except UnicodeDecodeError as e:  # e.object: the bytes held back from before + block
                rd.bad(path, f"{path}: byte {pos - (len(e.object) - len(block)) + e.start}",
                       f"invalid UTF-8 ({e.reason})")
                dec.errors = "replace"  # the decoder kept its state: decode the block again
                text = dec.decode(block, final)
            pos += len(block)
            buf += text
            while (j := _cut(buf, chunk)) is not None:
                yield buf[:j], marks, pos
                buf, marks = buf[j:], 0
            if final:
                break
    yield buf, marks | END, pos


def _jsonl_segments(path: str, chunk: int, rd: _Reading) -> Iterator[Segment]:
    """A JSON Lines file (gzip when named ``.gz``): a document per object, under the text key."""
    key, gz = rd.text_key, path.lower().endswith(".gz")
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
        offset, lineno = 0, 0
        try:
            for line in f:
                lineno += 1
                start, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                s = rd.decode(line, path, f"{where}: ", start)
                if lineno == 1 and s.startswith("\ufeff"):  # a byte order mark
                    s = s[1:]
                try:
                    obj = json.loads(s)
                except ValueError as e:
                    raise PrepareError(f"{where}: not JSON ({getattr(e, 'msg', e)}, column "
                                       f"{getattr(e, 'colno', '?')})") from None
                if not isinstance(obj, dict):
                    raise PrepareError(f"{where}: a JSON {_json_type(obj)}, not an object with a {key!r} key")
                if key not in obj:
                    keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
                    raise PrepareError(f"{where}: no key {key!r} (its keys: {keys}); choose one with --text-key")
                text = obj[key]
                if not isinstance(text, str):
                    raise PrepareError(f"{where}: {key!r} is a JSON {_json_type(text)}, not a string")
                if b"\\u" in line or b"\\U" in line:
                    text = rd.text(text, path, f"{where}: {key!r}")
                yield from _pieces(text, chunk, raw.tell())
        except (OSError, EOFError, zlib.error) as e:  # a corrupt or truncated gzip stream
            raise PrepareError(f"{path}: cannot read{' (gzip)' if gz else ''} after line {lineno}: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _json_type(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _parquet_segments(path: str, chunk: int, rd: _Reading) -> Iterator[Segment]:
    """A Parquet file: a document per row of the string column ``text_key``, read in batches
    of rows (within one row group at a time)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{path}: reading Parquet needs pyarrow (pip install 'jax_nvfp4[train]')") from None
    key = rd.text_key
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own types
        raise PrepareError(f"{path}: not a readable Parquet file: {str(e).splitlines()[0] if str(e) else e}") from None
    schema = pf.schema_arrow
    if key not in schema.names:
        cols = ", ".join(repr(c) for c in schema.names[:8]) or "none"
        raise PrepareError(f"{path}: no column {key!r} (its columns: {cols}); choose one with --text-key")
    typ = schema.field(key).type
    views = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}
    if hasattr(pa, "string_view"):
        views[pa.string_view()] = pa.binary_view()
    binary = {pa.binary(), pa.large_binary()} | ({pa.binary_view()} if hasattr(pa, "binary_view") else set())
    if typ not in views and typ not in binary:
        raise PrepareError(f"{path}: column {key!r} is {typ}, not a string column")
    rows, size, row = max(1, pf.metadata.num_rows), os.path.getsize(path), 0
    try:
        batches = pf.iter_batches(batch_size=256, columns=[key], use_threads=False)
        for batch in batches:
            col = batch.column(0)
            values = (col.view(views[typ]) if typ in views else col).to_pylist()  # bytes: offsets known
            for v in values:
                row += 1
                if v is None:
                    raise PrepareError(f"{path}: row {row}: {key!r} is null")
                yield from _pieces(rd.decode(v, path, f"{path}: row {row}: "), chunk, size * row // rows)
    except PrepareError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file, pyarrow's own types
        raise PrepareError(f"{path}: cannot read after row {row}: {str(e).splitlines()[0] if str(e) else e}") from None


def _documents(path: str, chunk: int, rd: _Reading) -> Iterator[Segment]:
    """The marked pieces of text of ``path``'s documents, in order."""
    reader = {"jsonl": _jsonl_segments, "parquet": _parquet_segments}.get(input_kind(path), _text_segments)
    try:
        yield from reader(path, chunk, rd)
    except OSError as e:
        raise PrepareError(f"{path}: cannot read: {e.strerror or _first_line(e)}") from None


def _texts(paths: Sequence[str], chunk: int, rd: _Reading) -> Iterator[str]:
    for p in paths:
        for text, _, _ in _documents(p, chunk, rd):
            yield text


def train_bpe(paths: Sequence[str], vocab_size: int, chunk_bytes: int = 1 << 20, *, eos: str = EOS,
              reading: _Reading | None = None):
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenization, every byte in the base
    alphabet, so any text encodes) of ``vocab_size`` tokens including ``eos``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(paths, chunk_bytes, reading or _Reading()), trainer=trainer)
    return tok


def outputs(out: str) -> List[str]:
    """The files ``prepare`` writes for ``out``: the tokens, the sidecar, the tokenizer."""
    return [out, out + ".json", out + ".tokenizer.json"]


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def load_tokenizer(spec: str):
    """``(Tokenizer, config)`` of a ``tokenizer.json`` or a Hugging Face tokenizer folder;
    ``config``: the folder's ``special_tokens_map.json`` updated by its ``tokenizer_config.json``
    (empty for a file)."""
    from tokenizers import Tokenizer

    config: dict = {}
    file = spec
    if os.path.isdir(spec):
        file = os.path.join(spec, "tokenizer.json")
        if not os.path.isfile(file):
            raise PrepareError(f"--tokenizer {spec!r}: a folder without tokenizer.json")
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            path = os.path.join(spec, name)
            if not os.path.isfile(path):
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


def special_ids(tok, config: dict, eos: str | None = None) -> Tuple[int | None, int]:
    """``(bos_id or None, eos_id)``: the tokens put before and after every document (module
    docstring); raises :class:`PrepareError` when no end-of-document token is known."""

    def token(name):
        v = config.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if v is not None and not isinstance(v, str):
            raise PrepareError(f"tokenizer_config.json {name}: {v!r} is not a token")
        return v

    def id_of(t, what):
        i = tok.token_to_id(t)
        if i is None:
            raise PrepareError(f"{what} {t!r}: not a token of the tokenizer")
        return i

    if eos is not None:
        eos_id = id_of(eos, "--eos")
    elif token("eos_token") is not None:
        eos_id = id_of(token("eos_token"), "tokenizer_config.json eos_token")
    elif tok.token_to_id(EOS) is not None:
        eos_id = tok.token_to_id(EOS)
    else:
        raise PrepareError(f"no end-of-document token: the tokenizer has no {EOS} and no tokenizer_config.json "
                           "eos_token; pass --eos TOKEN (one of its tokens)")
    bos, add = token("bos_token"), config.get("add_bos_token")
    if bos is None:
        if add:
            raise PrepareError("tokenizer_config.json: add_bos_token is true but there is no bos_token")
        return None, eos_id
    bos_id = id_of(bos, "tokenizer_config.json bos_token")
    if add is None:  # not said: what the tokenizer's own post-processor does
        try:
            plain, special = (tok.encode("a", add_special_tokens=s).ids for s in (False, True))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode the probe adds nothing
            plain = special = []
        add = special[:1] == [bos_id] and special[1:1 + len(plain)] == plain
    return (bos_id if add else None), eos_id


# ----------------------------------------------------------------------------- encoding
_STATE: dict = {}  # a worker process's tokenizer and special ids


def _init_worker(tok_json: str, bos_id, eos_id, dtype: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    from tokenizers import Tokenizer

    _STATE.update(tok=Tokenizer.from_str(tok_json), bos=bos_id, eos=eos_id, dtype=np.dtype(dtype))


def _encode_task(task, state: dict) -> bytes:
    """The tokens of ``task`` (pieces of text and their marks), BOS/EOS added, as bytes."""
    texts, marks = task
    tok, bos, eos = state["tok"], state["bos"], state["eos"]
    ids: List[int] = []
    for text, m in zip(texts, marks):
        if m & START and bos is not None:
            ids.append(bos)
        ids += tok.encode(text, add_special_tokens=False).ids
        if m & END:
            ids.append(eos)
    return np.asarray(ids, state["dtype"]).tobytes()


def _pool_encode(task) -> bytes:
    return _encode_task(task, _STATE)


def _tasks(paths: Sequence[str], chunk: int, rd: _Reading):
    """``(task, documents it ends, input bytes read after it)``: pieces of about ``chunk``
    characters in all, in order (the same cut for any number of workers)."""
    base = 0
    texts: List[str] = []
    marks: List[int] = []
    size = docs = 0
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


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _pool(workers: int, initargs):
    """A process pool of ``workers``, or None where its processes could not start."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # The workers import the caller's main module: one read from stdin cannot be.
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.isfile(main_file):
        return None
    # Not fork: the caller may hold threads (JAX, tokenizers' own pool). A fork server that has
    # imported the heavy modules starts each worker in milliseconds (not this one: a worker of
    # ``python -m train.prepare`` runs it as its main module, which must not be imported yet).
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["numpy", "tokenizers", "train"])
    else:
        ctx = mp.get_context("spawn")
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=initargs)


def _encode_all(paths, chunk, rd, state, tok_json, workers, f, bar) -> Tuple[int, int]:
    """Encode ``paths`` into the open file ``f`` in order; ``(tokens, documents)``. With more
    than one worker and more than one task, a pool encodes up to ``2 * workers`` tasks ahead
    (bounded memory), and the results are written in the order of the tasks."""
    itemsize = state["dtype"].itemsize
    n = docs = 0
    t0 = time.monotonic()

    def write(data: bytes, d: int, pos: int) -> None:
        nonlocal n, docs
        f.write(data)
        n += len(data) // itemsize
        docs += d
        if bar is not None:
            el = max(time.monotonic() - t0, 1e-9)
            bar.set_postfix_str(f"{docs:,} docs, {docs / el:,.0f} docs/s, {n / el:,.0f} tok/s", refresh=False)
            bar.update(pos - bar.n)  # redraws at most every 0.1 s

    pool, held = None, None
    pending: collections.deque = collections.deque()
    try:
        for task, d, pos in _tasks(paths, chunk, rd):
            if workers > 1 and pool is None:
                if held is None:  # a corpus of one task needs no pool
                    held = (task, d, pos)
                    continue
                pool = _pool(workers, (tok_json, state["bos"], state["eos"], state["dtype"].str))
                if pool is None:
                    workers = 1
                else:
                    pending.append((pool.submit(_pool_encode, held[0]), held[1], held[2]))
                    held = None
            if workers == 1:
                if held is not None:
                    write(_encode_task(held[0], state), held[1], held[2])
                    held = None
                write(_encode_task(task, state), d, pos)
                continue
            pending.append((pool.submit(_pool_encode, task), d, pos))
            while len(pending) > 2 * workers:
                r, d, pos = pending.popleft()
                write(r.result(), d, pos)
        if held is not None:
            write(_encode_task(held[0], state), held[1], held[2])
        while pending:
            r, d, pos = pending.popleft()
            write(r.result(), d, pos)
    except BaseException:
        if pool is not None:  # the queued tasks dropped; the running ones stopped (Python >= 3.14) or let end
            if hasattr(pool, "terminate_workers"):
                pool.terminate_workers()
            else:
                pool.shutdown(wait=True, cancel_futures=True)
        raise
    if pool is not None:
        pool.shutdown(wait=True)
    return n, docs


# ----------------------------------------------------------------------------- prepare
def prepare(paths: Sequence[str], out: str, *, tokenizer: str | None = None, vocab_size: int = 4096,
            chunk_mb: float = 1.0, eos: str | None = None, text_key: str = "text", errors: str = "strict",
            workers: int | None = None, progress: bool = False) -> dict:
    """Tokenize ``paths`` into ``out`` (+ ``out.json``, ``out.tokenizer.json``); returns the
    sidecar. Raises :class:`PrepareError` for a bad input or output (before anything is
    written where it can tell); on any failure or interruption only the files written here are
    removed, and nothing appears under the final names."""
    if not paths:
        raise PrepareError("no input files")
    if not isinstance(chunk_mb, (int, float)) or not math.isfinite(chunk_mb) or chunk_mb <= 0:
        raise PrepareError(f"--chunk-mb {chunk_mb}: must be a positive number of MiB")
    workers = default_workers() if workers is None else workers
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
    for path in outputs(out):
        if os.path.lexists(path):
            raise PrepareError(f"--out {out!r}: {path} exists; choose a new name (prepare never replaces a file)")
    chunk = max(1, int(chunk_mb * (1 << 20)))
    if tokenizer:
        tok, config = load_tokenizer(tokenizer)
        saved = _for_encoding(tok)
        bos_id, eos_id = special_ids(tok, config, eos)
    elif vocab_size < 257:
        raise PrepareError(f"--vocab-size {vocab_size}: must be >= 257 (256 bytes + end-of-text)")
    parent = os.path.dirname(os.path.abspath(out))
    written: List[str] = []  # what this call created, removed again on a failure (folders last)
    temps: List[str] = []
    try:
        missing = []
        d = parent
        while not os.path.exists(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            os.mkdir(d)
            written.insert(0, d)
        # All three go to temporary names nobody else uses, next to their final names (the
        # final links are within one file system); creating them also proves the folder
        # writable before a tokenizer is trained.
        for final in outputs(out):
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(final)}.", suffix=".tmp", dir=parent)
            os.close(fd)
            written.insert(0, tmp)
            temps.append(tmp)
            os.chmod(tmp, 0o644)
        f = open(temps[0], "wb")
    except OSError as e:
        _remove(written)
        raise PrepareError(f"--out {out!r}: cannot write in {parent}: {e.strerror or e}; nothing written") from None
    bar = None
    try:
        if not tokenizer:
            tok = train_bpe(paths, vocab_size, chunk, eos=eos or EOS, reading=_Reading(errors, text_key))
            saved = _for_encoding(tok)
            bos_id, eos_id = special_ids(tok, {}, eos)
        # The largest id + 1, not the number of tokens: a tokenizer's ids may have gaps, and an
        # embedding table must have a row for the largest.
        vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
        state = {"tok": tok, "bos": bos_id, "eos": eos_id, "dtype": dtype}
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(os.path.getsize(p) for p in paths), unit="B", unit_scale=True, unit_divisor=1024,
                       desc="tokenizing", file=sys.stderr, leave=False, dynamic_ncols=True,
                       disable=None)  # None: only on a terminal
        with f:
            n, docs = _encode_all(paths, chunk, rd, state, tok.to_str() if workers > 1 else None, workers, f, bar)
        if bar is not None:
            bar.close()
        if n < 2:
            raise PrepareError(f"the inputs hold {n} token(s); need at least 2")
        tok_bytes = saved.encode()
        with open(temps[2], "wb") as g:
            g.write(tok_bytes)
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab": int(vocab), "tokens": n,
                "documents": docs, "bos_id": bos_id, "eos_id": eos_id, "tokenizer": os.path.basename(outputs(out)[2]),
                "tokenizer_sha256": hashlib.sha256(tok_bytes).hexdigest(),
                "inputs": [os.path.abspath(p) for p in paths], "errors": errors, "files_replaced": len(rd.replaced)}
        with open(temps[1], "wb") as g:
            g.write(json.dumps(meta, indent=1).encode())
        # Into place, each only if its name is still free (a link fails where a rename would
        # replace): the tokenizer, the tokens, the sidecar last, so that a sidecar is only ever
        # seen with its token file.
        for i in (2, 0, 1):
            _publish(temps[i], outputs(out)[i])
            written.insert(0, outputs(out)[i])
        _remove(temps)
        for t in temps:
            written.remove(t)
    except OSError as e:
        f.close()
        if bar is not None:
            bar.close()
        _remove(written)
        if isinstance(e, FileExistsError):
            raise PrepareError(f"--out {out!r}: {e.filename} appeared while preparing; nothing of it replaced, "
                               "nothing written") from None
        raise PrepareError(f"--out {out!r}: cannot write: {e.strerror or e}; nothing written") from None
    except BaseException:
        f.close()
        if bar is not None:
            bar.close()
        _remove(written)
        raise
    return meta


def _for_encoding(tok) -> str:
    """The tokenizer's JSON (what ``OUT.tokenizer.json`` holds), then no truncation or padding
    on ``tok`` (a tokenizer.json may carry them for serving): pieces are encoded whole."""
    saved = tok.to_str(pretty=True)
    tok.no_truncation()
    tok.no_padding()
    return saved


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
    """Remove the files and (empty) folders ``paths``, newest first, as far as possible."""
    for path in paths:
        try:
            os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        except OSError:
            pass


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.prepare", description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="text files (one document each), .jsonl/.jsonl.gz or .parquet "
                                             "(a document per line or row)")
    p.add_argument("--out", required=True, help="the token file to write (its sidecar is OUT.json)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json or tokenizer folder (default: train a "
                                       "byte-level BPE)")
    p.add_argument("--eos", help="the end-of-document token (default: the tokenizer's eos_token, or <|endoftext|>)")
    p.add_argument("--text-key", default="text", help="the JSON key or Parquet column of the text (default: text)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="undecodable input: refuse (strict, default) or read it with U+FFFD (replace)")
    p.add_argument("--workers", type=int, default=None, help="encoding processes (default: the CPU count)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--vocab-size", type=int, default=4096, help="size of the BPE trained without --tokenizer")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="text encoded per piece, in MiB (> 0)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    old = signal.signal(signal.SIGTERM, _interrupt) if _main_thread() else None
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


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
