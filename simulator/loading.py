"""Reading the files a user hands us: bytes to Python values, bounded, or one-line errors.

Every file the project reads — scenarios, hardware profiles, model presets, ``--set``
values, ``measured.json``, a run directory's ``results.json`` — goes through here,
so that a hostile or broken file is answered the same way everywhere: a
:class:`~simulator.errors.UserError` naming the file, what is wrong and the fix,
never a traceback, a hang or a runaway allocation.

What is checked, before anything is built from the data:

- size: a file larger than its limit is refused unread (a scenario is a few KB),
  and a YAML document of more than :data:`MAX_NODES` values is refused while it
  is composed (pure-Python PyYAML composes ~6,000 flow values a second);
- encoding: UTF-8 only (a UTF-8 BOM is skipped); UTF-16/32 (by their BOM), invalid
  bytes and binary files (a NUL byte) are named as such;
- YAML nesting: at most :data:`MAX_DEPTH` levels, checked while composing (so a
  20,000-deep list never reaches Python's recursion limit) and again with aliases
  expanded;
- YAML aliases: the document's size with every alias expanded (each use counted,
  as a consumer walking the data would see it) is at most :data:`MAX_NODES`, so a
  "billion laughs" document is refused after composing a few dozen nodes, before
  it is constructed or copied; a recursive alias is refused;
- duplicate keys in a mapping are errors (YAML says keys are unique; PyYAML keeps
  the last silently);
- scalars follow the YAML 1.2 core schema: integers only in plain decimal, floats
  in decimal or exponent form (``1e9`` is a float, not a string), booleans only
  ``true``/``false``. ``0x80``, ``1_28``, ``0o17``, ``yes`` and ``on`` stay
  strings, so a field expecting a number or a boolean refuses them by name;
- JSON: the same size limit, no ``NaN``/``Infinity`` constants, nesting bounded.

Types and ranges of the values are the schemas' business (``scenario.py``,
``hardware.py``); this module only guarantees that what they receive is small,
finite in shape and decoded.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from simulator.errors import Problem, UserError

if TYPE_CHECKING:
    from pydantic import BaseModel

M = TypeVar("M", bound="BaseModel")

MAX_DEPTH = 32  # nesting levels; a scenario needs 4, a calibrated profile 6
MAX_NODES = 5_000  # YAML values, every alias use counted; a calibrated profile has ~600
YAML_LIMIT_BYTES = 256 << 10  # a calibrated profile is ~6 KB; PyYAML reads ~100 KB/s
JSON_LIMIT_BYTES = 256 << 20  # results.json of a full-fidelity run is a few MB
#: The bundled presets: models/, systems/, stacks/, reliability/ (package data)
PRESETS_DIR = Path(__file__).parent / "presets"

_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
         (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))


class YAMLBoundsError(yaml.YAMLError):
    """The document is too deep or expands too far; raised before it is constructed."""


class TooLargeError(UserError):
    """A document past the depth or alias-expansion bounds (never read as plain text)."""


def _problem(what: str, where: str, fix: str) -> UserError:
    return UserError([Problem(what, where, fix)])


NAME_MAX = 255  # bytes in one path component (Linux, macOS)
PATH_MAX = 4096  # bytes in a whole path (Linux)


def local_path(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` with ``~`` expanded, resolved once for readers and writers alike, or a
    one-line error where the file system could not name it (an unknown user, a name
    longer than :data:`NAME_MAX` bytes or a path longer than :data:`PATH_MAX`)."""
    raw = os.fsencode(path)
    if len(raw) > PATH_MAX:
        raise _problem(what, os.fsdecode(raw), f"is longer than the {PATH_MAX} bytes a path "
                       "may have; give a shorter one")
    long = next((c for c in raw.split(b"/") if len(c) > NAME_MAX), None)
    if long is not None:
        raise _problem(what, os.fsdecode(raw), f"has a name of {len(long)} bytes, longer than "
                       f"the {NAME_MAX} the file system allows; give a shorter one")
    try:
        return Path(os.fsdecode(raw)).expanduser()
    except RuntimeError:  # ~nosuchuser
        raise _problem(what, os.fsdecode(raw), "starts with ~ and a user this machine does "
                       "not know; give the directory itself") from None


def read_bytes(path: Path, what: str, limit: int) -> bytes:
    """The file's bytes, refusing a missing or unreadable file, a directory, a special
    file (a FIFO is opened without blocking and refused, a device never read) and more
    than ``limit`` bytes (read no further)."""
    target = local_path(path, what)
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise _problem(what, str(path), "is a directory; give the path of a file") from None
        raise _problem(what, str(path), f"cannot read it ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _problem(what, str(path), "is a directory; give the path of a file"
                       if stat.S_ISDIR(mode) else "is a special file (a FIFO, socket or "
                       "device), not a regular file; give the path of a file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise _problem(what, str(path), f"cannot read it ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise _problem(what, str(path), f"is larger than the {limit:,} bytes this kind of "
                       "file may have; is it the right file?")
    return data


def decode_text(data: bytes, what: str, where: str) -> str:
    """UTF-8 text, or a one-line error naming the encoding problem and the fix."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise _problem(what, where, f"is encoded as {name}; save it as UTF-8")
    if b"\x00" in data:
        raise _problem(what, where, "is a binary file (it contains NUL bytes), not text; "
                       "give a UTF-8 text file")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise _problem(what, where, f"is not valid UTF-8 (byte 0x{data[exc.start]:02x} at "
                       f"offset {exc.start}); save it as UTF-8") from None


# ------------------------------------------------------------------------ YAML

_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$")
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?"
                    r"|[-+]?[0-9]+[eE][-+]?[0-9]+"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_CORE_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core scalars, unique keys, and bounded depth and size."""

    yaml_implicit_resolvers = {  # noqa: RUF012 (PyYAML's own class attribute)
        first: [(tag, rx) for tag, rx in resolvers if tag not in _CORE_TAGS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH or self._nodes > MAX_NODES:
                mark = self.peek_event().start_mark
                raise YAMLBoundsError(
                    f"is nested deeper than {MAX_DEPTH} levels (line {mark.line + 1})"
                    if self._depth > MAX_DEPTH else
                    f"has more than {MAX_NODES:,} values (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        _check_expanded(node)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[object] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:
                    raise yaml.constructor.ConstructorError(
                        None, None, "a mapping key must be a plain value",
                        key_node.start_mark) from None
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}; each key may appear once",
                        key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


for _tag, _rx, _first in (("tag:yaml.org,2002:bool", _BOOL, "tTfF"),
                          ("tag:yaml.org,2002:int", _INT, "-+0123456789"),
                          ("tag:yaml.org,2002:float", _FLOAT, "-+0123456789.")):
    BoundedLoader.add_implicit_resolver(_tag, _rx, list(_first))


def _check_expanded(root: Any) -> None:
    """Refuse a node graph whose alias-expanded size or depth passes the bounds."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    open_: set[int] = set()

    def walk(node: Any, level: int) -> tuple[int, int]:
        key = id(node)
        if key in open_:
            raise YAMLBoundsError("has an alias inside the node it names (recursive data)")
        if key in sizes:
            if level + depths[key] > MAX_DEPTH:
                raise YAMLBoundsError(f"is nested deeper than {MAX_DEPTH} levels once "
                                      "aliases are expanded")
            return sizes[key], depths[key]
        if level > MAX_DEPTH:
            raise YAMLBoundsError(f"is nested deeper than {MAX_DEPTH} levels once aliases "
                                  "are expanded")
        size, depth = 1, 0
        if isinstance(node, yaml.CollectionNode):
            open_.add(key)
            children = (node.value if isinstance(node, yaml.SequenceNode)
                        else [c for pair in node.value for c in pair])
            for child in children:
                s, d = walk(child, level + 1)
                size, depth = size + s, max(depth, d + 1)
                if size > MAX_NODES:
                    raise YAMLBoundsError(f"expands to more than {MAX_NODES:,} values "
                                          "through its aliases (an alias bomb?)")
            open_.discard(key)
        sizes[key], depths[key] = size, depth
        return size, depth

    if root is not None:
        walk(root, 1)


def parse_yaml(text: str, what: str, where: str) -> Any:
    """One YAML document, bounded (see the module notes), or a one-line UserError."""
    loader = None
    try:
        loader = BoundedLoader(text)  # the reader refuses control characters right away
        return loader.get_single_data()
    except YAMLBoundsError as exc:
        raise TooLargeError([Problem(what, where, f"{exc} (YAML); simplify it")]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or "not valid YAML"
        if isinstance(exc, yaml.reader.ReaderError):
            char = exc.character
            code = f"0x{char:02x}" if isinstance(char, int) else repr(char)
            reason = f"control character {code} at offset {exc.position}; remove it"
        raise _problem(what, where, f"invalid YAML{at}: {reason}") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of 5,000 digits
        raise _problem(what, where, f"invalid YAML value: {str(exc)[:80]}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml(path: Path, what: str) -> Any:
    """Read a YAML file or raise a one-line UserError naming the file and the problem."""
    data = read_bytes(path, what, YAML_LIMIT_BYTES)
    return parse_yaml(decode_text(data, what, str(path)), what, str(path))


def parse_override(text: str, what: str) -> Any:
    """A ``--set`` value: YAML when it parses (bounded like a file), else the text itself."""
    try:
        return parse_yaml(text, what, text)
    except TooLargeError:
        raise
    except UserError:
        return text


# ------------------------------------------------------------------------ JSON


JSON_MAX_DEPTH = 64  # nesting levels; results.json needs 5, a Chrome trace 4
JSON_MAX_INT_DIGITS = 20  # an integer past 10^20 is no count or size a file of ours holds


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is beyond the range of a float")
    return value


def _small_int(text: str) -> int:
    if len(text.lstrip("-")) > JSON_MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _json_depth_ok(value: Any) -> bool:
    """Whether ``value`` nests at most :data:`JSON_MAX_DEPTH` levels (no recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > JSON_MAX_DEPTH:
            return False
        children = node.values() if isinstance(node, dict) else node \
            if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return True


def parse_json(text: str, what: str, where: str) -> Any:
    """One JSON document: finite numbers, integers of at most
    :data:`JSON_MAX_INT_DIGITS` digits, nesting of at most :data:`JSON_MAX_DEPTH`."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float,
                           parse_int=_small_int)
    except json.JSONDecodeError as exc:
        fix = "is empty" if not text.strip() else \
            f"is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        raise _problem(what, where, f"{fix}; was it cut short? write it again") from None
    except (ValueError, RecursionError) as exc:
        raise _problem(what, where, f"is not valid JSON ({str(exc)[:80]})") from None
    if not _json_depth_ok(value):
        raise _problem(what, where, f"is nested deeper than {JSON_MAX_DEPTH} levels; is it "
                       "the right file?")
    return value


def read_json(path: Path, what: str, limit: int = JSON_LIMIT_BYTES) -> Any:
    """Read a JSON file (UTF-8, finite numbers only, bounded) or raise a UserError."""
    text = decode_text(read_bytes(path, what, limit), what, str(path))
    return parse_json(text, what, str(path))


def read_model(path: Path, what: str, model: type[M], fix: str,
               limit: int = JSON_LIMIT_BYTES) -> M:
    """A JSON file checked against the pydantic ``model`` of what its reader uses; the
    first mismatch is one line naming the file, the field, the value and ``fix``."""
    from pydantic import ValidationError

    data = read_json(path, what, limit)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(the whole file)"
        raise UserError([Problem(f"{path}: {loc}", err.get("input"),
                                 f"{err['msg']}; {fix}")]) from None
