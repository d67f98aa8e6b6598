"""Where an import reads from: one file, a gzip-compressed file, or a directory of parts.

A directory's parts are its regular, non-hidden files in name order (one per day, say; a link only to a
file inside the directory, a name without control characters),
other than RecBole's feature files (`NAME.user`, `NAME.item`: storage.formats.feature_files),
and only its finished ones are read (`finished`): a part a writer may still be writing is
left for a later import, and so is every part after it.
A part is read in blocks of whole lines, each knowing the number of its first line, so
a bad value is named by file and line however far into a large file it sits. The part's
sha256 is fed from the same bytes (of the file as stored, compressed or not).
"""

from __future__ import annotations

import hashlib
import re
import time
import zlib
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardflow.errors import InputError

BLOCK_BYTES = 16 << 20
# A line longer than this is refused rather than buffered: no format puts that much on one
# line (an s3rec user with ~10^7 items would); the limit bounds an import's memory.
MAX_LINE_BYTES = 64 << 20
EXCERPT = 60


@dataclass(frozen=True)
class Part:
    """One source file: its name (relative to the source), where it is, and what identifies it."""

    name: str
    path: Path
    bytes: int
    mtime_ns: int
    waiting: str = ""  # why the part may still be being written ("": it is finished)

    @property
    def compressed(self) -> bool:
        return self.path.name.endswith(".gz")


MARKER = ".done"  # a companion marker, NAME.done, says part NAME is complete
FEATURE_SUFFIXES = (".user", ".item")  # RecBole's feature files beside the parts (storage.formats.feature_files)


def resolve_parts(src: str | Path, settle_s: float = 0.0, held: Collection[str] = ()) -> list[Part]:
    """Every part of `src` in name order, each unfinished one with why it waits; an InputError if it has none.

    Parts named in `held` (those a store imported already) are not judged: a store checks them by content.
    """
    src = Path(src)
    if src.is_file():
        return [_part(src.name, src)]
    if src.is_dir():
        entries = sorted(p for p in src.iterdir() if not p.name.startswith(".") and p.is_file())
        markers = {p.name for p in entries if p.name.endswith(MARKER)}
        files = [p for p in entries if p.name not in markers and not p.name.endswith(FEATURE_SUFFIXES)]
        if not files:
            raise InputError(f"{src}: a directory with no parts; accepted: a directory holding one file per part")
        parts = []
        for p in files:
            check_part(src, p)
            why = None if p.name in held else "after an unfinished part" if any(q.waiting for q in parts) \
                else _not_finished(p, markers, settle_s)
            parts.append(_part(p.name, p, why or ""))
        return parts
    if src.exists():  # a device, a pipe: endless, or not there to read twice
        raise InputError(f"{src}: not a regular file or directory (a device or a pipe?); accepted: a file, a .gz "
                         "file or a directory of parts")
    raise InputError(f"{src}: no such file or directory; accepted: a file, a .gz file or a directory of parts")


def finished(parts: list[Part]) -> list[Part]:
    """The parts an import reads now: those before the first unfinished one."""
    return [p for p in parts if not p.waiting]


def unfinished(parts: list[Part]) -> list[str]:
    """The parts left for a later import, each with why."""
    return [f"{p.name} ({p.waiting})" for p in parts if p.waiting]


def require_finished(src: str | Path, parts: list[Part]) -> list[Part]:
    """The parts of `src` a first import reads; an InputError naming those that wait when there is none."""
    done = finished(parts)
    if not done:
        raise InputError(f"{src}: no finished part yet ({', '.join(unfinished(parts)[:3])}); accepted: parts that "
                         "end with a newline and have settled, or carry a NAME.done marker")
    return done


def _not_finished(path: Path, markers: set[str], settle_s: float) -> str | None:
    """Why the part at `path` may still be being written (None: it is finished).

    A directory that holds any NAME.done marker uses markers: a part is finished when its
    marker is there. Otherwise a part is finished when it is not empty, ends with a
    newline (a .gz part: its stream is checked when it is read) and was last modified at
    least `settle_s` seconds ago.
    """
    if markers:
        return None if path.name + MARKER in markers else f"no {path.name + MARKER} marker yet"
    st = path.stat()
    if st.st_size == 0:
        return "empty"
    if not path.name.endswith(".gz"):
        with open(path, "rb") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                return "does not end with a newline"
    age = time.time() - st.st_mtime
    if 0 <= age < settle_s:  # a time stamp in the future says nothing of when the writer stopped: judged by content
        return f"modified {age:.0f} s ago; part_settle_s {settle_s:g}"
    return None


# A part's name goes into messages and printed commands: a control character (a line break, an escape) would
# split or rewrite them. Every other character is kept, and quoted for the shell where a command is printed.
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_part(src: Path, path: Path) -> None:
    """Refuse a part whose name holds a control character, or a link that leads out of the parts directory."""
    if CONTROL.search(path.name):
        raise InputError(f"{src}: part {path.name!r} has a control character in its name; accepted: names of "
                         "printable characters (rename the file)")
    if path.is_symlink() and src.resolve() not in path.resolve().parents:
        raise InputError(f"{src}: part {path.name!r} is a link to a file outside the directory; accepted: regular "
                         "files of the directory, or links to files inside it")


def not_parts(src: str | Path) -> list[str]:
    """What a directory of parts holds besides its parts and their markers, each with why ([] for a file)."""
    src = Path(src)
    if not src.is_dir():
        return []
    out = []
    for p in sorted(src.iterdir()):
        if p.name.startswith("."):
            out.append(f"{p.name} (hidden)")
        elif p.is_symlink() and not p.exists():
            out.append(f"{p.name} (a broken or looping link)")
        elif p.is_dir():
            out.append(f"{p.name} (a directory)")
        elif not p.is_file():
            out.append(f"{p.name} (not a regular file)")
    return out


def _part(name: str, path: Path, waiting: str = "") -> Part:
    st = path.stat()
    return Part(name=name, path=path, bytes=st.st_size, mtime_ns=st.st_mtime_ns, waiting=waiting)


def excerpt(line: bytes | str) -> str:
    """At most EXCERPT characters of a line, quoted, for an error message."""
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    text = text.rstrip("\r\n")
    return repr(text if len(text) <= EXCERPT else text[:EXCERPT] + "…") + (
        f" ({len(text):,} characters)" if len(text) > EXCERPT else ""
    )


@dataclass(frozen=True)
class Block:
    """Whole lines of a part: `data` ends with a newline; its first line is line `first_line`."""

    data: bytes
    first_line: int


def count_lines(data: bytes) -> int:
    return int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) == 10))


class PartReader:
    """Reads one part in blocks of whole lines; `sha256` and `lines` are complete once it is exhausted.

    Hashing and line counting run in a helper thread (both release the GIL) while the
    caller parses the block before.
    """

    def __init__(self, part: Part, block_bytes: int = BLOCK_BYTES) -> None:
        self.part = part
        self.block_bytes = block_bytes
        self._hash = hashlib.sha256()
        self.lines = 0

    @property
    def sha256(self) -> str:
        return "sha256:" + self._hash.hexdigest()

    def _raw_chunks(self, helper: ThreadPoolExecutor) -> Iterator[bytes]:
        with open(self.part.path, "rb") as f:
            if not self.part.compressed:
                while chunk := f.read(self.block_bytes):
                    helper.submit(self._hash.update, chunk)
                    yield chunk
                return
            # Hash the compressed bytes as they are read; decompress the same bytes.
            inflate = zlib.decompressobj(wbits=zlib.MAX_WBITS | 32)
            try:
                while chunk := f.read(self.block_bytes):
                    helper.submit(self._hash.update, chunk)
                    data = inflate.decompress(chunk)
                    while inflate.eof and inflate.unused_data:  # a file of several gzip members
                        rest = inflate.unused_data
                        inflate = zlib.decompressobj(wbits=zlib.MAX_WBITS | 32)
                        data += inflate.decompress(rest)
                    if data:
                        yield data
            except zlib.error as e:
                raise InputError(
                    f"{self.part.path}: not a valid gzip file ({e}); accepted: a gzip-compressed text file"
                ) from None
            if not inflate.eof:
                raise InputError(
                    f"{self.part.path}: the gzip stream ends early (a truncated file); accepted: a complete gzip file"
                )

    def blocks(self) -> Iterator[Block]:
        with ThreadPoolExecutor(max_workers=1) as helper:
            counted = None  # the line count of the block handed out last
            tail = b""
            for chunk in self._raw_chunks(helper):
                data = tail + chunk if tail else chunk
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    tail = data
                    if len(tail) > MAX_LINE_BYTES:
                        if counted is not None:
                            self.lines += counted.result()
                        raise InputError(
                            f"{self.part.path}:{self.lines + 1}: a line longer than {MAX_LINE_BYTES:,} bytes "
                            f"(starts {excerpt(tail[:EXCERPT * 4])}); accepted: lines up to {MAX_LINE_BYTES:,} bytes"
                        )
                    continue
                block, tail = data[:cut], data[cut:]
                if counted is not None:
                    self.lines += counted.result()
                counted = helper.submit(count_lines, block)
                yield Block(block, self.lines + 1)
            if tail:
                if counted is not None:
                    self.lines += counted.result()
                counted = helper.submit(count_lines, tail + b"\n")
                yield Block(tail + b"\n", self.lines + 1)
            if counted is not None:
                self.lines += counted.result()


def same_file(part: Part, recorded: dict) -> bool:
    """Whether a part on disk still looks like the one a manifest recorded (size and mtime)."""
    return part.bytes == recorded.get("bytes") and part.mtime_ns == recorded.get("mtime_ns")
