"""Token sources (a seeded Markov chain of known entropy rate, a file's bytes, a ``train.prepare``
token file) and a deterministic, resumable, per-process-sharded batch iterator: batches are pure
functions of ``(seed, stream, step, row)``, so resuming needs only ``{"step", "seed"}``. Grain's own
iterators are not used: slicing a memory map is cheaper than their hand-off, and the position stays
one integer. See docs/TRAINING.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from train.config import Config, ConfigError, DataConfig, ModelConfig
from train.prepare import FORMAT as TOKENS_FORMAT, VERSION as TOKENS_VERSION

__all__ = ["DataIterator", "MarkovSource", "Source", "TextFileSource", "TokenFileSource", "read_token_header",
           "file_fingerprint", "make_data_iterator", "make_source", "tokenizer_file"]


class Source(Protocol):
    """Anything that yields token windows: ``windows`` gives ``[len(rngs), length] int32``, row ``i``
    drawn from ``rngs[i]`` alone; ``entropy_rate`` is in nats per token where known exactly, else None."""

    vocab: int

    def windows(self, rngs: Sequence[np.random.Generator], length: int) -> np.ndarray: ...

    def entropy_rate(self) -> float | None: ...


class MarkovSource:
    """A sparse first-order Markov chain over tokens ``0 .. states-1``, built from ``seed``.

    Token ``i`` has ``k_i`` uniform in ``[4, 8]`` successors (at most ``states``) with Zipf
    probabilities ``∝ 1/j``; one successor walks a random Hamiltonian cycle (irreducible) and
    one token points to itself (aperiodic), so the stationary ``π`` is unique. Windows start from ``π``.
    """

    def __init__(self, vocab: int = 256, states: int = 64, seed: int = 0):
        if not 2 <= states <= vocab:
            raise ConfigError(f"data.markov_states={states}: must be in [2, model.vocab={vocab}]")
        self.vocab, self.states, self.seed = int(vocab), int(states), int(seed)
        # A fixed second entry keeps the structure stream apart from the batch streams.
        rng = np.random.default_rng([self.seed, 0x4D61726B])
        cycle = rng.permutation(states)
        nxt_on_cycle = np.empty(states, np.int64)
        nxt_on_cycle[cycle] = np.roll(cycle, -1)
        kmax = min(8, states)
        succ, cdf = np.zeros((states, kmax), np.int64), np.ones((states, kmax), np.float64)
        trans = np.zeros((states, states), np.float64)
        for i in range(states):
            k = int(rng.integers(min(4, states), kmax + 1))
            must = [int(nxt_on_cycle[i])] + ([i] if i == cycle[0] else [])
            others = rng.permutation(np.setdiff1d(np.arange(states), must))
            targets = np.array((must + list(others))[:max(k, len(must))])
            rng.shuffle(targets)
            p = 1.0 / np.arange(1, len(targets) + 1)
            p /= p.sum()
            trans[i, targets] = p
            k = len(targets)
            succ[i, :k], succ[i, k:] = targets, targets[-1]
            # The last real successor's cdf is exactly 1.0 so u in [0, 1) never runs past it.
            cdf[i, :k] = np.cumsum(p)
            cdf[i, k - 1:] = 1.0
        self.transition, self._succ, self._cdf = trans, succ, cdf
        # π P = π, Σ π = 1: one (redundant) balance equation replaced by the normalization.
        a, b = trans.T - np.eye(states), np.zeros(states)
        a[-1, :], b[-1] = 1.0, 1.0
        pi = np.clip(np.linalg.solve(a, b), 0.0, None)
        self.stationary = pi / pi.sum()
        self._pi_cdf = np.cumsum(self.stationary)
        self._pi_cdf[-1] = 1.0

    def entropy_rate(self) -> float:
        """Exact entropy rate in nats/token: ``Σ_i π_i Σ_j -P_ij log P_ij``."""
        p = self.transition
        row_h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
        return float(self.stationary @ row_h)

    def _first(self, u: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._pi_cdf, u, side="right").clip(0, self.states - 1)

    def windows(self, rngs: Sequence[np.random.Generator], length: int) -> np.ndarray:
        """``[len(rngs), length] int32``; chains step in lockstep, one uniform per token."""
        if not rngs:
            return np.zeros((0, length), np.int32)
        u = np.stack([r.random(length) for r in rngs])
        out = np.empty(u.shape, np.int32)
        s = out[:, 0] = self._first(u[:, 0])
        for t in range(1, length):
            s = out[:, t] = self._succ[s, (u[:, t, None] >= self._cdf[s]).sum(axis=1)]
        return out


def _check_file(path: str, key: str) -> int:
    """The size of the readable, non-empty regular file ``path``, else a ConfigError naming ``key``."""
    for bad, what in ((not os.path.exists(path), "file not found"), (not os.path.isfile(path), "not a regular file"),
                      (not os.access(path, os.R_OK), "not readable (permission denied)")):
        if bad:
            raise ConfigError(f"{key}={path!r}: {what}")
    size = os.path.getsize(path)
    if size == 0:
        raise ConfigError(f"{key}={path!r}: file is empty")
    return size


class _FileSource:
    """A memory-mapped file of ``n`` tokens (a subclass's ``_layout(key)`` gives ``(dtype, n)``); ``part=(a, b)``
    restricts it to the tokens ``[a*n, b*n)`` (a train/validation split)."""

    unit = "tokens"

    def __init__(self, path: str | os.PathLike, min_tokens: int = 2, *, key: str = "data.path",
                 part: tuple[float, float] = (0.0, 1.0)):
        self.path, self.key = os.fspath(path), key
        dtype, n = self._layout(key)
        start, stop = int(round(n * part[0])), int(round(n * part[1]))
        try:
            self.tokens = np.memmap(self.path, dtype=dtype, mode="r")[start:stop]
        except OSError as e:
            raise ConfigError(f"{key}={self.path!r}: cannot read: {e}") from None
        self._check_window(min_tokens, "" if part == (0.0, 1.0) else f" ({self.unit} {start}..{stop} of this split)")

    def _check_window(self, length: int, where: str = "") -> None:
        """A ConfigError unless the tokens hold one window of ``length`` (``model.seq_len + 1``)."""
        if len(self) < length:
            raise ConfigError(f"{self.key}={self.path!r}: {len(self)} {self.unit}{where}, too short for one window "
                              f"of {length} tokens (model.seq_len + 1)")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def entropy_rate(self) -> None:
        return None


class TextFileSource(_FileSource):
    """The bytes of a file as tokens 0..255; windows start at uniform random offsets."""

    vocab, unit = 256, "bytes"

    def _layout(self, key: str):
        return np.uint8, _check_file(self.path, key)

    def windows(self, rngs: Sequence[np.random.Generator], length: int) -> np.ndarray:
        self._check_window(length)
        out = np.empty((len(rngs), length), np.int32)
        for i, r in enumerate(rngs):
            start = int(r.integers(0, len(self) - length + 1))
            out[i] = self.tokens[start:start + length]
        return out


def read_token_header(path: str | os.PathLike, key: str = "data.path") -> dict[str, Any]:
    """The JSON sidecar ``PATH.json`` of a token file, checked against the file's size. ``vocab``
    is the largest id + 1; a sidecar of version < 2 recorded the tokenizer's token count, so its
    file is read once (64 Mi tokens at a time) for its largest id."""
    path = os.fspath(path)
    size, meta_path = _check_file(path, key), path + ".json"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{key}={path!r}: no sidecar {os.path.basename(meta_path)}; "
                          "write token files with python -m train.prepare") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}={path!r}: cannot read {meta_path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != TOKENS_FORMAT:
        raise ConfigError(f"{key}={path!r}: {meta_path} is not a {TOKENS_FORMAT} sidecar")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise ConfigError(f"{key}={path!r}: sidecar dtype {meta.get('dtype')!r}, expected uint16 or uint32")
    itemsize = np.dtype(meta["dtype"]).itemsize
    if size % itemsize or size // itemsize != meta.get("tokens"):
        raise ConfigError(f"{key}={path!r}: {size} bytes do not hold the {meta.get('tokens')} "
                          f"{meta['dtype']} tokens its sidecar declares (truncated or altered)")
    if not isinstance(meta.get("vocab"), int) or meta["vocab"] < 1:
        raise ConfigError(f"{key}={path!r}: sidecar vocab {meta.get('vocab')!r} is not a positive integer")
    version = meta.get("version", 1)
    if type(version) is not int or not 1 <= version <= TOKENS_VERSION:
        raise ConfigError(f"{key}={path!r}: sidecar version {version!r}: this code reads versions 1 to "
                          f"{TOKENS_VERSION} (python -m train.prepare writes {TOKENS_VERSION})")
    if version < 2:
        ids, step = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r"), 1 << 26
        meta["vocab"] = max(meta["vocab"], max(int(ids[i:i + step].max()) for i in range(0, len(ids), step)) + 1)
    return meta


def tokenizer_file(path: str | os.PathLike, meta: Mapping[str, Any]) -> str | None:
    """The tokenizer file ``python -m train.prepare`` wrote beside the token file ``path``, as its sidecar ``meta``
    names it; None where there is none."""
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), meta.get("tokenizer") or "")
    return beside if os.path.isfile(beside) else None


class TokenFileSource(_FileSource):
    """A flat token file (``python -m train.prepare``) read through a memory map.

    Window ``w`` is ``tokens[w*L : w*L + L + 1]`` for ``L = length - 1`` (each token a target
    once per epoch); global row ``g`` is window ``shuffle(g)`` of a Grain ``MapDataset`` (O(1)
    memory, re-drawn each epoch).
    """

    def _layout(self, key: str):
        self.meta = meta = read_token_header(self.path, key)
        self.vocab = int(meta["vocab"])
        self._order: dict[tuple[int, int, int], Any] = {}
        return np.dtype(meta["dtype"]), int(meta["tokens"])

    def num_windows(self, length: int) -> int:
        return (len(self) - 1) // (length - 1)

    def order(self, seed: int, stream: int, length: int):
        """The Grain dataset mapping a global row index (any >= 0) to a window index; epoch ``e``
        covers indices ``[e*N, (e+1)*N)`` in its own shuffled order."""
        key = (seed, stream, length)
        if key not in self._order:
            import grain

            self._check_window(length)
            # One Grain seed per (seed, stream): train and validation orders are independent.
            self._order[key] = grain.MapDataset.range(self.num_windows(length)).shuffle(
                seed=(seed * 7919 + stream) % 2**31)
        return self._order[key]

    def windows_at(self, indices: Sequence[int], seed: int, stream: int, length: int) -> np.ndarray:
        """``[len(indices), length] int32``: the windows of the global row ``indices``."""
        order = self.order(seed, stream, length)
        out = np.empty((len(indices), length), np.int32)
        for i, g in enumerate(indices):
            w = int(order[int(g)])
            out[i] = self.tokens[w * (length - 1): w * (length - 1) + length]
        if out.size and int(out.max()) >= self.vocab:
            # An id with no embedding row would make every loss NaN ("diverged"); name it instead.
            i, j = np.unravel_index(int(np.argmax(out >= self.vocab)), out.shape)
            w = int(order[int(indices[i])])
            raise ConfigError(f"{self.path}: token id {int(out[i, j])} at token {w * (length - 1) + j} is past the "
                              f"vocabulary of {self.vocab} its sidecar declares (altered or not written by "
                              "python -m train.prepare); write the file again")
        return out


class DataIterator:
    """Batches ``[rows, seq_len + 1] int32`` of this process; batch ``s`` depends only on
    ``(seed, stream, s)`` (``stream``: 0 train, 1 eval). Process ``p`` of ``P`` gets global rows
    ``p*k .. (p+1)*k - 1``, ``k = batch_size / P``. The only state is ``{"step", "seed"}``.
    """

    def __init__(self, source: Source, batch_size: int, seq_len: int, seed: int = 0, *,
                 process_index: int = 0, process_count: int = 1, stream: int = 0, step: int = 0):
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")
        if batch_size % process_count:
            raise ConfigError(f"data.batch_size={batch_size}: must be divisible by the {process_count} processes")
        if seq_len < 1:
            raise ConfigError(f"model.seq_len={seq_len}: must be > 0")
        self.source = source
        self.batch_size, self.seq_len = int(batch_size), int(seq_len)
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.stream, self.seed, self.step = int(stream), int(seed), int(step)

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    @property
    def rows(self) -> range:
        """Global row indices held by this process."""
        k = self.local_batch_size
        return range(self.process_index * k, (self.process_index + 1) * k)

    def batch_at(self, step: int) -> np.ndarray:
        """This process's rows of batch ``step``: ``[local_batch, seq_len + 1] int32``."""
        if hasattr(self.source, "windows_at"):
            rows = [int(step) * self.batch_size + r for r in self.rows]
            return self.source.windows_at(rows, self.seed, self.stream, self.seq_len + 1)
        rngs = [np.random.default_rng([self.seed, self.stream, int(step), r]) for r in self.rows]
        return self.source.windows(rngs, self.seq_len + 1)

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> np.ndarray:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def get_state(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if missing := {"step", "seed"} - set(state):
            raise ValueError(f"data iterator state lacks {sorted(missing)}")
        step, seed = int(state["step"]), int(state["seed"])
        if step < 0 or seed < 0:
            raise ValueError(f"data iterator state must be non-negative, got {dict(state)}")
        self.step, self.seed = step, seed


EVAL_STREAM = 1


def make_source(data: DataConfig, model: ModelConfig, split: str = "train") -> Source | None:
    """The training source, or with ``split="val"`` the held-out one: ``data.val_path``, else the
    last ``data.val_fraction`` of ``data.path``, else None (Markov: its own stream)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if data.source == "markov":
        return MarkovSource(vocab=model.vocab, states=data.markov_states, seed=data.seed)
    cls = TextFileSource if data.source == "file" else TokenFileSource
    n = model.seq_len + 1
    if split == "train":
        src = cls(data.path, n, part=(0.0, 1.0 - (0.0 if data.val_path else data.val_fraction)))
    elif data.val_path:
        src = cls(data.val_path, n, key="data.val_path")
        if cls is TokenFileSource:  # another tokenizer's loss would compare different token streams
            train_meta = read_token_header(data.path)
            a, b = src.meta.get("tokenizer_sha256"), train_meta.get("tokenizer_sha256")
            if a != b or (a is None and src.meta.get("vocab") != train_meta.get("vocab")):
                what = (f"tokenizer sha256 {a[:12] if a else 'not recorded'} against {b[:12] if b else 'not recorded'}"
                        if a or b else f"vocabulary {src.meta.get('vocab')} against {train_meta.get('vocab')}")
                raise ConfigError(f"data.val_path={src.path!r}: not made with the tokenizer of data.path ({what}); "
                                  "prepare both with the same --tokenizer")
            for mark in ("bos_id", "eos_id"):  # documents framed otherwise: another token stream
                if src.meta.get(mark) != train_meta.get(mark):
                    raise ConfigError(f"data.val_path={src.path!r}: its documents have {mark} {src.meta.get(mark)}, "
                                      f"those of data.path {train_meta.get(mark)}; prepare both with the same "
                                      "--tokenizer and --eos")
    elif data.val_fraction > 0:
        src = cls(data.path, n, part=(1.0 - data.val_fraction, 1.0))
    else:
        return None
    if src.vocab > model.vocab:  # ids at or past model.vocab have no embedding row: NaN loss at every step
        raise ConfigError(f"model.vocab={model.vocab}: smaller than the vocabulary of {src.path!r} ({src.vocab} = its "
                          f"largest token id + 1); its ids would reach past the embedding table. Set "
                          f"model.vocab={src.vocab} or more")
    return src


# Files up to this size are hashed whole for a resume's check; larger ones by sampled blocks.
WHOLE_HASH_BYTES = 256 << 20
SAMPLED_BLOCKS, BLOCK_BYTES = 64, 1 << 20


def file_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """``{"bytes", "sha256", "hashed"}`` of a data file, recorded in checkpoints so that a resume
    on changed data is refused: the whole file up to ``WHOLE_HASH_BYTES``, else its size and
    ``SAMPLED_BLOCKS`` evenly spaced blocks, the first and last included (an edit elsewhere that
    keeps the size can go unseen; the cost stays bounded at every start)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= WHOLE_HASH_BYTES:
            h, how = hashlib.file_digest(f, "sha256"), "whole file"
        else:
            h, last = hashlib.sha256(), size - BLOCK_BYTES
            for i in range(SAMPLED_BLOCKS):
                f.seek(last * i // (SAMPLED_BLOCKS - 1))
                h.update(f.read(BLOCK_BYTES))
            how = f"{SAMPLED_BLOCKS} blocks of {BLOCK_BYTES} bytes"
    return {"bytes": size, "sha256": h.hexdigest(), "hashed": how}


def make_data_iterator(cfg: Config, *, process_index: int = 0, process_count: int = 1,
                       stream: int = 0, source: Source | None = None) -> DataIterator:
    """The iterator for ``cfg`` (global batch ``cfg.data.batch_size``), this process's rows."""
    source = make_source(cfg.data, cfg.model) if source is None else source
    return DataIterator(source, cfg.data.batch_size, cfg.model.seq_len, cfg.data.seed,
                        process_index=process_index, process_count=process_count, stream=stream)


def eval_batches(cfg: Config, source: Source, *, process_index: int = 0,
                 process_count: int = 1) -> list[np.ndarray]:
    """The ``train.eval_batches`` validation batches (this process's rows), the same at every
    evaluation so that validation losses are comparable along a run and across runs."""
    it = make_data_iterator(cfg, process_index=process_index, process_count=process_count,
                            stream=EVAL_STREAM, source=source)
    return [it.batch_at(i) for i in range(cfg.train.eval_batches)]
