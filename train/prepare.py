"""``python -m train.prepare``: text files -> one flat token file for ``data.source=tokens``.

Examples::

    python -m train.prepare docs/*.txt --out data/corpus.bin --vocab-size 4096   # trains a BPE
    python -m train.prepare docs/*.txt --out data/corpus.bin --tokenizer tokenizer.json

Writes, next to each other:

- ``OUT``: the tokens, little-endian ``uint16`` when the vocabulary fits (<= 65536), else
  ``uint32``; no header, so ``np.memmap(OUT, dtype)`` is the whole reader;
- ``OUT.json``: the sidecar ``{"format": "jax_nvfp4.tokens", "version": 2, "dtype", "vocab",
  "tokens", "documents", "eos_id", "tokenizer", "tokenizer_sha256", "inputs"}``; ``vocab`` is the
  tokenizer's largest id + 1 (ids may have gaps: a model needs ``model.vocab >= vocab``), and
  ``tokenizer_sha256`` the hash of ``OUT.tokenizer.json`` (a validation file must come from the
  same tokenizer);
- ``OUT.tokenizer.json``: the tokenizer used (a copy of ``--tokenizer``, or the trained one),
  so a model trained on the file can be served with it (``--export-hf`` copies it).

Each input file is one document; documents are joined with the end-of-text token
(``<|endoftext|>`` when the tokenizer has it or is trained here). Without ``--tokenizer`` a
byte-level BPE of ``--vocab-size`` tokens is trained on the inputs with Hugging Face
``tokenizers`` (no downloads). Files are encoded in chunks of whole lines (``--chunk-mb``), so
memory stays bounded for any corpus size.

None of the three may exist: ``prepare`` refuses before it writes anything, and on a failure it
removes only what it wrote itself.

Exit status: 0 done; 2 a bad argument, input or output location (one line on stderr, nothing
written).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import sys
import tempfile
from typing import Iterator, List, Sequence

import numpy as np

EOS = "<|endoftext|>"
FORMAT = "jax_nvfp4.tokens"
# 1: "vocab" was the tokenizer's token count; 2: its largest id + 1, and the tokenizer's sha256.
VERSION = 2


class PrepareError(ValueError):
    """A bad argument or input file; the message is one line."""


def _chunks(path: str, chunk_bytes: int) -> Iterator[str]:
    """The text of ``path`` in pieces of about ``chunk_bytes``, cut after a newline."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        buf: List[str] = []
        size = 0
        for line in f:
            buf.append(line)
            size += len(line)
            if size >= chunk_bytes:
                yield "".join(buf)
                buf, size = [], 0
        if buf:
            yield "".join(buf)


def train_bpe(paths: Sequence[str], vocab_size: int, chunk_bytes: int = 1 << 20):
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenization, every byte in the base
    alphabet, so any text encodes) of ``vocab_size`` tokens including ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((c for p in paths for c in _chunks(p, chunk_bytes)), trainer=trainer)
    return tok


def outputs(out: str) -> List[str]:
    """The files ``prepare`` writes for ``out``: the tokens, the sidecar, the tokenizer."""
    return [out, out + ".json", out + ".tokenizer.json"]


def prepare(paths: Sequence[str], out: str, *, tokenizer: str | None = None, vocab_size: int = 4096,
            chunk_mb: float = 1.0) -> dict:
    """Tokenize ``paths`` into ``out`` (+ ``out.json``, ``out.tokenizer.json``); returns the
    sidecar. Raises :class:`PrepareError` for a bad input or output before anything is
    written; on any failure afterwards only the files written here are removed."""
    from tokenizers import Tokenizer

    if not paths:
        raise PrepareError("no input files")
    if not isinstance(chunk_mb, (int, float)) or not math.isfinite(chunk_mb) or chunk_mb <= 0:
        raise PrepareError(f"--chunk-mb {chunk_mb}: must be a positive number of MiB")
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
        try:
            tok = Tokenizer.from_file(tokenizer)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
            raise PrepareError(f"--tokenizer {tokenizer!r}: cannot load: {str(e).splitlines()[0] if str(e) else e}") from None
    else:
        if vocab_size < 257:
            raise PrepareError(f"--vocab-size {vocab_size}: must be >= 257 (256 bytes + end-of-text)")
    parent = os.path.dirname(os.path.abspath(out))
    written: List[str] = []  # what this call created, removed again on a failure (folders last)
    try:
        missing = []
        d = parent
        while not os.path.exists(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            os.mkdir(d)
            written.insert(0, d)
        # The token stream goes to a temporary file of a name nobody else uses, next to OUT (the
        # final link is then within one file system); creating it also proves the folder
        # writable before a tokenizer is trained.
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
        written.insert(0, tmp)
        f = os.fdopen(fd, "wb")
        os.chmod(tmp, 0o644)
    except OSError as e:
        _remove(written)
        raise PrepareError(f"--out {out!r}: cannot write in {parent}: {e.strerror or e}; nothing written") from None
    try:
        if not tokenizer:
            tok = train_bpe(paths, vocab_size, chunk)
        # The largest id + 1, not the number of tokens: a tokenizer's ids may have gaps, and an
        # embedding table must have a row for the largest.
        vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        eos_id = tok.token_to_id(EOS)
        dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
        n = 0
        with f:
            for i, p in enumerate(paths):
                if i and eos_id is not None:
                    f.write(np.asarray([eos_id], dtype).tobytes())
                    n += 1
                for text in _chunks(p, chunk):
                    ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype)
                    f.write(ids.tobytes())
                    n += int(ids.size)
        if n < 2:
            raise PrepareError(f"the inputs hold {n} token(s); need at least 2")
        tok_path, meta_path = outputs(out)[2], outputs(out)[1]
        _create(tok_path, tok.to_str(pretty=True).encode(), written)
        with open(tok_path, "rb") as f:
            tok_sha = hashlib.sha256(f.read()).hexdigest()
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab": int(vocab), "tokens": n,
                "documents": len(paths), "eos_id": eos_id, "tokenizer": os.path.basename(tok_path),
                "tokenizer_sha256": tok_sha, "inputs": [os.path.abspath(p) for p in paths]}
        _create(meta_path, json.dumps(meta, indent=1).encode(), written)
        # Last, and only if OUT is still free: a token file with no sidecar never appears, and a
        # file that appeared meanwhile is not replaced (a link fails where a rename would replace).
        try:
            os.link(tmp, out)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: check, then rename
            if os.path.lexists(out):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), out) from None
            os.rename(tmp, out)
        written.insert(0, out)
        if os.path.exists(tmp):
            os.remove(tmp)
        written.remove(tmp)
    except OSError as e:
        f.close()
        _remove(written)
        if isinstance(e, FileExistsError):
            raise PrepareError(f"--out {out!r}: {e.filename} appeared while preparing; nothing of it replaced, "
                               "nothing written") from None
        raise PrepareError(f"--out {out!r}: cannot write: {e.strerror or e}; nothing written") from None
    except BaseException:
        f.close()
        _remove(written)
        raise
    return meta


def _create(path: str, content: bytes, written: List[str]) -> None:
    """Write ``content`` to ``path``, which must not exist (never replaces a file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    written.insert(0, path)
    with os.fdopen(fd, "wb") as f:
        f.write(content)


def _remove(paths: Sequence[str]) -> None:
    """Remove the files and (empty) folders ``paths``, newest first, as far as possible."""
    for path in paths:
        try:
            os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        except OSError:
            pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.prepare", description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="text files (one document each)")
    p.add_argument("--out", required=True, help="the token file to write (its sidecar is OUT.json)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (default: train a byte-level BPE)")
    p.add_argument("--vocab-size", type=int, default=4096, help="size of the BPE trained without --tokenizer")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="text encoded per call, in MiB (> 0)")
    args = p.parse_args(argv)
    try:
        meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       chunk_mb=args.chunk_mb)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {meta['tokens']:,} tokens ({meta['dtype']}, vocab {meta['vocab']} = largest id + 1) from "
          f"{meta['documents']} file(s); set data.source=tokens data.path={args.out} model.vocab>={meta['vocab']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
