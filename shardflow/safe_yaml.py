"""YAML files a user or a deployment hands to shardflow, read with limits.

Config and topology files are small mappings: a file larger than MAX_BYTES is refused
unread, and anchors and aliases are refused as they are met, so an alias bomb (a few
lines that expand to gigabytes) never expands.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from shardflow.errors import InputError

MAX_BYTES = 1 << 20


class _Refused(Exception):
    pass


class _NoAliases(yaml.SafeLoader):
    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise _Refused(f"line {event.start_mark.line + 1}: an alias (*{event.anchor})")
        event = self.peek_event()
        if getattr(event, "anchor", None):
            raise _Refused(f"line {event.start_mark.line + 1}: an anchor (&{event.anchor})")
        return super().compose_node(parent, index)


def load_text(text: str, where: str) -> object:
    """Parse YAML text; an InputError naming `where` if it is not plain YAML within the limits."""
    if len(text) > MAX_BYTES:
        raise InputError(f"{where}: {len(text):,} characters; accepted: at most {MAX_BYTES:,}")
    try:
        return yaml.load(text, Loader=_NoAliases)  # noqa: S506 - a SafeLoader subclass
    except _Refused as e:
        raise InputError(f"{where}: {e}; accepted: plain YAML without anchors and aliases") from None
    except yaml.YAMLError as e:
        raise InputError(f"{where}: not valid YAML ({e}); accepted: a YAML mapping") from None


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
