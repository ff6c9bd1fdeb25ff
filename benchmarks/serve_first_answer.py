"""Seconds from launching ``pipejax serve`` to its first answer of the README's completion request, as on a fresh
install (an empty HOME and numba cache: no compilation cache, kernel verdict nor built CPU kernel), then again
with the caches that start filled; with ``--until-kernels``, also when the first start's stage switched to the CPU
kernels it built in the background (from the server's log).

    python benchmarks/serve_first_answer.py --until-kernels [-- serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

REQUEST = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}  # the README's curl
SWITCH_LINE = "built in the background"


def ask(port: int) -> str | None:
    """The completion's text, or None while the server does not answer 200."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(REQUEST).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.load(resp)["choices"][0]["text"]
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def one_start(root: str, port: int, flags: list[str], until_kernels: bool, timeout_s: float) -> dict:
    env = {**os.environ, "HOME": os.path.join(root, "home"), "NUMBA_CACHE_DIR": os.path.join(root, "numba")}
    os.makedirs(env["HOME"], exist_ok=True)
    log_path = os.path.join(root, "serve.log")
    pipejax = shutil.which("pipejax") or os.path.join(os.path.dirname(sys.executable), "pipejax")
    with open(log_path, "w") as log:
        start = time.monotonic()
        proc = subprocess.Popen([pipejax, "serve", "--port", str(port), *flags], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    out: dict = {}
    try:
        while (text := ask(port)) is None:
            if proc.poll() is not None or time.monotonic() - start > timeout_s:
                raise RuntimeError(f"no answer (exit {proc.returncode}); see {log_path}")
            time.sleep(0.5)
        out["first_answer_s"] = round(time.monotonic() - start, 1)
        while until_kernels and SWITCH_LINE not in open(log_path).read():
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"no switch to the CPU kernels within {timeout_s} s; see {log_path}")
            ask(port)
            time.sleep(1)
        if until_kernels:
            out["kernels_switched_s"] = round(time.monotonic() - start, 1)
            out["same_text_after_switch"] = ask(port) == text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--until-kernels", action="store_true", help="on the first start, wait for the switch")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("flags", nargs="*", help="pipejax serve's flags (after --)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="serve-first-answer-")
    try:
        first = one_start(root, args.port, args.flags, args.until_kernels, args.timeout)
        again = one_start(root, args.port, args.flags, False, args.timeout)
        print(json.dumps({"first_start": first, "second_start": again}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
