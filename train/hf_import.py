"""Start a run from a Hugging Face Llama checkpoint (``train.init_from: DIR``, ``--init-from DIR``): the model's shape
from ``DIR/config.json`` (:func:`resolve_config`), its safetensors (plain or compressed-tensors NVFP4, losslessly)
read by each process where its devices store them (:func:`load`, :func:`plan`: :mod:`jax_nvfp4.hf` with this
Llama's names), the optimizer fresh. What is read how, and the refusals (ConfigError, one line, before anything
compiles): docs/TRAINING.md, ``--init-from``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict, Optional, Sequence, Tuple

from train import config as config_lib
from train.config import ROPE_SCALING_KEYS, Config, ConfigError, RopeScaling

__all__ = ["check_tokens", "has_tokenizer", "hf_config", "load", "load_config", "model_values", "notice", "plan",
           "read_hf_config", "resolve_config"]

# The weights of jax_nvfp4.export's NVFP4A16_QUANTIZATION_CONFIG (resolving a config imports no JAX).
_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}
# model config key -> its config.json name.
_HF_KEYS = {"vocab": "vocab_size", "d_model": "hidden_size", "mlp_hidden": "intermediate_size",
            "layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
            "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}
# The files of a Hugging Face tokenizer, copied from a checkpoint folder into an export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")


def _fail(where: str, text: str):
    raise ConfigError(f"train.init_from={where}: {text}")


def read_hf_config(directory: str) -> Dict[str, Any]:
    """``DIR/config.json`` as a dict. Raises ConfigError: no such folder or file, or not a JSON object."""
    if not os.path.isdir(directory):
        _fail(directory, "not a folder")
    try:
        with open(os.path.join(directory, "config.json")) as f:
            hf = json.load(f)
    except FileNotFoundError:
        _fail(directory, "no config.json (a Hugging Face checkpoint folder has one)")
    except (OSError, ValueError) as e:
        _fail(directory, f"cannot read config.json: {e}")
    if not isinstance(hf, dict):
        _fail(directory, "config.json is not a JSON object")
    return hf


def _rope(hf: Dict[str, Any], where: str) -> Tuple[float, Optional[RopeScaling]]:
    """``(rope_theta, scaling)`` from transformers 5's ``rope_parameters`` or 4's ``rope_scaling``; llama3's only."""
    found = []
    for name in ("rope_parameters", "rope_scaling"):
        d = hf.get(name)
        if d is None:
            continue
        if not isinstance(d, dict) or any(isinstance(v, dict) for v in d.values()):
            _fail(where, f"config.json {name}={json.dumps(d)[:60]}: expected one mapping of rope settings")
        kind = d.get("rope_type", d.get("type", "default"))
        if kind in (None, "default"):
            found.append(None)
            continue
        if kind != "llama3":
            _fail(where, f"config.json {name}.rope_type={kind!r}: this model has plain rotary positions and Llama "
                         "3.x's scaling (rope_type 'llama3') only")
        missing = [k for k in ROPE_SCALING_KEYS if d.get(k) is None]
        if missing:
            _fail(where, f"config.json {name} (rope_type 'llama3') has no {missing[0]}")
        values = {k: d[k] for k in ROPE_SCALING_KEYS}
        old = values["original_max_position_embeddings"]
        values["original_max_position_embeddings"] = int(old) if isinstance(old, float) and old.is_integer() else old
        try:
            found.append(RopeScaling(**values))
        except ConfigError as e:
            _fail(where, f"config.json {name}: {e}".replace("model.rope_scaling.", f"{name}."))
    if len(found) == 2 and found[0] != found[1]:
        _fail(where, "config.json rope_parameters and rope_scaling disagree; keep one")
    inner, outer = (hf.get("rope_parameters") or {}).get("rope_theta"), hf.get("rope_theta")
    if inner is not None and outer is not None and inner != outer:
        _fail(where, f"config.json rope_theta={outer} and rope_parameters.rope_theta={inner} disagree; keep one")
    theta = next((t for t in (inner, outer) if t is not None), 10000.0)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        _fail(where, f"config.json rope_theta={theta!r}: expected a number")
    return float(theta), (found[0] if found else None)


def _check_quantization(hf: Dict[str, Any], where: str) -> None:
    """Refuse a ``quantization_config`` other than compressed-tensors' weight-only NVFP4."""
    q = hf.get("quantization_config")
    if q is None:
        return
    if not isinstance(q, dict):
        _fail(where, "config.json quantization_config is not a JSON object")
    method, fmt = q.get("quant_method"), q.get("format")
    if method != "compressed-tensors" or fmt != "nvfp4-pack-quantized":
        _fail(where, f"config.json quantization_config has quant_method={method!r}, format={fmt!r}: only "
                     "compressed-tensors' 'nvfp4-pack-quantized' NVFP4 weights (or plain weights) are read")
    if q.get("quantization_status") not in (None, "compressed"):
        _fail(where, f"config.json quantization_config.quantization_status={q['quantization_status']!r}: only "
                     "compressed checkpoints are read")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if q.get(key):
            _fail(where, f"config.json quantization_config.{key} is set: this import reads NVFP4 weights only")
    groups = q.get("config_groups") or {}
    for name, group in (groups.items() if isinstance(groups, dict) else ()):
        group = group if isinstance(group, dict) else {}
        got = {k: (group.get("weights") or {}).get(k) for k in _NVFP4_WEIGHTS}
        if group.get("format", fmt) != fmt or got != _NVFP4_WEIGHTS:
            _fail(where, f"config.json quantization_config.config_groups.{name}: weights {json.dumps(got)} in format "
                         f"{group.get('format', fmt)!r}; only NVFP4 weights ({json.dumps(_NVFP4_WEIGHTS)}) are read")
        acts = group.get("input_activations")
        if group.get("output_activations") or (acts and not (
                isinstance(acts, dict) and {k: acts.get(k) for k in _NVFP4_WEIGHTS} == _NVFP4_WEIGHTS)):
            _fail(where, f"config.json quantization_config.config_groups.{name} quantizes activations other than "
                         "the Linear inputs in NVFP4; this import reads NVFP4 weights (NVFP4A16, or NVFP4 W4A4's "
                         "weights)")


def notice(hf: Dict[str, Any], where: str = "DIR") -> Optional[str]:
    """The line :func:`load` prints for what of ``config.json`` it ignores (non-zero dropouts, W4A4's activation
    scales), or None."""
    shown = ", ".join(f"{k}={v}" for k, v in hf.items() if (k.endswith("dropout") or k.endswith("pdrop"))
                      and isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0)
    parts = [f"{shown} ignored: this model has no dropout (it trains without)"] if shown else []
    groups = (hf.get("quantization_config") or {}).get("config_groups") or {}
    if any(isinstance(g, dict) and g.get("input_activations") for g in groups.values()):
        parts.append("quantization_config quantizes the Linear inputs (W4A4): their input_global_scale are not "
                     "read (this run computes its own activation scales)")
    return f"train.init_from={where}: config.json {'; '.join(parts)}" if parts else None


def model_values(hf: Dict[str, Any], where: str = "DIR") -> Tuple[Dict[str, Any], Dict[str, str]]:
    """``(values, names)``: the ``model`` keys a Llama ``config.json`` defines, and their names there. Raises
    ConfigError: a feature this model lacks (architecture, biases, rope scaling, activation, head size, format)."""
    if hf.get("model_type") != "llama":
        _fail(where, f"config.json model_type={hf.get('model_type')!r}: only Llama checkpoints ('llama') are read")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # one function under two names
        _fail(where, f"config.json hidden_act={hf.get('hidden_act')!r}: this model has hidden_act='silu'")
    for key, want in (("attention_bias", False), ("mlp_bias", False), ("partial_rotary_factor", 1.0)):
        if hf.get(key, want) != want:
            _fail(where, f"config.json {key}={hf.get(key)!r}: this model has {key}={want!r}")
    count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not count(hf.get(key)):
            _fail(where, f"config.json {key}={hf.get(key)!r}: expected a positive integer")
    if hf.get("num_key_value_heads") is not None and not count(hf["num_key_value_heads"]):
        _fail(where, f"config.json num_key_value_heads={hf['num_key_value_heads']!r}: expected a positive integer")
    if not isinstance(hf.get("tie_word_embeddings") or False, bool):  # null: transformers' false
        _fail(where, f"config.json tie_word_embeddings={hf['tie_word_embeddings']!r}: expected true or false")
    eps = hf.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        _fail(where, f"config.json rms_norm_eps={eps!r}: expected a number")
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, d // heads) or d % heads:
        _fail(where, f"config.json head_dim={hf.get('head_dim')} with hidden_size={d}, num_attention_heads={heads}: "
                     "this model's head size is hidden_size / num_attention_heads")
    _check_quantization(hf, where)
    theta, scaling = _rope(hf, where)
    values = {k: hf[_HF_KEYS[k]] for k in ("vocab", "d_model", "mlp_hidden", "layers", "heads")}
    values.update(kv_heads=hf.get("num_key_value_heads") or heads, rope_theta=theta, rope_scaling=scaling,
                  norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", 0)))
    return values, dict(_HF_KEYS, rope_scaling="rope_parameters" if hf.get("rope_parameters") else "rope_scaling")


def _agree(where: str, values: Dict[str, Any], names: Dict[str, str], model: Dict[str, Any]) -> None:
    """Raises ConfigError naming the first of ``model``'s keys (:func:`model_values`' keys) that differs from
    ``values``, the checkpoint ``where``'s: ``kv_heads`` 0 is the heads' count, a mapping for ``rope_scaling`` the
    fields it sets."""
    shown = lambda v: json.dumps(dataclasses.asdict(v)) if isinstance(v, RopeScaling) else repr(v)
    for key, have in model.items():
        want = values[key]
        if key == "rope_scaling" and isinstance(have, dict) and want is not None:  # fields set alone
            for field, value in have.items():
                if getattr(want, field, None) != value:
                    raise ConfigError(f"model.rope_scaling.{field}={value!r}: train.init_from={where} has "
                                      f"{names[key]}.{field}={getattr(want, field, None)!r} in its config.json")
        elif (model.get("heads", values["heads"]) if key == "kv_heads" and have == 0 else have) != want:
            raise ConfigError(f"model.{key}={shown(have)}: train.init_from={where} has {names[key]}={shown(want)} "
                              "in its config.json")


def resolve_config(cfg: Config, given: Optional[set] = None) -> Config:
    """``cfg`` with the model shape of ``cfg.train.init_from``'s config.json: the ``model`` keys in ``given`` (explicit
    ``section.key`` names; None: all) must agree with it, the others are taken from it. Needs no JAX. Raises
    ConfigError: the first key that differs, or a checkpoint this model cannot represent."""
    where = cfg.train.init_from
    if not where:
        return cfg
    values, names = model_values(read_hf_config(where), where)
    have = {k: getattr(cfg.model, k) for k in values if given is None or f"model.{k}" in given}
    _agree(where, values, names, have)
    take = {k: v for k, v in values.items() if k not in have}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **take)) if take else cfg


def load_config(path: Optional[str], overrides: Sequence[str] = (), init_from: Optional[str] = None) -> Config:
    """:func:`train.config.load_config` of a run that may start from a checkpoint (``train.init_from``, or
    ``init_from``: ``--init-from``): ``overrides``' model keys must agree with its config.json (a contradiction is
    named before the rules it would break), whose model keys then replace the file's before any rule across sections
    is checked (``nvfp4.keep_last_blocks`` against the checkpoint's layers). Needs no JAX."""
    def checkpoint_model(folder, given):
        values, names = model_values(read_hf_config(folder), folder)
        _agree(folder, values, names, {k: v for k, v in given.items() if k in values})
        return values

    return config_lib.load_config(path, overrides, init_from=init_from, checkpoint_model=checkpoint_model)


def check_tokens(cfg: Config) -> None:
    """A run from ``train.init_from`` on a token file trains the checkpoint's embedding rows on the file's ids:
    both must come from one tokenizer, which the export ships. Raises ConfigError: the token file's tokenizer
    (recorded by ``train.prepare``, or its tokenizer file) is not the checkpoint's ``tokenizer.json``, or either
    cannot be known (a checkpoint with only ``tokenizer.model``, a sidecar that names no tokenizer)."""
    if not cfg.train.init_from or cfg.data.source != "tokens":
        return
    from train import data as data_lib
    where, fix = cfg.train.init_from, f"python -m train.prepare --tokenizer {cfg.train.init_from}"
    if not has_tokenizer(where):
        return  # the export ships the token file's tokenizer
    path = os.path.join(where, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(f"train.init_from={where}: has a tokenizer.model but no tokenizer.json, so data.path's ids "
                          "cannot be checked against the tokenizer its export ships; put the tokenizer.json "
                          "data.path was prepared with into it")
    meta = data_lib.read_token_header(cfg.data.path)
    recorded = meta.get("tokenizer_sha256")
    if recorded is None and (beside := data_lib.tokenizer_file(cfg.data.path, meta)):  # an older sidecar
        recorded = _tokenizer_sha256(beside, "data.path's tokenizer")
    if recorded is None:
        raise ConfigError(f"data.path={cfg.data.path!r}: its sidecar names no tokenizer, so its ids cannot be checked "
                          f"against train.init_from={where}'s tokenizer.json; prepare it again with {fix}")
    own = _tokenizer_sha256(path, f"train.init_from={where}")
    if own != recorded:
        raise ConfigError(f"data.path={cfg.data.path!r}: its tokens were made with another tokenizer (sha256 "
                          f"{recorded[:12]}) than train.init_from={cfg.train.init_from}'s tokenizer.json ({own[:12]}): "
                          f"the checkpoint's embedding would read other ids; prepare the data with {fix}")


def has_tokenizer(folder: str) -> bool:
    """Whether the checkpoint ``folder`` holds a tokenizer (``tokenizer.json`` or ``tokenizer.model``)."""
    return any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer.model"))


def _tokenizer_sha256(path: str, what: str) -> str:
    """The sha256 train.prepare records of the tokenizer file ``path`` (:func:`train.prepare.tokenizer_sha256`)."""
    from tokenizers import Tokenizer

    from train.prepare import tokenizer_sha256
    try:
        return tokenizer_sha256(Tokenizer.from_file(path).to_str(pretty=True))
    except Exception as e:  # noqa: BLE001 - the tokenizers package's parse errors
        raise ConfigError(f"{what}: cannot read {os.path.basename(path)}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def hf_config(cfg: Config, **kw) -> Dict[str, Any]:
    """The ``config.json`` of ``cfg.model`` that :func:`model_values` reads back (``kw``: ``llama_config``'s)."""
    from train.model import llama_config
    model = {k: getattr(cfg.model, k) for k in (*_HF_KEYS, "rope_scaling")}  # kv_heads 0: llama_config's heads
    return llama_config(**model, **{"max_position_embeddings": cfg.model.seq_len, **kw})


def tokenizer_files(tokenizer: Optional[str], max_positions: int, *, eos_id: Optional[int] = None,
                    bos_id: Optional[int] = None) -> Dict[str, Any]:
    """An export's ``files=``: a folder's :data:`TOKENIZER_FILES`, or a ``tokenizer.json`` and (unless there is one) a
    ``tokenizer_config.json``: documents end with token ``eos_id`` (else ``<|endoftext|>``), start with ``bos_id``."""
    if tokenizer and os.path.isdir(tokenizer):
        files = {n: os.path.join(tokenizer, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer, n))}
    else:
        files = {"tokenizer.json": tokenizer} if tokenizer else {}
    if "tokenizer.json" in files and "tokenizer_config.json" not in files:
        tok = None
        if eos_id is not None or bos_id is not None:
            from tokenizers import Tokenizer
            try:
                tok = Tokenizer.from_file(files["tokenizer.json"])
            except Exception:  # noqa: BLE001 - a tokenizer this package cannot read is copied as it is
                pass
        # An id may be a list (Llama 3.x Instruct ends on any of several): the first names the token.
        ids = (i[0] if isinstance(i, (list, tuple)) and i else i for i in (eos_id, bos_id))
        eos, bos = (tok.id_to_token(int(i)) if tok is not None and isinstance(i, int) else None for i in ids)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos or "<|endoftext|>",
                  "model_max_length": max_positions}
        if bos:
            config.update(bos_token=bos, add_bos_token=True)
        files["tokenizer_config.json"] = json.dumps(config, indent=2).encode()
    return files


def _library(cfg: Config, f, *args, **kw):
    """``f(*args, **kw)`` (:mod:`jax_nvfp4.hf`) with its refusals as ConfigError: ``"DIR: ..."`` as
    ``train.init_from=DIR: ...``, scales that differ inside a tile as ``nvfp4.block=2d``'s, and blocks a quantizer
    left plain next to the NVFP4 ones with the ``nvfp4.keep_*_blocks`` that reads them (``cfg``: the run's)."""
    from jax_nvfp4.export import ExportError
    from jax_nvfp4.hf import MixedLayersError, TileScalesError
    try:
        return f(*args, **kw)
    except TileScalesError as e:
        raise ConfigError(f"nvfp4.block=2d: {e.module}'s NVFP4 scales (one per 16 inputs of each output) differ "
                          "inside a 16x16 tile; read it with nvfp4.block=1d") from None
    except MixedLayersError as e:
        n = sorted({int(m.group(1)) for p in e.plain if (m := re.search(r"\.layers\.(\d+)\.", p))})
        first, last, layers = cfg.nvfp4.keep_first_blocks, cfg.nvfp4.keep_last_blocks, cfg.model.layers
        if n == list(range(first, first + len(n))):
            fix = f"; keep those blocks in bf16: nvfp4.keep_first_blocks={first + len(n)}"
        elif n == list(range(layers - last - len(n), layers - last)):
            fix = f"; keep those blocks in bf16: nvfp4.keep_last_blocks={last + len(n)}"
        else:
            fix = (" (this model keeps only its first and last blocks in bf16: nvfp4.keep_first_blocks and "
                   "keep_last_blocks)")
        raise ConfigError(f"train.init_from={e}{fix}") from None
    except ExportError as e:
        raise ConfigError(f"train.init_from={e}") from None


def _model(trainer) -> Dict[str, Any]:
    """The :func:`jax_nvfp4.hf.plan_hf` / ``load_hf`` arguments that describe ``trainer``'s Llama and its state."""
    from train.model import HF_NAMES
    top = dict(HF_NAMES.top)
    return dict(names=HF_NAMES, abstract_params=trainer.abstract_params, abstract_state=trainer.abstract_state,
                mesh=trainer.mesh, model="this Llama",
                tied=(top["head/kernel"], top["embed"]) if trainer.cfg.model.tie_embeddings else None)


def plan(directory: str, trainer, devices: Optional[Sequence] = None) -> Dict[Any, list]:
    """``{device: [jax_nvfp4.export.Read]}``: what each of ``devices`` (default: this process's; a process reads their
    union) reads to build ``trainer``'s state from ``directory``, from the headers and abstract state alone
    (:func:`jax_nvfp4.hf.plan_hf`: nothing is read)."""
    from jax_nvfp4.hf import plan_hf
    return _library(trainer.cfg, plan_hf, directory, devices=devices, **_model(trainer))


def load(directory: str, trainer, *, checkpoint: Any = None) -> Tuple[Any, Any]:
    """``(params, opt_state)`` of ``trainer`` (``train.programs.build(cfg, mesh, init=False)``) from ``directory``,
    in its shardings, on every process (:func:`jax_nvfp4.hf.load_hf`); read through ``checkpoint`` (a
    :class:`jax_nvfp4.export.Safetensors` of it: its ``reads``) if given. All is checked and read before anything
    compiles; :func:`notice` is printed (process 0). Raises ConfigError (naming the key or tensor): a checkpoint that
    does not fit the run's model or NVFP4 settings."""
    import jax
    from jax_nvfp4.hf import load_hf

    cfg = dataclasses.replace(trainer.cfg, train=dataclasses.replace(trainer.cfg.train, init_from=directory))
    resolve_config(cfg, given=None)  # every model key must agree with config.json
    line = notice(read_hf_config(directory), directory)

    def shown():  # once every check has passed, before the weights are read
        if line and jax.process_index() == 0:
            print(line, flush=True)

    return _library(trainer.cfg, load_hf, checkpoint if checkpoint is not None else directory, **_model(trainer),
                    param_shardings=trainer.param_shardings, state_shardings=trainer.state_shardings,
                    policy=trainer.policy, init=trainer.tx.init, on_checked=shown)
