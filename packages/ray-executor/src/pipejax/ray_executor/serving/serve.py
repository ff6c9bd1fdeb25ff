"""``pipejax serve``: the head (coordinator, engines, API servers) or, with ``--headless``, engines only.

Life of the head process:
  1. addresses for every socket (fixed from ``--data-parallel-rpc-port``, else free ports);
  2. the DP coordinator (a thread here);
  3. the engines (Ray actors or local processes), and a watcher thread that reports each engine
     that ends to the coordinator, which tells every API server;
  4. the API server(s): in this process, or ``--api-server-count`` processes sharing the port;
  5. on SIGINT/SIGTERM (or when the API server fails to start): everything stopped, in reverse.

An engine that dies leaves routing; its in-flight requests go on on a live engine (the API server
sends them again with the tokens they have), or fail (500 naming it) where none is left; ``/health``
answers 503 naming it. With ``--recovery on`` (the default) and the Ray backend the head rebuilds it
(``RayEngines.rebuild``, up to ``MAX_REBUILDS`` times): it rejoins routing once it announces itself.
When no engine is left and none is being rebuilt the server stops and exits with status 3, so that a
supervisor restarts it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading

from pipejax.ray_executor.engine_args import engine_config_from_args
from pipejax.ray_executor.serving.addresses import DPAddresses, free_ports
from pipejax.runner.default_model import DEFAULT_MODEL_NAME

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
UNSERVABLE_EXIT = 3  # `pipejax serve`'s status once no engine can serve (a supervisor should restart it)


def engine_config(args: argparse.Namespace):
    backend = args.distributed_executor_backend
    if args.data_parallel_backend == "ray":
        if backend == "uni":
            raise ValueError("-dpb ray runs every engine's stages as Ray actors; --distributed-executor-backend uni "
                             "is for -dpb mp (engines as local processes)")
        backend = "ray"
    return engine_config_from_args(args, distributed_executor_backend=backend)


def check_args(args: argparse.Namespace) -> None:
    dp, dpl = args.data_parallel_size, args.data_parallel_size_local
    if dp < 1:
        raise ValueError(f"--data-parallel-size={dp} must be >= 1")
    if dpl is not None and not 0 <= dpl <= dp:
        raise ValueError(f"--data-parallel-size-local={dpl} must be in [0, --data-parallel-size={dp}]")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count={args.api_server_count} must be >= 1")
    if args.headless:
        if args.data_parallel_backend != "mp":
            raise ValueError("--headless starts local engine processes for a head elsewhere (-dpb mp); with -dpb ray "
                             "the head launches every engine itself through Ray")
        if not args.data_parallel_rpc_port:
            raise ValueError("--headless needs the head's --data-parallel-rpc-port (and --data-parallel-address "
                             "unless the head is on this machine) to find its sockets")
    elif args.data_parallel_backend == "mp" and dpl is not None and dpl < dp and not args.data_parallel_rpc_port:
        raise ValueError(f"-dpl {dpl} < -dp {dp} with -dpb mp: the other ranks join with --headless, which needs "
                         f"a fixed --data-parallel-rpc-port here and there")


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_args(args)
    config = engine_config(args)
    addresses = DPAddresses.create(args.data_parallel_address, args.data_parallel_rpc_port, args.api_server_count)
    if args.headless:
        return _run_headless(args, config, addresses)
    return _run_head(args, config, addresses)


def _run_headless(args, config, addresses: DPAddresses) -> int:
    from pipejax.ray_executor.serving.engines import ProcessEngines

    start = args.data_parallel_start_rank
    count = args.data_parallel_size - start
    if args.data_parallel_size_local is not None:
        count = args.data_parallel_size_local
    engines = ProcessEngines(config, range(start, start + count), addresses, warmup=not args.no_warmup)
    stop = _stop_on_signals()
    engines.start()
    try:
        while not stop.is_set() and engines.alive:
            for reason in engines.poll_dead(WATCH_INTERVAL_S).values():
                log.error("%s", reason)
    finally:
        engines.shutdown()
    return 0


def _run_head(args, config, addresses: DPAddresses) -> int:
    from pipejax.ray_executor.serving.coordinator import DPCoordinator
    from pipejax.ray_executor.serving.engines import ProcessEngines, RayEngines
    from pipejax.ray_executor.serving.frontend import FrontendConfig

    dp, dpl = args.data_parallel_size, args.data_parallel_size_local
    coordinator = DPCoordinator(addresses, dp, heartbeat_timeout_s=args.heartbeat_timeout)
    coordinator.start()
    if args.data_parallel_backend == "ray":
        engines = RayEngines(config, dp, dpl, addresses, warmup=not args.no_warmup)
    else:
        engines = ProcessEngines(config, range(dpl if dpl is not None else dp), addresses, warmup=not args.no_warmup)
    watching, unservable = threading.Event(), threading.Event()
    watcher = threading.Thread(target=_watch, args=(engines, coordinator, watching, unservable, config.recovery),
                               name="engine-watch", daemon=True)
    try:
        engines.start()
        watcher.start()
        frontend = FrontendConfig(
            addresses=addresses, client_index=0, dp_size=dp, model_path=config.model.path,
            served_model_name=args.served_model_name or args.model or DEFAULT_MODEL_NAME, api_key=args.api_key,
            ready_timeout_s=args.engine_ready_timeout, output_timeout_s=args.request_timeout,
        )
        code = _run_api_servers(args, frontend, unservable)
        if unservable.is_set():
            log.error("no data-parallel engine can serve (%s); exiting with status %d",
                      "; ".join(coordinator.dead.values()), UNSERVABLE_EXIT)
            return UNSERVABLE_EXIT
        return code
    finally:
        watching.set()
        watcher.join(timeout=5)
        engines.shutdown()
        coordinator.stop()


def _watch(engines, coordinator, stop: threading.Event, unservable: threading.Event, recovery: bool) -> None:
    """Each engine that ends is marked dead (its requests move on, routing leaves it), then rebuilt where
    ``recovery`` allows; once none is left, ``unservable`` is set (the server stops, exit status 3)."""
    while not stop.is_set():
        for rank, reason in engines.poll_dead(WATCH_INTERVAL_S).items():
            if stop.is_set():
                return
            coordinator.mark_dead(rank, reason)
            if recovery and engines.rebuild(rank):
                coordinator.expect(rank, engines.rebuilds[rank])
        if len(coordinator.dead) == coordinator.dp_size:
            unservable.set()
            return


def _run_api_servers(args, frontend, unservable: threading.Event) -> int:
    from pipejax.ray_executor.serving.api_server import api_server_process, serve_http

    if args.api_server_count == 1:
        return serve_http(frontend, args.host, args.port, stop_when=unservable)
    port = args.port or free_ports(args.host, 1)[0]
    metrics_dir = tempfile.mkdtemp(prefix="pipejax-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before the API server processes import prometheus
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=api_server_process, name=f"pipejax-api-{i}",
                    args=(dataclasses.replace(frontend, client_index=i), args.host, port))
        for i in range(args.api_server_count)
    ]
    for proc in procs:
        proc.start()
    log.info("%d API servers on http://%s:%d (pids %s)", len(procs), args.host, port, [p.pid for p in procs])
    stop = _stop_on_signals()
    try:
        while not stop.is_set() and not unservable.is_set() and all(p.exitcode is None for p in procs):
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=WATCH_INTERVAL_S)
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
            if proc.exitcode is None:
                proc.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    failed = [p for p in procs if p.exitcode not in (0, -signal.SIGTERM)]
    return 1 if failed and not stop.is_set() else 0


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop
