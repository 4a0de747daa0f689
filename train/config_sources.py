"""The sources a config is read from, as plain nested dicts ``{section: {key: value}}``.

* YAML files (``base: other.yaml`` inherits, relative to the file; ``1e-3`` is a float as in
  YAML 1.2; a key given twice is an error);
* gin files (``ModelConfig.layers = 2``; a key bound twice is an error);
* overrides ``section.key=value``, each value parsed as YAML.

What the keys mean and which values are valid is :mod:`train.config`'s business; this module
only reads and merges. No jax here either.
"""

import os
import re
from typing import Any, Mapping, Sequence

import yaml

from train.config_errors import ConfigError, short, suggest

__all__ = ["override_keys", "read"]


# -- YAML ---------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float.

    PyYAML implements YAML 1.1, where a float needs a dot (``1.0e-3``), so ``lr: 1e-3`` would
    arrive as the string "1e-3" and fail the type check. Same resolver as YAML 1.2 core.
    A key given twice in one mapping is an error (YAML says keys are unique; PyYAML would
    keep the last value silently).
    """

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
            except TypeError:
                continue  # an unhashable key: construct_mapping reports it
            if not dup:
                seen[key] = key_node.start_mark.line + 1
            else:
                first = seen[key]
                raise ConfigError(f"{self.name}: duplicate key {key!r} on line {key_node.start_mark.line + 1} "
                                  f"(first on line {first})")
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+][0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _yaml_load(text: str, where: str) -> Any:
    loader = _Loader(text)
    loader.name = where
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: invalid YAML: {e}") from None
    finally:
        loader.dispose()


def _merge(base: Mapping[str, Any], top: Mapping[str, Any], depth: int = 3) -> dict[str, Any]:
    """Merge of sections and of mapping-valued keys (``model.rope_scaling``): keys of ``top``
    replace keys of ``base``; lists, scalars and null are replaced."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for k, v in top.items():
        if depth > 1 and isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v, depth - 1)
        else:
            out[k] = dict(v) if isinstance(v, Mapping) else v
    return out


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None


def _read_yaml(path: str, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    real = os.path.realpath(path)
    if real in chain:
        raise ConfigError(f"{path}: 'base' chain loops back to itself")
    raw = _yaml_load(_read_text(path), path)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    raw = dict(raw)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: expected a file name, got {short(base)}")
    base_path = os.path.join(os.path.dirname(path), base)
    return _merge(_read_yaml(base_path, chain + (real,)), raw)


# -- gin ----------------------------------------------------------------------------------------

_GIN_COLLECTORS: dict[str, Any] = {}


def _gin_collectors(names: Sequence[str]) -> dict[str, Any]:
    """One gin configurable per section, named like its class (``ModelConfig``) in module
    ``train.config``.

    Each collector takes ``**kwargs`` and returns them, so gin only parses and stores the
    bindings while unknown keys get the same checks and did-you-mean hints as YAML keys.
    Registered once per process: gin's registry is global and rejects duplicates.
    """
    import gin

    for name in names:
        if name not in _GIN_COLLECTORS:
            def collect(**kwargs):
                return kwargs
            collect.__name__ = name
            _GIN_COLLECTORS[name] = gin.external_configurable(collect, name=name, module="train.config")
    return {name: _GIN_COLLECTORS[name] for name in names}


def _gin_duplicates(path: str, text: str) -> None:
    """Raise ConfigError for a key bound twice in the gin ``text`` (gin keeps the last binding
    silently, as PyYAML would for a repeated YAML key)."""
    import gin
    from gin import config_parser

    seen: dict[tuple, int] = {}
    try:
        statements = list(config_parser.ConfigParser(text, gin.config.ParserDelegate(skip_unknown=True)))
    except Exception:  # noqa: BLE001 - a syntax error: gin.parse_config reports it with its line
        return
    for st in statements:
        if not isinstance(st, config_parser.BindingStatement):
            continue
        # "train.config.ModelConfig" and "ModelConfig" name the same configurable.
        key = (st.scope, st.selector.rsplit(".", 1)[-1], st.arg_name)
        line = st.location.line_num
        if key in seen:
            name = ".".join(k for k in key if k)
            raise ConfigError(f"{path}: {name} is bound twice, on line {seen[key]} and line {line}; "
                              "keep one (gin would silently use the last)")
        seen[key] = line


def _read_gin(path: str, sections: Mapping[str, str]) -> dict[str, Any]:
    """``{section: bindings}`` from the gin file ``path``; ``sections`` maps each configurable's
    name to its section."""
    import gin

    names = list(sections)

    collectors = _gin_collectors(names)
    text = _read_text(path)
    _gin_duplicates(path, text)
    # Bindings are global gin state: start clean and leave clean so loads do not leak.
    gin.clear_config()
    try:
        gin.parse_config(text)
        return {sections[name]: dict(fn()) for name, fn in collectors.items()}
    except ConfigError:
        raise
    except Exception as e:  # gin raises ValueError / SyntaxError with multi-line messages
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        match = re.search(r"No configurable matching '([^']+)'", first)
        if match:
            first = (f"unknown gin configurable {match.group(1)!r}"
                     f"{suggest(match.group(1), names)}; use one of {', '.join(names)}")
        raise ConfigError(f"{path}: {first}") from None
    finally:
        gin.clear_config()


# -- overrides and loading ----------------------------------------------------------------------


def _overrides_to_dict(overrides: Sequence[str]) -> dict[str, dict[str, Any]]:
    if isinstance(overrides, str):
        overrides = [overrides]  # a lone string would otherwise be split into characters
    out: dict[str, dict[str, Any]] = {}
    for text in overrides:
        key, sep, value = str(text).partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) not in (2, 3) or not all(parts):
            raise ConfigError(f"override {text!r}: expected section.key=value (or section.key.field=value for "
                              "a mapping such as model.rope_scaling), e.g. model.layers=4")
        value = _yaml_load(value, f"override {key.strip()}")
        section = out.setdefault(parts[0], {})
        if len(parts) == 2:
            section[parts[1]] = value
        else:  # one field of a mapping-valued key; the others keep what the config had
            mapping = section.get(parts[1])
            section[parts[1]] = {**(mapping if isinstance(mapping, Mapping) else {}), parts[2]: value}
    return out


def override_keys(overrides: Sequence[str]) -> set[str]:
    """The ``section.key`` names ``overrides`` set: on the command line, what a checkpoint's
    own config must agree with (``train.init_from``) rather than replace."""
    return {f"{section}.{key}" for section, values in _overrides_to_dict(overrides).items() for key in values}


def read(path: str | os.PathLike | None, overrides: Sequence[str], gin_sections: Mapping[str, str],
         base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (default: nothing), then the file ``path`` (YAML, or gin whose configurables
    ``gin_sections`` maps to sections), then ``overrides``, merged section-wise."""
    raw: dict[str, Any] = dict(base or {})
    if path is not None:
        path = os.fspath(path)
        ext = os.path.splitext(path)[1].lower()
        if ext in (".yaml", ".yml"):
            raw = _merge(raw, _read_yaml(path))
        elif ext == ".gin":
            raw = _merge(raw, _read_gin(path, gin_sections))
        else:
            raise ConfigError(f"config file {path}: unknown extension {ext!r}; use .yaml, .yml or .gin")
    return _merge(raw, _overrides_to_dict(overrides))
