"""``python -m train.prepare``: text files -> one flat token file for ``data.source=tokens``.

Examples::

    python -m train.prepare docs/*.txt --out data/corpus.bin --vocab-size 4096   # trains a BPE
    python -m train.prepare docs/*.txt --out data/corpus.bin --tokenizer tokenizer.json

Writes, next to each other:

- ``OUT``: the tokens, little-endian ``uint16`` when the vocabulary fits (<= 65536), else
  ``uint32``; no header, so ``np.memmap(OUT, dtype)`` is the whole reader;
- ``OUT.json``: the sidecar ``{"format": "jax_nvfp4.tokens", "version": 1, "dtype", "vocab",
  "tokens", "documents", "eos_id", "tokenizer", "inputs"}``;
- ``OUT.tokenizer.json``: the tokenizer used (a copy of ``--tokenizer``, or the trained one),
  so a model trained on the file can be served with it (``--export-hf`` copies it).

Each input file is one document; documents are joined with the end-of-text token
(``<|endoftext|>`` when the tokenizer has it or is trained here). Without ``--tokenizer`` a
byte-level BPE of ``--vocab-size`` tokens is trained on the inputs with Hugging Face
``tokenizers`` (no downloads). Files are encoded in chunks of whole lines (``--chunk-mb``), so
memory stays bounded for any corpus size.

Exit status: 0 done; 2 a bad argument or input (one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, List, Sequence

import numpy as np

EOS = "<|endoftext|>"
FORMAT = "jax_nvfp4.tokens"


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


def prepare(paths: Sequence[str], out: str, *, tokenizer: str | None = None, vocab_size: int = 4096,
            chunk_mb: float = 1.0) -> dict:
    """Tokenize ``paths`` into ``out`` (+ ``out.json``, ``out.tokenizer.json``); returns the
    sidecar. Raises :class:`PrepareError` for a bad input before anything is written."""
    from tokenizers import Tokenizer

    if not paths:
        raise PrepareError("no input files")
    for p in paths:
        if not os.path.isfile(p):
            raise PrepareError(f"input {p!r}: not a regular file")
        if not os.access(p, os.R_OK):
            raise PrepareError(f"input {p!r}: not readable")
    if os.path.exists(out):
        raise PrepareError(f"--out {out!r}: exists; choose a new name (token files are not overwritten)")
    chunk = max(1, int(chunk_mb * (1 << 20)))
    if tokenizer:
        try:
            tok = Tokenizer.from_file(tokenizer)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
            raise PrepareError(f"--tokenizer {tokenizer!r}: cannot load: {str(e).splitlines()[0] if str(e) else e}") from None
    else:
        if vocab_size < 257:
            raise PrepareError(f"--vocab-size {vocab_size}: must be >= 257 (256 bytes + end-of-text)")
        tok = train_bpe(paths, vocab_size, chunk)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_id = tok.token_to_id(EOS)
    dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    n = 0
    try:
        with open(tmp, "wb") as f:
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
        meta = {"format": FORMAT, "version": 1, "dtype": dtype.name, "vocab": int(vocab), "tokens": n,
                "documents": len(paths), "eos_id": eos_id, "tokenizer": os.path.basename(out) + ".tokenizer.json",
                "inputs": [os.path.abspath(p) for p in paths]}
        tok.save(out + ".tokenizer.json")
        with open(out + ".json", "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, out)  # last: a token file with no sidecar never appears
    except BaseException:
        for path in (tmp, out + ".json", out + ".tokenizer.json"):
            if os.path.exists(path):
                os.remove(path)
        raise
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.prepare", description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="text files (one document each)")
    p.add_argument("--out", required=True, help="the token file to write (its sidecar is OUT.json)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (default: train a byte-level BPE)")
    p.add_argument("--vocab-size", type=int, default=4096, help="size of the BPE trained without --tokenizer")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="text encoded per call, in MiB")
    args = p.parse_args(argv)
    try:
        meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       chunk_mb=args.chunk_mb)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {meta['tokens']:,} tokens ({meta['dtype']}, vocab {meta['vocab']}) from "
          f"{meta['documents']} file(s); set data.source=tokens data.path={args.out} model.vocab>={meta['vocab']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
