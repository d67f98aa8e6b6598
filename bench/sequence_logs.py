"""The logs a quality benchmark trains on: the bundled ones by name, or any other as FORMAT:PATH.

A team holding its own log and its own SASRec runs the engine (bench/model_quality.py) and the peer
(bench/sasrec_peer.py) on it with the same argument, e.g. `--datasets sasrec:/data/Sports.txt,beauty`.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
BUNDLED = {  # name -> (file, format)
    "games": (DATA / "amazon-video" / "Video.txt", "sasrec"),
    "beauty": (DATA / "amazon-beauty" / "Beauty.txt", "s3rec"),
    "movielens": (DATA / "movielens-100k" / "ml-100k.inter", "recbole"),
}


def parse_logs(text: str, names: list[str], formats: tuple[str, ...]) -> dict[str, tuple[Path, str]]:
    """`--datasets`' comma-separated entries: a bundled log's name (one of `names`) or FORMAT:PATH (a format of
    `formats`), each keyed by its name or its file's stem; SystemExit with one line on a bad entry."""
    accepted = f"accepted: {', '.join(names)}, or FORMAT:PATH with FORMAT one of {', '.join(formats)}"
    logs: dict[str, tuple[Path, str]] = {}
    for entry in text.split(","):
        fmt, colon, path = entry.partition(":")
        if not colon and entry in names:
            logs[entry] = BUNDLED[entry]
        elif colon and fmt in formats and Path(path).is_file():
            logs[Path(path).stem] = (Path(path), fmt)
        else:
            why = "no such file" if colon and fmt in formats else "not a log this benchmark reads"
            raise SystemExit(f"--datasets {entry!r}: {why}; {accepted}")
    return logs
