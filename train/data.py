"""Token sources and a deterministic, resumable, per-process-sharded batch iterator.

Three sources:

- :class:`MarkovSource`: a seeded sparse first-order Markov chain, built here (no downloads),
  whose entropy rate is known exactly. Each batch row starts from the stationary distribution
  and every target token has its predecessor in the input, so the entropy rate IS the lowest
  reachable mean cross-entropy: training prints it as the loss floor.
- :class:`TextFileSource`: the bytes of any file as tokens (vocab 256), read through a memory
  map so a large corpus costs no RAM.
- :class:`TokenFileSource`: a flat token file written by ``python -m train.prepare`` (uint16 or
  uint32, a JSON sidecar says which and the vocabulary size), memory-mapped. It is cut into
  non-overlapping windows (every token is a target once per epoch), visited in a shuffled order
  that changes every epoch.

Batches are pure functions of ``(seed, stream, step, row)``. For the first two sources row ``r``
of step ``s`` draws from ``np.random.default_rng([seed, stream, s, r])``; for token files, global
row ``g = s * batch_size + r`` is window ``shuffle(g)`` of a Grain ``MapDataset`` (an index
shuffle with O(1) memory and random access, re-drawn each epoch, so a corpus of billions of
windows needs no permutation table). Hence resuming needs only ``{"step", "seed"}``, each process
generates just its own rows, the union over processes is exactly the single-process batch, and
within an epoch two processes never read the same window. Grain's own iterators (worker
processes, prefetch) are not used: slicing a memory map is cheaper than their hand-off, and the
position stays one integer.

Held-out data (:func:`make_source` with ``split="val"``): ``data.val_path`` (a file of the same
kind), or the last ``data.val_fraction`` of the training file; the Markov source, being
infinite, draws validation rows from its own stream.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from train.config import Config, ConfigError, DataConfig, ModelConfig

__all__ = [
    "DataIterator",
    "MarkovSource",
    "Source",
    "TextFileSource",
    "TokenFileSource",
    "read_token_header",
    "file_fingerprint",
    "make_data_iterator",
    "make_source",
    "split_batch",
]


class Source(Protocol):
    """Anything that yields token windows."""

    vocab: int

    def windows(self, rngs: Sequence[np.random.Generator], length: int) -> np.ndarray:
        """``[len(rngs), length] int32``: row ``i`` drawn from ``rngs[i]`` alone."""

    def entropy_rate(self) -> float | None:
        """Nats per token, when known exactly; else None."""


class MarkovSource:
    """A sparse first-order Markov chain over tokens ``0 .. states-1``.

    Structure (from ``seed`` alone): token ``i`` has ``k_i`` successors, ``k_i`` uniform in
    ``[min_successors, max_successors]``, with Zipf probabilities ``p_j ∝ 1/j**zipf`` in a
    random order. One successor of each token walks a random Hamiltonian cycle, so the chain is
    irreducible, and one token also points to itself, so it is aperiodic: the stationary
    distribution ``π`` is unique and sample averages converge to it.

    Entropy rate (nats/token): ``H = Σ_i π_i · H(P[i, :])``. A bigram table of
    ``states × k`` entries: a small transformer learns it in a few hundred steps.
    """

    def __init__(self, vocab: int = 256, states: int = 64, seed: int = 0, *,
                 min_successors: int = 4, max_successors: int = 8, zipf: float = 1.0):
        if not 2 <= states <= vocab:
            raise ConfigError(f"data.markov_states={states}: must be in [2, model.vocab={vocab}]")
        if not 1 <= min_successors <= max_successors:
            raise ValueError(f"need 1 <= min_successors <= max_successors, got "
                             f"{min_successors}, {max_successors}")
        self.vocab, self.states, self.seed = int(vocab), int(states), int(seed)
        # A fixed second entry keeps the structure stream apart from the batch streams.
        rng = np.random.default_rng([self.seed, 0x4D61726B])
        cycle = rng.permutation(states)
        nxt_on_cycle = np.empty(states, np.int64)
        nxt_on_cycle[cycle] = np.roll(cycle, -1)
        kmax = min(max_successors, states)
        succ = np.zeros((states, kmax), np.int64)
        cdf = np.ones((states, kmax), np.float64)
        trans = np.zeros((states, states), np.float64)
        for i in range(states):
            k = int(rng.integers(min(min_successors, states), kmax + 1))
            must = [int(nxt_on_cycle[i])] + ([i] if i == cycle[0] else [])
            others = rng.permutation(np.setdiff1d(np.arange(states), must))
            targets = np.array((must + list(others))[:max(k, len(must))])
            rng.shuffle(targets)
            p = 1.0 / np.arange(1, len(targets) + 1) ** zipf
            p /= p.sum()
            trans[i, targets] = p
            k = len(targets)
            succ[i, :k], succ[i, k:] = targets, targets[-1]
            # The last real successor's cdf is exactly 1.0 so u in [0, 1) never runs past it.
            cdf[i, :k] = np.cumsum(p)
            cdf[i, k - 1:] = 1.0
        self.transition = trans
        self._succ, self._cdf = succ, cdf
        self.stationary = _stationary(trans)
        self._pi_cdf = np.cumsum(self.stationary)
        self._pi_cdf[-1] = 1.0

    def entropy_rate(self) -> float:
        """Exact entropy rate in nats/token: ``Σ_i π_i Σ_j -P_ij log P_ij``."""
        p = self.transition
        row_h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
        return float(self.stationary @ row_h)

    def _first(self, u: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._pi_cdf, u, side="right").clip(0, self.states - 1)

    def sample(self, n_tokens: int, rng: np.random.Generator) -> np.ndarray:
        """One chain of ``n_tokens`` tokens ``[n_tokens] int32``, started from ``π``."""
        u = rng.random(n_tokens)
        if n_tokens == 0:
            return np.zeros(0, np.int32)
        out = np.empty(n_tokens, np.int32)
        # Python lists + bisect: a scalar loop over numpy arrays is ~10x slower.
        succ, cdf = self._succ.tolist(), self._cdf.tolist()
        s = int(self._first(u[:1])[0])
        out[0] = s
        for t, ut in enumerate(u[1:].tolist(), start=1):
            s = succ[s][bisect.bisect_right(cdf[s], ut)]
            out[t] = s
        return out

    def windows(self, rngs: Sequence[np.random.Generator], length: int) -> np.ndarray:
        """``[len(rngs), length] int32``; chains step in lockstep, one uniform per token."""
        if not rngs:
            return np.zeros((0, length), np.int32)
        u = np.stack([r.random(length) for r in rngs])
        out = np.empty(u.shape, np.int32)
        s = self._first(u[:, 0])
        out[:, 0] = s
        for t in range(1, length):
            j = (u[:, t, None] >= self._cdf[s]).sum(axis=1)
            s = self._succ[s, j]
            out[:, t] = s
        return out

    def __repr__(self) -> str:
        return (f"MarkovSource(vocab={self.vocab}, states={self.states}, seed={self.seed}, "
                f"entropy_rate={self.entropy_rate():.4f} nats)")


def _stationary(p: np.ndarray) -> np.ndarray:
    """``π`` with ``π P = π``, ``Σ π = 1`` for an irreducible chain (one linear solve)."""
    n = p.shape[0]
    a = p.T - np.eye(n)
    a[-1, :] = 1.0  # replace one (redundant) balance equation by the normalization
    b = np.zeros(n)
    b[-1] = 1.0
    pi = np.linalg.solve(a, b)
    pi = np.clip(pi, 0.0, None)
    return pi / pi.sum()


def _check_file(path: str, key: str) -> int:
    """The size of the readable regular file ``path``, else a ConfigError naming ``key``."""
    if not os.path.exists(path):
        raise ConfigError(f"{key}={path!r}: file not found")
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path!r}: not a regular file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{key}={path!r}: not readable (permission denied)")
    size = os.path.getsize(path)
    if size == 0:
        raise ConfigError(f"{key}={path!r}: file is empty")
    return size


def _fraction_range(n: int, part: tuple[float, float]) -> tuple[int, int]:
    """Token range ``[start, stop)`` of the fraction ``part`` of ``n`` tokens."""
    return int(round(n * part[0])), int(round(n * part[1]))


class TextFileSource:
    """The bytes of a file as tokens 0..255; windows start at uniform random offsets.

    ``part=(a, b)`` restricts it to the bytes ``[a*n, b*n)`` (a train/validation split)."""

    vocab = 256

    def __init__(self, path: str | os.PathLike, min_tokens: int = 2, *, key: str = "data.path",
                 part: tuple[float, float] = (0.0, 1.0)):
        path = os.fspath(path)
        self.path = path
        size = _check_file(path, key)
        start, stop = _fraction_range(size, part)
        if stop - start < min_tokens:
            where = "" if part == (0.0, 1.0) else f" (bytes {start}..{stop} of this split)"
            raise ConfigError(f"{key}={path!r}: {stop - start} bytes{where}, too short for one window of "
                              f"{min_tokens} tokens (model.seq_len + 1)")
        try:
            self.tokens = np.memmap(path, dtype=np.uint8, mode="r")[start:stop]
        except OSError as e:
            raise ConfigError(f"{key}={path!r}: cannot read: {e}") from None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def entropy_rate(self) -> None:
        return None

    def windows(self, rngs: Sequence[np.random.Generator], length: int) -> np.ndarray:
        n = len(self)
        if length > n:
            raise ConfigError(f"data.path={self.path!r}: {n} bytes, too short for one window "
                              f"of {length} tokens (model.seq_len + 1)")
        out = np.empty((len(rngs), length), np.int32)
        for i, r in enumerate(rngs):
            start = int(r.integers(0, n - length + 1))
            out[i] = self.tokens[start:start + length]
        return out

    def __repr__(self) -> str:
        return f"TextFileSource({self.path!r}, {len(self)} bytes)"


TOKENS_FORMAT = "jax_nvfp4.tokens"


def _max_id(path: str, dtype: str) -> int:
    """The largest token id in the token file ``path`` (one pass, 64 Mi tokens at a time)."""
    ids = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    step = 1 << 26
    return max(int(ids[i:i + step].max()) for i in range(0, len(ids), step))


def read_token_header(path: str | os.PathLike, key: str = "data.path") -> dict[str, Any]:
    """The JSON sidecar ``PATH.json`` of a token file: ``{"format", "dtype", "vocab", "tokens",
    ...}``, checked against the file's size. ``vocab`` is an upper bound of the file's ids (the
    largest id + 1): sidecars of format version 2 record it (``python -m train.prepare``);
    older ones recorded the tokenizer's token count, which a tokenizer with gaps in its ids
    exceeds, so their files are read once here for their largest id."""
    path = os.fspath(path)
    size = _check_file(path, key)
    meta_path = path + ".json"
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
    if meta.get("version", 1) < 2:
        meta["vocab"] = max(meta["vocab"], _max_id(path, meta["dtype"]) + 1)
    return meta


class TokenFileSource:
    """A flat token file (``python -m train.prepare``) read through a memory map.

    Window ``w`` is ``tokens[w*L : w*L + L + 1]`` for ``L = length - 1``: consecutive windows
    overlap by one token, so each token is a target exactly once per epoch. ``part=(a, b)``
    restricts the source to the tokens ``[a*n, b*n)``.
    """

    def __init__(self, path: str | os.PathLike, min_tokens: int = 2, *, key: str = "data.path",
                 part: tuple[float, float] = (0.0, 1.0)):
        self.path = os.fspath(path)
        meta = read_token_header(self.path, key)
        self.vocab, self.meta = int(meta["vocab"]), meta
        start, stop = _fraction_range(int(meta["tokens"]), part)
        if stop - start < min_tokens:
            raise ConfigError(f"{key}={self.path!r}: {stop - start} tokens in this split, too short for one "
                              f"window of {min_tokens} tokens (model.seq_len + 1)")
        try:
            self.tokens = np.memmap(self.path, dtype=np.dtype(meta["dtype"]), mode="r")[start:stop]
        except OSError as e:
            raise ConfigError(f"{key}={self.path!r}: cannot read: {e}") from None
        self._order: dict[tuple[int, int, int], Any] = {}

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def entropy_rate(self) -> None:
        return None

    def num_windows(self, length: int) -> int:
        return (len(self) - 1) // (length - 1)

    def order(self, seed: int, stream: int, length: int):
        """The Grain dataset mapping a global row index to a window index (any index >= 0;
        epoch ``e`` covers indices ``[e*N, (e+1)*N)`` in its own shuffled order)."""
        key = (seed, stream, length)
        if key not in self._order:
            import grain

            n = self.num_windows(length)
            if n < 1:
                raise ConfigError(f"data.path={self.path!r}: {len(self)} tokens, too short for one "
                                  f"window of {length} tokens (model.seq_len + 1)")
            # One Grain seed per (seed, stream): train and validation orders are independent.
            self._order[key] = grain.MapDataset.range(n).shuffle(seed=(seed * 7919 + stream) % 2**31)
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

    def __repr__(self) -> str:
        return f"TokenFileSource({self.path!r}, {len(self)} tokens, vocab {self.vocab})"


class DataIterator:
    """Batches ``[rows, seq_len + 1] int32`` of this process; batch ``s`` depends only on
    ``(seed, stream, s)``.

    Process ``p`` of ``P`` gets global rows ``p*k .. (p+1)*k - 1`` with ``k = batch_size / P``.
    ``stream`` separates independent data streams of the same seed (0 = train, 1 = eval).
    The only state is ``{"step", "seed"}``, saved with the training state.
    """

    def __init__(self, source: Source, batch_size: int, seq_len: int, seed: int = 0, *,
                 process_index: int = 0, process_count: int = 1, stream: int = 0,
                 step: int = 0):
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"need 0 <= process_index < process_count, got "
                             f"{process_index}, {process_count}")
        if batch_size % process_count:
            raise ConfigError(f"data.batch_size={batch_size}: must be divisible by the "
                              f"{process_count} processes")
        if seq_len < 1:
            raise ConfigError(f"model.seq_len={seq_len}: must be > 0")
        self.source = source
        self.batch_size, self.seq_len = int(batch_size), int(seq_len)
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.stream = int(stream)
        self.seed, self.step = int(seed), int(step)

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
        missing = {"step", "seed"} - set(state)
        if missing:
            raise ValueError(f"data iterator state lacks {sorted(missing)}")
        step, seed = int(state["step"]), int(state["seed"])
        if step < 0 or seed < 0:
            raise ValueError(f"data iterator state must be non-negative, got {dict(state)}")
        self.step, self.seed = step, seed


def split_batch(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[b, seq_len + 1]`` -> inputs ``[b, seq_len]``, targets ``[b, seq_len]`` (shifted by 1)."""
    return batch[:, :-1], batch[:, 1:]


EVAL_STREAM = 1


def make_source(data: DataConfig, model: ModelConfig, split: str = "train") -> Source | None:
    """The training source, or with ``split="val"`` the held-out one (None when the config
    names none: a file source without ``data.val_path`` or ``data.val_fraction``)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if data.source == "markov":
        return MarkovSource(vocab=model.vocab, states=data.markov_states, seed=data.seed)
    if data.source not in ("file", "tokens"):
        raise ConfigError(f"data.source={data.source!r}: must be 'markov', 'file' or 'tokens'")
    cls = TextFileSource if data.source == "file" else TokenFileSource
    n = model.seq_len + 1
    if split == "val":
        if data.val_path:
            src = cls(data.val_path, n, key="data.val_path")
            if cls is TokenFileSource:
                _check_same_tokenizer(src, read_token_header(data.path))
        elif data.val_fraction > 0:
            src = cls(data.path, n, part=(1.0 - data.val_fraction, 1.0))
        else:
            return None
    else:
        src = cls(data.path, n, part=(0.0, 1.0 - (0.0 if data.val_path else data.val_fraction)))
    if src.vocab > model.vocab:
        # Ids at or past model.vocab have no embedding row: their loss is NaN at every step.
        raise ConfigError(f"model.vocab={model.vocab}: smaller than the vocabulary of {src.path!r} ({src.vocab} = its "
                          f"largest token id + 1); its ids would reach past the embedding table. Set "
                          f"model.vocab={src.vocab} or more")
    return src


def _check_same_tokenizer(val: "TokenFileSource", train_meta: dict[str, Any]) -> None:
    """Refuse a validation token file made by another tokenizer than the training file: its
    loss would compare different token streams."""
    a, b = val.meta.get("tokenizer_sha256"), train_meta.get("tokenizer_sha256")
    if a != b or (a is None and val.meta.get("vocab") != train_meta.get("vocab")):
        what = (f"tokenizer sha256 {a[:12] if a else 'not recorded'} against {b[:12] if b else 'not recorded'}"
                if a or b else f"vocabulary {val.meta.get('vocab')} against {train_meta.get('vocab')}")
        raise ConfigError(f"data.val_path={val.path!r}: not made with the tokenizer of data.path ({what}); "
                          "prepare both with the same --tokenizer")


# Files up to this size are hashed whole for a resume's check; larger ones by sampled blocks.
WHOLE_HASH_BYTES = 256 << 20
SAMPLED_BLOCKS, BLOCK_BYTES = 64, 1 << 20


def file_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """``{"bytes", "sha256", "hashed"}`` of a data file, recorded in checkpoints so that a
    resume on changed data is refused. Up to 256 MiB the sha256 is of the whole file; a larger
    file is fingerprinted by its size and the sha256 of 64 blocks of 1 MiB at evenly spaced
    offsets, the first and the last included (an edit elsewhere that keeps the size can go
    unseen; the cost stays about 64 MiB of reads at every start)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_HASH_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            how = "whole file"
        else:
            last = size - BLOCK_BYTES
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
                        process_index=process_index, process_count=process_count,
                        stream=stream)


def eval_batches(cfg: Config, source: Source, *, process_index: int = 0,
                 process_count: int = 1) -> list[np.ndarray]:
    """The ``train.eval_batches`` validation batches (this process's rows), the same at every
    evaluation so that validation losses are comparable along a run and across runs."""
    it = make_data_iterator(cfg, process_index=process_index, process_count=process_count,
                            stream=EVAL_STREAM, source=source)
    return [it.batch_at(i) for i in range(cfg.train.eval_batches)]
