"""vLLM's Ray executors in pipejax's CPU mode with no Ray cluster of one's own: vLLM's engine core would start
a cluster that lists no ``TPU`` and wait 30 min for its placement group; pipejax's platform refuses in seconds,
naming the resource and the ``ray start`` fix. (The README's ``ray start`` + ``vllm serve`` path, which works,
is ``test_vllm_host.py``'s server.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from oracle import TINY  # the ray-executor tests' tiny checkpoints
from test_vllm_host import VOCAB, engine_env

from pipejax.runner.builtin_model import write_byte_tokenizer, write_checkpoint

LIMIT_S = 30.0  # for vllm.LLM(...) to fail: the bound
CHILD = """
import json, sys, time
import vllm
start = time.monotonic()
try:
    vllm.LLM(model=sys.argv[1], pipeline_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="ray",
             dtype="float32", max_model_len=256)
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps({"error": error, "elapsed": time.monotonic() - start}), flush=True)
"""


def test_ray_backend_without_a_cluster_fails_in_seconds_naming_the_fix(tmp_path):
    path = str(tmp_path)
    write_checkpoint(path, {**TINY, "vocab_size": VOCAB, "architectures": ["LlamaForCausalLM"]}, seed=0)
    write_byte_tokenizer(path, VOCAB)
    # An empty Ray temp dir: no `ray start` cluster of this machine's default one (another user's) is found.
    with tempfile.TemporaryDirectory(prefix="pjray-") as ray_tmp:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=engine_env(RAY_TMPDIR=ray_tmp), start_new_session=True)
        try:
            out, err = proc.communicate(timeout=LIMIT_S + 90)  # + vLLM's import; a hang ends here, not in 30 min
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and the engine core it may have started
            out, err = proc.communicate()
            raise AssertionError(f"vllm.LLM(..., 'ray') with no cluster still running after {LIMIT_S + 90:.0f}s:\n"
                                 f"{err[-4000:]}") from None
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"the child printed no result ({proc.returncode}):\n{err[-4000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["error"] is not None, "vllm.LLM(..., 'ray') started with no cluster declaring 'TPU'"
    assert "'TPU'" in result["error"] and """ray start --head --resources '{"TPU": 2}'""" in result["error"], (
        result["error"])
    assert result["elapsed"] < LIMIT_S, f"vllm.LLM took {result['elapsed']:.1f}s to fail: {result['error']}"
