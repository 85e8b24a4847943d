"""Command-line options generated from a frozen config dataclass, and back.

``add_config_arguments(parser, Config)`` adds one option per field; ``config_from_args(Config,
args)`` builds the dataclass from the parsed namespace (fields not given keep the dataclass's
defaults); ``config_to_argv(cfg)`` is the reverse: the argv that gives ``cfg`` back. The commands
``tokenbatch tune``, ``tokenbatch train`` and ``tokenbatch evaluate-agent`` (and the scripts
tuning/optuna_search.py, agents/train_ppo.py, agents/evaluate_agent.py that call them) are built so.

What a field's options are, from its type annotation and ``dataclasses.field(metadata=...)``:

* flag: ``--field-name``; ``metadata["flags"]`` replaces it (the spellings, e.g. ``("--trials",
  "--n-trials")`` or ``("--agent",)``);
* help: ``metadata["help"]``, with ``(default X)`` appended unless the text names its default (or
  the default is None or empty);
  ``metadata["metavar"]`` optional;
* ``bool``: ``--x`` / ``--no-x``; with ``metadata["sets"]`` only the given flags, each setting the
  field to that value (``--quiet`` sets ``progress`` False, ``--no-warm-start`` ``warm_start``
  False);
* ``int`` / ``float`` / ``str``, each possibly ``Optional``: ``metadata["none"]`` is the word meaning
  None (``"all"``), ``metadata["min"]`` a lower bound (ints), ``metadata["what"]`` what a float must
  be in the error line (default "a number");
* ``tuple[X, ...]``: comma-separated values (at least one, unless ``metadata["allow_empty"]`` or an
  empty default); with ``metadata["append"]`` a repeatable flag, one value each;
* ``metadata["parse"]``: ``parse(text, flag) -> value`` replaces the parsing above;
* ``metadata["required"]``: the option must be given;
* ``metadata["type"]``: the type the options are generated for, when the annotation is wider
  (``Any``);
* a field whose type is itself a config dataclass, with ``metadata["options"]`` (sub-field name ->
  that sub-field's metadata, as above): one option per named sub-field, the sub-field's default
  read from the field's default instance, shown under ``metadata["group"]`` (an argument group); the
  parsed sub-fields ``dataclasses.replace`` the default instance (``TrainConfig.env`` is the env's
  ``TokenBatchConfig``, its training options the env's own fields).

Values are parsed here, not by argparse types, so that each bad value gives one line naming its
flag (``--k: must be an integer, got 'x'``) as a ``ConfigError``: the ``tokenbatch`` command prints
it as one line and exits 2. What the values mean (ranges between fields, names of policies, ...)
stays the dataclass's own ``__post_init__`` check.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import types
import typing
from typing import Any, Optional

from .errors import ConfigError

__all__ = ["add_config_arguments", "config_flags", "config_from_args", "config_kwargs", "config_to_argv", "field_flags",
           "option", "parse_int", "parse_float"]


def option(default: Any = dataclasses.MISSING, help: str = "", **meta) -> Any:  # noqa: A002 - argparse's name
    """``dataclasses.field(default=..., metadata={"help": help, **meta})`` (a tuple default is kept
    as a default, not a factory: tuples are immutable)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


# ------------------------------------------------------------------------------ field kinds
@dataclasses.dataclass(frozen=True)
class _Kind:
    base: type                 # bool, int, float, str (the element type for tuples)
    optional: bool             # None allowed
    many: bool                 # a tuple of base


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _kind(cls, f) -> _Kind:
    t = f.metadata.get("type") or _hints(cls)[f.name]
    optional = False
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported type {t!r}")
        optional, t = True, args[0]
        origin = typing.get_origin(t)
    if t is tuple or origin is tuple:
        args = typing.get_args(t)
        base = args[0] if args else str
        if base not in (int, float, str) or (len(args) == 2 and args[1] is not Ellipsis) or len(args) > 2:
            raise TypeError(f"{cls.__name__}.{f.name}: use tuple[int | float | str, ...], got {t!r}")
        return _Kind(base, optional, True)
    if t not in (bool, int, float, str):
        raise TypeError(f"{cls.__name__}.{f.name}: unsupported type {t!r}")
    return _Kind(t, optional, False)


def field_flags(f: dataclasses.Field) -> tuple:
    """The option strings of a field (``metadata["flags"]`` or ``--field-name``)."""
    return tuple(f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),))


def _fields(cls, exclude=()) -> list:
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"{cls!r} is not a dataclass")
    return [f for f in dataclasses.fields(cls) if f.init and f.name not in exclude]


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One option: a field, or a sub-field of a nested config field (``path`` = (field, sub-field)).
    Has the attributes of a ``dataclasses.Field`` that the functions below read."""

    path: tuple
    metadata: Any
    default: Any
    kind: _Kind
    group: Optional[str] = None

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def default_factory(self):
        return dataclasses.MISSING


def config_flags(cls, exclude=()) -> dict:
    """Option name (field or nested sub-field) -> its option strings, in help order."""
    return {e.name: field_flags(e) for e in _entries(cls, exclude)}


def _nested(cls, f) -> Optional[type]:
    """The config dataclass a field holds when its options are its sub-fields', else None."""
    t = _hints(cls)[f.name]
    return t if "options" in f.metadata and dataclasses.is_dataclass(t) and isinstance(t, type) else None


def _entries(cls, exclude=()) -> list:
    """The options of ``cls`` in order: one per field, the named sub-fields of a nested field in its
    place (a name used twice is a TypeError)."""
    out = []
    for f in _fields(cls, exclude):
        sub_cls = _nested(cls, f)
        if sub_cls is None:
            out.append(_Entry((f.name,), f.metadata, f.default if f.default is not dataclasses.MISSING
                              else _default(f), _kind(cls, f)))
            continue
        base, subs = _default(f), {g.name: g for g in dataclasses.fields(sub_cls)}
        for name, meta in f.metadata["options"].items():
            if name not in subs:
                raise TypeError(f"{cls.__name__}.{f.name}: {sub_cls.__name__} has no field {name!r}")
            probe = _Entry((f.name, name), meta, getattr(base, name), _Kind(str, False, False))
            out.append(dataclasses.replace(probe, kind=_kind(sub_cls, probe), group=f.metadata.get("group")))
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise TypeError(f"{cls.__name__}: an option name is used twice ({names})")
    return out


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:   # type: ignore[misc]
        return f.default_factory()                     # type: ignore[misc]
    return dataclasses.MISSING


# ------------------------------------------------------------------------------ value texts
def _text(v, kind: _Kind, f: dataclasses.Field) -> str:
    """A value as the option's text (what ``_parse`` reads back)."""
    if v is None:
        return f.metadata.get("none", "none")
    if kind.many:
        return ",".join(_text(x, _Kind(kind.base, False, False), f) for x in v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


def parse_int(text, flag: str, lo: Optional[int] = None, none: Optional[str] = None) -> Optional[int]:
    """An integer (``none``: the word meaning None), with one-line errors naming ``flag``."""
    t = str(text).strip()
    if none is not None and t.lower() == none:
        return None
    try:
        v = int(t)
    except ValueError:
        raise ConfigError(f"{flag}: must be an integer{f' or {none}' if none else ''}, got {text!r}") from None
    if lo is not None and v < lo:
        raise ConfigError(f"{flag}: must be >= {lo}, got {v}")
    return v


def parse_split(text, flag: str = "--pd") -> tuple:
    """A prefill:decode split ``Rp:Rd`` (integers >= 1), with a one-line error naming ``flag``."""
    import re
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
    if not m or min(int(m[1]), int(m[2])) < 1:
        raise ConfigError(f"{flag}: expected Rp:Rd, integers >= 1 (e.g. 3:5), got {text!r}")
    return int(m[1]), int(m[2])


def check_names(items, valid, flag: str, kind: str, unknown=ConfigError) -> tuple:
    """``items`` as a tuple when each is one of ``valid``, at least one and no duplicates; else one
    ``ConfigError`` naming ``flag`` (``unknown``: the error class for a name not in ``valid``)."""
    items = tuple(items)
    if not items:
        raise ConfigError(f"{flag}: need at least one; valid: {', '.join(valid)}")
    bad = [x for x in items if x not in valid]
    if bad:
        raise unknown(f"{flag}: unknown {kind} {bad[0]!r}; valid: {', '.join(valid)}")
    if len(set(items)) != len(items):
        raise ConfigError(f"{flag}: duplicates in {list(items)}")
    return items


def parse_float(text, flag: str, what: str = "a number", none: Optional[str] = None) -> Optional[float]:
    """A number (``float()``'s spellings, nan and inf included: ranges are the config's check)."""
    t = str(text).strip()
    if none is not None and t.lower() == none:
        return None
    try:
        return float(t)
    except ValueError:
        raise ConfigError(f"{flag}: must be {what}{f' or {none}' if none else ''}, got {text!r}") from None


def _parse_one(text, kind: _Kind, f: dataclasses.Field, flag: str):
    m = f.metadata
    if kind.base is int:
        return parse_int(text, flag, m.get("min"), m.get("none") if kind.optional else None)
    if kind.base is float:
        return parse_float(text, flag, m.get("what", "a number"), m.get("none") if kind.optional else None)
    if kind.optional and m.get("none") is not None and str(text).strip().lower() == m["none"]:
        return None
    return text


def _parse(value, kind: _Kind, f: dataclasses.Field, flag: str):
    """The field's value from the namespace's raw value (a string, or a list of them for append)."""
    m = f.metadata
    if "parse" in m:
        return m["parse"](value, flag)
    if not kind.many:
        return _parse_one(value, kind, f, flag)
    one = _Kind(kind.base, False, False)
    if m.get("append"):
        return tuple(_parse_one(x, one, f, flag) for x in value)
    items = [s.strip() for s in str(value).split(",") if s.strip()]
    if not items and not (m.get("allow_empty") or _default(f) == ()):
        raise ConfigError(f"{flag}: need at least one value (comma-separated)")
    out = []
    for s in items:
        if kind.base is str:
            out.append(s)
            continue
        try:
            out.append(int(s) if kind.base is int else float(s))
        except ValueError:
            what = "an integer" if kind.base is int else "a number"
            raise ConfigError(f"{flag}: {s!r} is not {what} (comma-separated values)") from None
        if kind.base is int and m.get("min") is not None and out[-1] < m["min"]:
            raise ConfigError(f"{flag}: must be >= {m['min']}, got {out[-1]}")
    return tuple(out)


# ------------------------------------------------------------------------------ parser
def _help(f, kind: _Kind) -> str:
    """The help text (argparse's %-escapes applied by the caller)."""
    h = f.metadata.get("help", "")
    if kind.base is bool and not kind.many:
        if "sets" in f.metadata or not isinstance(f.default, bool) or "default" in h.lower():
            return h
        flag = field_flags(f)[0]
        shown = flag if f.default else "--no-" + flag[2:]
        return f"{h} (default {shown})" if h else f"(default {shown})"
    d = _default(f)
    if (d is dataclasses.MISSING or d is None or d == () or f.metadata.get("required")
            or "default" in h.lower()):
        return h
    shown = _text(d, kind, f)
    return f"{h} (default {shown})" if h else f"(default {shown})"


def configure_command(parser, cls, description: str, epilog: str) -> None:
    """A command's parser from its config dataclass: the description, the epilog (shown as written)
    and one option per field (``add_config_arguments``)."""
    parser.description = description
    parser.epilog = epilog
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_config_arguments(parser, cls)


def add_config_arguments(parser, cls, *, exclude=()) -> None:
    """One option per field of the dataclass ``cls`` (not those in ``exclude``), in field order.
    Each option's namespace attribute is the field's (or sub-field's) name and is None when not given."""
    groups: dict = {}
    for e in _entries(cls, exclude):
        kind, flags, m = e.kind, field_flags(e), e.metadata
        target = parser if e.group is None else groups.setdefault(e.group, parser.add_argument_group(e.group))
        kw: dict = {"dest": e.name, "default": None}
        hp = _help(e, kind)
        if hp:
            kw["help"] = hp.replace("%", "%%")
        if kind.base is bool and not kind.many:
            if "sets" in m:
                target.add_argument(*flags, action="store_const", const=bool(m["sets"]), **kw)
            else:
                target.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
            continue
        if m.get("metavar"):
            kw["metavar"] = m["metavar"]
        if m.get("required"):
            kw["required"] = True
        target.add_argument(*flags, action="append" if m.get("append") else "store", **kw)


def config_kwargs(cls, args, *, exclude=()) -> dict:
    """The dataclass keywords of the options given in ``args`` (parsed, one-line ConfigError naming
    the flag for a bad value); fields whose option was not given are left out (their defaults). A
    nested field is its default instance with the given sub-fields replaced."""
    kw, nested = {}, {}
    for e in _entries(cls, exclude):
        v = getattr(args, e.name, None)
        if v is None:
            continue
        v = bool(v) if e.kind.base is bool and not e.kind.many else _parse(v, e.kind, e, field_flags(e)[0])
        if len(e.path) == 1:
            kw[e.name] = v
        else:
            nested.setdefault(e.path[0], {})[e.name] = v
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, given in nested.items():
        kw[name] = dataclasses.replace(_default(fields[name]), **given)
    return kw


def config_from_args(cls, args, *, exclude=(), **overrides):
    """``cls(**config_kwargs(cls, args), **overrides)``."""
    return cls(**{**config_kwargs(cls, args, exclude=exclude), **overrides})


def config_to_argv(cfg, *, exclude=()) -> list:
    """The options that give ``cfg`` back through ``add_config_arguments`` + ``config_from_args``
    (only the fields that differ from their defaults). ValueError for a value no option spells (a
    None where the field has no ``none`` word, a bool a ``sets`` flag cannot set, a nested field's
    sub-field that is no option and differs from its default)."""
    cls = type(cfg)
    try:   # a field whose default a config resolves (None: "the suite's") compares with the resolved value
        plain = cls()
    except (TypeError, ValueError, ConfigError):   # (a required field)
        plain = None
    for f in _fields(cls, exclude):
        if _nested(cls, f) is not None:
            v, d = getattr(cfg, f.name), _default(f)
            for g in dataclasses.fields(v):
                if g.name not in f.metadata["options"] and getattr(v, g.name) != getattr(d, g.name):
                    raise ValueError(f"{f.name}.{g.name}={getattr(v, g.name)!r}: no option spells it")
    argv: list = []
    for e in _entries(cls, exclude):
        v = getattr(cfg, e.name) if len(e.path) == 1 else getattr(getattr(cfg, e.path[0]), e.name)
        d, m = e.default, e.metadata
        if len(e.path) == 1 and plain is not None:
            d = getattr(plain, e.name)
        if d is not dataclasses.MISSING and v == d and not m.get("required"):
            continue
        kind, flag = e.kind, field_flags(e)[0]
        if kind.base is bool and not kind.many:
            if "sets" in m:
                if bool(v) != bool(m["sets"]):
                    raise ValueError(f"{e.name}={v!r}: {flag} cannot spell it")
                argv.append(flag)
            else:
                argv.append(flag if v else "--no-" + flag[2:])
            continue
        if v is None and not (kind.optional and "none" in m):
            raise ValueError(f"{e.name}=None: no option spells it")
        if m.get("append"):
            for x in v:
                argv += [flag, str(x)]
            continue
        argv += [flag, _text(v, kind, e)]
    return argv


class LazyChoices:
    """An argparse ``choices`` read from a registry only when a parser checks or shows them, so that
    a command's parser is built without importing the registry's compiled layers (``load``: a
    function returning the names)."""

    def __init__(self, load):
        self._load, self._names = load, None

    def _get(self) -> tuple:
        if self._names is None:
            self._names = tuple(self._load())
        return self._names

    def __iter__(self):
        return iter(self._get())

    def __contains__(self, name) -> bool:
        return name in self._get()

    def __len__(self) -> int:
        return len(self._get())


def parser_flags(parser) -> set:
    """Every option string of ``parser`` (for tests: the flags a command accepts)."""
    return {s for a in parser._actions for s in a.option_strings}


def one_line_errors(parser_class=argparse.ArgumentParser) -> type:
    """A parser class whose usage errors are one line on stderr, exit 2 (argparse prints the usage
    and the message otherwise)."""
    import sys

    class OneLine(parser_class):
        def error(self, message):
            sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
            sys.exit(2)
    return OneLine



def standalone_main(parser, run, argv, prog: str, run_arg: str) -> int:
    """A command's standalone entry (the scripts in ``tuning/`` and ``agents/``): parse ``argv`` with
    ``parser``, call ``run(args, run_arg)``; a ``TokenBatchError`` is one line prefixed with ``prog``,
    exit 2."""
    from .errors import TokenBatchError

    args = parser.parse_args(argv)
    try:
        return run(args, run_arg)
    except TokenBatchError as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return 2
