"""Shared by the multi-host driver scripts: named pass/fail checks and an atomic JSON handoff file."""

from __future__ import annotations

import json
import os
from pathlib import Path


class Checks:
    """Records each named check (and a note for failures) and prints it as it happens."""

    def __init__(self, label: str):
        self.label = label
        self.results: dict[str, bool] = {}
        self.notes: dict[str, str] = {}

    def __call__(self, name: str, ok: bool, note: str = "") -> bool:
        self.results[name] = bool(ok)
        if note or not ok:
            self.notes[name] = note
        print(f"[{self.label}] {'ok  ' if ok else 'FAIL'} {name} {note}", flush=True)
        return ok


def write_atomically(path: Path, data: dict) -> None:
    """The test side polls these files: it must never read a half-written one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
