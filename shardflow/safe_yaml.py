"""YAML files a user or a deployment hands to shardflow, read with limits.

Config and topology files are small mappings: a file larger than MAX_BYTES is refused
unread, and anchors and aliases are refused as they are met, so an alias bomb (a few
lines that expand to gigabytes) never expands. Nesting deeper than MAX_DEPTH and a key
given twice in one mapping are refused too, each in one line naming the line.

Scalars resolve as in YAML 1.2 where PyYAML's YAML 1.1 differs in ways a config meets:
only `true` and `false` are booleans (in 1.1 `off`, `no`, `on` and `yes` are too, so
`full_ranking: off`, one of the key's documented values, reached the config as False and
was refused; a boolean key still takes those words, the config's types read them), and
`1e9` is a number (in 1.1 a float needs a dot, so `uplink_gbytes_per_s: 1e3` was the
string '1e3' and refused). Numbers are 1.2's too: `017` is seventeen and `0o17` fifteen
(1.1 read `seed: 017` as octal 15), `1:30` is a string (1.1 read `epochs: 1:30` as 90, base
60), and a date is a string (1.1 made `run_dir: 2026-12-05` a date, refused as not a path).
Underscores between digits (`1_000_000`) are still read, as 1.1 and Python read them.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from shardflow.errors import InputError

MAX_BYTES = 1 << 20
MAX_DEPTH = 16  # a config nests at most 6 deep (config > cluster > cluster_kwargs > resources > limits > key)


class _Refused(Exception):
    pass


class _NoAliases(yaml.SafeLoader):
    """PyYAML's safe loader, refusing anchors and aliases, nesting past MAX_DEPTH and a key given twice."""

    depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if self.check_event(yaml.events.AliasEvent):
            raise _Refused(f"line {event.start_mark.line + 1}: an alias (*{event.anchor}); accepted: plain YAML "
                           "without anchors and aliases")
        if getattr(event, "anchor", None):
            raise _Refused(f"line {event.start_mark.line + 1}: an anchor (&{event.anchor}); accepted: plain YAML "
                           "without anchors and aliases")
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _Refused(f"line {event.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels; accepted: "
                               "a config's sections, keys and their lists and maps")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True) if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key in seen:
                raise _Refused(f"line {key_node.start_mark.line + 1}: key {str(key)[:60]!r} given twice (also on "
                               f"line {seen[key]}); accepted: each key once")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


BOOL, INT, FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
TIMESTAMP = "tag:yaml.org,2002:timestamp"
_NoAliases.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (BOOL, INT, FLOAT, TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_NoAliases.add_implicit_resolver(BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
DIGITS = r"[0-9](?:_?[0-9])*"  # digits, an underscore between two of them allowed
INT_12 = re.compile(rf"^(?:[-+]?{DIGITS}|0o[0-7]+|0x[0-9a-fA-F]+)$")
FLOAT_12 = re.compile(rf"^(?:[-+]?(?:\.{DIGITS}|{DIGITS}(?:\.(?:{DIGITS})?)?)(?:[eE][-+]?[0-9]+)?"
                      r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_NoAliases.add_implicit_resolver(INT, INT_12, list("-+0123456789"))
_NoAliases.add_implicit_resolver(FLOAT, FLOAT_12, list("-+0123456789."))


def _int_12(loader: _NoAliases, node: yaml.ScalarNode) -> int:
    """An int as YAML 1.2 reads it: decimal unless 0o (octal) or 0x (hexadecimal); 1.1's constructor reads a
    leading zero as octal and a colon as base 60."""
    text = loader.construct_scalar(node).replace("_", "")
    return int(text, 0 if text[:2] in ("0o", "0x") else 10)  # base 0 reads the prefix, and refuses 017


_NoAliases.add_constructor(INT, _int_12)


def load_text(text: str, where: str) -> object:
    """Parse YAML text; an InputError naming `where` if it is not plain YAML within the limits."""
    if len(text) > MAX_BYTES:
        raise InputError(f"{where}: {len(text):,} characters; accepted: at most {MAX_BYTES:,}")
    try:
        return yaml.load(text, Loader=_NoAliases)  # noqa: S506 - a SafeLoader subclass
    except _Refused as e:
        raise InputError(f"{where}: {e}") from None
    except yaml.MarkedYAMLError as e:  # one line: where, and the problem (a python/ tag: no constructor)
        mark = e.problem_mark or e.context_mark
        line = f"line {mark.line + 1}: " if mark is not None else ""
        problem = " ".join(str(e.problem or e.context or "not valid YAML").split())[:160]
        raise InputError(f"{where}: {line}not valid YAML ({problem}); accepted: plain YAML (a mapping of keys to "
                         "values)") from None
    except yaml.YAMLError as e:
        raise InputError(f"{where}: not valid YAML ({' '.join(str(e).split())[:160]}); accepted: a YAML mapping") \
            from None


def load_file(path: str | Path, what: str) -> object:
    """Parse the YAML file at `path` (a `what`: 'config', 'topology'), refusing it unread if too large."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise InputError(f"{path}: a {what} file of {size:,} bytes; accepted: at most {MAX_BYTES:,}")
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read the {what} file ({e}); accepted: a readable UTF-8 YAML file") from None
    return load_text(text, str(path))
