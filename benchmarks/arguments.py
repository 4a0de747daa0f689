"""The benchmarks' command-line arguments, checked the way the training CLI checks its config:
a bad argument is ONE line on stderr naming the flag and its value, exit status 2, before
anything is compiled, trained or written::

    error: --steps 0: must be a positive integer
    error: --seeds a,b: 'a' is not an integer
    error: --mesh data:0: expected gb200:RACKS or data:N (RACKS, N >= 1), e.g. gb200:2 or data:16
    error: --against nosuchrev: not a commit of this repository (git rev-parse --verify)

:class:`Parser` is an ``argparse.ArgumentParser`` whose errors (its own: an unknown option, a
missing value, a choice not offered; and those of the ``type=`` validators below) are that
line. The validators are shared by every subcommand; each returns the parsed value or raises
``argparse.ArgumentTypeError("VALUE: why")``, which the parser prefixes with the flag.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from typing import Callable, Dict, List, NoReturn, Optional, Sequence

from train.config_errors import suggest

from benchmarks.common import ROOT

__all__ = ["Parser", "one_line", "show", "int_at_least", "positive_int", "nonnegative_int", "positive_float",
           "int_list", "seed_list", "name_list", "unknown_name", "lengths_map", "seed_ranges", "shard", "git_revision",
           "output_dir", "output_file", "checked", "refuse"]


_QUOTES = "'\""  # around the values argparse's own messages quote


def show(text: str) -> str:
    """A value as the error line shows it: as typed, quoted when empty or holding spaces."""
    return text if text and not any(c.isspace() for c in text) else repr(text)


def one_line(message: str, options: Sequence[str] = ()) -> str:
    """argparse's error ``message`` as ``--flag VALUE: why`` (one line); ``options``: the
    parser's option strings, for a did-you-mean on an unknown one."""
    message = " ".join(str(message).split())
    m = re.fullmatch(r"argument (\S+): (.*)", message)
    if m:
        flag, why = m.group(1).split("/")[-1], m.group(2)
        c = re.fullmatch(r"invalid choice: (.*?) \(choose from (.*)\)", why)
        if c:
            value = c.group(1).strip(_QUOTES)
            return f"{flag} {show(value)}: must be one of {c.group(2)}"
        t = re.fullmatch(r"invalid (\w+) value: (.*)", why)  # a plain type= (int, float) that failed
        if t:
            kind = {"int": "an integer", "float": "a number"}.get(t.group(1), t.group(1))
            return f"{flag} {show(t.group(2).strip(_QUOTES))}: expected {kind}"
        if why == "expected one argument":
            return f"{flag}: expects a value"
        e = re.fullmatch(r"ignored explicit argument (.*)", why)
        if e:
            return f"{flag}={e.group(1).strip(_QUOTES)}: {flag} takes no value"
        return f"{flag} {why}"
    u = re.fullmatch(r"unrecognized arguments: (.*)", message)
    if u:
        first = u.group(1).split()[0]
        if first.startswith("-"):
            name = first.split("=")[0]
            return f"{name}: unknown option" + (suggest(name, options) or "; see --help")
        return f"{u.group(1)}: unexpected argument{'s' if ' ' in u.group(1) else ''}; see --help"
    r = re.fullmatch(r"the following arguments are required: (.*)", message)
    if r:
        return f"{r.group(1)}: required"
    return message


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``error: --flag VALUE: why`` (see
    :func:`one_line`), and exit 2: no usage block, nothing else on stderr."""

    def __init__(self, *args, **kwargs):
        self.option_names: List[str] = []  # before the base class adds --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        self.option_names += [n for n in names if n.startswith("--")]
        return super().add_argument(*names, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {one_line(message, self.option_names)}\n")


def _fail(text: str, why: str) -> NoReturn:
    raise argparse.ArgumentTypeError(f"{show(text)}: {why}")


def _int(text: str, whole: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        _fail(whole, f"{text.strip()!r} is not an integer" if text != whole else "expected an integer")


def int_at_least(minimum: int, why: str = "", *, maximum: Optional[int] = None,
                 why_max: str = "") -> Callable[[str], int]:
    """A ``type=`` for an integer >= ``minimum`` (and <= ``maximum``); ``why``, ``why_max``:
    what each bound is for."""

    def check(text: str) -> int:
        n = _int(text, text)
        if n < minimum:
            bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            _fail(text, f"must be {bound}" + (f" ({why})" if why else ""))
        if maximum is not None and n > maximum:
            _fail(text, f"must be at most {maximum}" + (f" ({why_max})" if why_max else ""))
        return n

    check.__name__ = f"int_at_least_{minimum}"
    return check


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        _fail(text, "expected a number")
    if not (math.isfinite(x) and x > 0):
        _fail(text, "must be a positive finite number")
    return x


def int_list(minimum: int = 1, empty: bool = False) -> Callable[[str], List[int]]:
    """A ``type=`` for comma-separated distinct integers >= ``minimum`` (``empty``: none at all
    is allowed, e.g. a default of no seeds)."""

    def check(text: str) -> List[int]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        if not parts and not empty:
            _fail(text, "expected comma-separated integers")
        values = []
        for part in parts:
            n = _int(part, text)
            if n < minimum:
                _fail(text, f"{n} is not " + ("a positive integer" if minimum == 1 else f"an integer >= {minimum}"))
            if n in values:
                _fail(text, f"{n} given twice")
            values.append(n)
        return values

    check.__name__ = "int_list"
    return check


seed_list = int_list(minimum=0)


def unknown_name(name: str, choices: Sequence[str], what: str) -> Optional[str]:
    """Why ``name`` is not one of ``choices`` (``what``: e.g. "model size"), or None."""
    if name in choices:
        return None
    return f"unknown {what} {name!r}{suggest(name, list(choices))}; {what}s are {', '.join(choices)}"


def name_list(choices: Sequence[str], what: str) -> Callable[[str], List[str]]:
    """A ``type=`` for comma-separated distinct names out of ``choices``."""

    def check(text: str) -> List[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        if not names:
            _fail(text, f"expected comma-separated {what}s out of {', '.join(choices)}")
        for i, name in enumerate(names):
            why = unknown_name(name, choices, what)
            if why:
                _fail(text, why)
            if name in names[:i]:
                _fail(text, f"{name} given twice")
        return names

    check.__name__ = "name_list"
    return check


def git_revision(text: str) -> str:
    """A ``type=`` for a commit of this repository (``git rev-parse --verify REV^{commit}``);
    returns ``text`` as given."""
    if text.startswith("-"):
        _fail(text, "not a commit of this repository (git rev-parse --verify)")
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{text}^{{commit}}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        _fail(text, f"git rev-parse could not run ({type(e).__name__})")
    if out.returncode != 0:
        _fail(text, "not a commit of this repository (git rev-parse --verify)")
    return text


def output_dir(text: str) -> str:
    """A ``type=`` for a folder results go into: refused when its name is empty, a file is in the way, or the
    nearest folder that exists is not writable (nothing is made here: :func:`make_output_dir` does, before the
    work)."""
    if not text:
        _fail(text, "an empty path")
    if os.path.exists(text) and not os.path.isdir(text):
        _fail(text, "exists and is not a folder")
    ancestor = os.path.abspath(text)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        _fail(text, f"is under {ancestor}, which is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        _fail(text, f"cannot be written ({ancestor} is not writable)")
    return text


def make_output_dir(path: str) -> None:
    """Make the results folder ``path`` before any work, or end in one line, exit 2."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        print(f"error: --out {show(path)}: cannot be made: {e.strerror or e}", file=sys.stderr)
        raise SystemExit(2) from None


def output_file(text: str) -> str:
    """A ``type=`` for a file a report goes into: refused when it is a folder."""
    if os.path.isdir(text):
        _fail(text, "is a folder, not a file")
    return text


def shard(text: str) -> str:
    """A ``type=`` for ``I/N``: worker I (0-based) of N."""
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not int(m.group(1)) < int(m.group(2)):
        _fail(text, "expected I/N with 0 <= I < N")
    return text


def checked(parser: Parser, flag: str, check: Callable[[str], object], text: str):
    """``check(text)`` for an argument checked after parsing (its rule depends on another
    one); a failure is the parser's one-line error naming ``flag``."""
    try:
        return check(text)
    except argparse.ArgumentTypeError as e:
        parser.error(f"{flag} {e}")


def refuse(flag: str, value, why: str) -> NoReturn:
    """An error found after parsing (arguments checked together): the same one line, exit 2."""
    print(f"error: {flag} {show(str(value))}: {why}", file=sys.stderr)
    raise SystemExit(2)


def lengths_map(choices: Sequence[str]) -> Callable[[str], Dict[str, List[int]]]:
    """A ``type=`` for ``SIZE=STEPS[:STEPS...],...`` (training lengths per model size)."""

    def check(text: str) -> Dict[str, List[int]]:
        out: Dict[str, List[int]] = {}
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            _fail(text, "expected SIZE=STEPS[:STEPS...],..., e.g. tiny=20:40,default=40")
        for part in parts:
            size, eq, steps = part.partition("=")
            if not eq:
                _fail(text, f"{part!r}: expected SIZE=STEPS[:STEPS...], e.g. tiny=20:40")
            why = unknown_name(size.strip(), choices, "model size")
            if why:
                _fail(text, why)
            values = [_int(x, text) for x in steps.split(":")] if steps.strip() else []
            if not values or min(values) < 1 or len(set(values)) < len(values):
                _fail(text, f"{part!r}: the lengths must be distinct positive integers")
            out[size.strip()] = values
        return out

    check.__name__ = "lengths_map"
    return check


def seed_ranges(choices: Sequence[str], what: str = "size") -> Callable[[str], Dict[str, List[int]]]:
    """A ``type=`` for ``NAME=FIRST-LAST,...``: per name out of ``choices``, the seeds FIRST..LAST
    (at least two: an interval of their mean needs two)."""

    def check(text: str) -> Dict[str, List[int]]:
        out: Dict[str, List[int]] = {}
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            _fail(text, f"expected {what.upper()}=FIRST-LAST,..., e.g. {choices[-1]}=0-7")
        for part in parts:
            m = re.fullmatch(r"([^=\s]+)=(\d+)-(\d+)", part)
            if not m:
                _fail(text, f"{part!r}: expected {what.upper()}=FIRST-LAST (seeds FIRST to LAST), "
                            f"e.g. {choices[-1]}=0-7")
            name, first, last = m.group(1), int(m.group(2)), int(m.group(3))
            why = unknown_name(name, choices, what)
            if why:
                _fail(text, why)
            if name in out:
                _fail(text, f"{name} given twice")
            if last <= first:
                _fail(text, f"{part!r}: LAST must be above FIRST (a 95% interval needs two seeds or more)")
            out[name] = list(range(first, last + 1))
        return out

    check.__name__ = "seed_ranges"
    return check
