"""The compiled graph's zmq edges (executor/graph_channel.py) on a real local Ray cluster: values and errors
cross them, a batch fans out to several readers, idle readers sleep instead of spinning, a closed edge
ends a blocked read, and a read past its timeout says so."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest
import ray
from ray.dag import InputNode
from ray.exceptions import RayChannelError, RayChannelTimeoutError

from pipejax.ray_executor.executor.graph_channel import WaitingChannel, WaitingChannelType, give_waiting_edges


@ray.remote(num_cpus=0)
class Node:
    def pid(self) -> int:
        return os.getpid()

    def add(self, x, *extra):
        if x == "fail":
            raise ValueError("asked to fail")
        return x + 1 + sum(extra)

    def wait(self, x, seconds):
        time.sleep(seconds)
        return x

    def make_channel(self, readers) -> WaitingChannel:
        return WaitingChannelType().create_channel(None, [(r, "") for r in readers])

    def write(self, channel: WaitingChannel, value) -> None:
        channel.write(value, timeout=10)

    def read(self, channel: WaitingChannel, timeout: float):
        try:
            return channel.read(timeout)
        except RayChannelError as e:
            return type(e).__name__

    def read_until_closed(self, channel: WaitingChannel) -> tuple[str, float]:
        """A read blocked in another thread, then ``close`` on a second copy of the channel (as Ray's teardown
        closes the copies it ships): how the read ended and how long after the close."""
        out = {}

        def reader():
            try:
                channel.read(timeout=30)
                out["how"] = "value"
            except RayChannelError as e:
                out["how"], out["at"] = type(e).__name__, time.monotonic()

        thread = threading.Thread(target=reader)
        thread.start()
        time.sleep(0.3)
        closed_at = time.monotonic()
        WaitingChannel(channel.channel_id, channel.addresses, channel.reader_ids).close()
        thread.join(timeout=10)
        return out.get("how", "still blocked"), out.get("at", float("inf")) - closed_at


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_graph_on_zmq_edges_carries_values_errors_and_a_fan_out(ray_local):
    a, b = Node.remote(), Node.remote()
    with InputNode() as inp:
        inp.type_hint = WaitingChannelType(first_reader=a)
        first = a.add.bind(inp)
        first.type_hint = WaitingChannelType()
        last = b.add.bind(first, inp)  # b reads the driver's input too: an edge with two readers
        last.type_hint = WaitingChannelType()
    graph = last.experimental_compile()
    try:
        assert [ray.get(graph.execute(i), timeout=30) for i in range(5)] == [2 * i + 2 for i in range(5)]
        refs = [graph.execute(i) for i in range(3)]  # several in flight
        assert [ray.get(r, timeout=30) for r in refs] == [2, 4, 6]
        with pytest.raises(ValueError, match="asked to fail"):
            ray.get(graph.execute("fail"), timeout=30)
        assert ray.get(graph.execute(10), timeout=30) == 22  # the graph goes on after an error
    finally:
        graph.teardown(kill_actors=True)


def test_idle_readers_sleep(ray_local):
    """While stage a works for 1 s, the driver and stage b wait on zmq edges: neither keeps a core busy (Ray's
    shared-memory channel keeps ~1 core busy for each)."""
    a, b = Node.remote(), Node.remote()
    b_pid = ray.get(b.pid.remote())
    with InputNode() as inp:
        inp.type_hint = WaitingChannelType()
        first = a.wait.bind(inp, 1.0)
        first.type_hint = WaitingChannelType()
        last = b.add.bind(first)
        last.type_hint = WaitingChannelType()
    graph = last.experimental_compile()
    try:
        ray.get(graph.execute(0), timeout=30)
        processes = {"driver": psutil.Process(), "stage b": psutil.Process(b_pid)}
        before = {k: p.cpu_times() for k, p in processes.items()}
        start = time.monotonic()
        assert ray.get(graph.execute(1), timeout=30) == 2
        wall = time.monotonic() - start
        assert wall >= 1.0
        for name, p in processes.items():
            now, then = p.cpu_times(), before[name]
            cores = (now.user + now.system - then.user - then.system) / wall
            assert cores < 0.25, f"{name} kept {cores:.2f} cores busy while it waited"
    finally:
        graph.teardown(kill_actors=True)


def test_close_ends_a_blocked_read_and_a_read_times_out(ray_local):
    writer, reader = Node.remote(), Node.remote()
    channel = ray.get(writer.make_channel.remote([reader]))
    assert ray.get(reader.read.remote(channel, 0.2), timeout=30) == "RayChannelTimeoutError"
    ray.get(writer.write.remote(channel, {"step": 7}), timeout=30)
    assert ray.get(reader.read.remote(channel, 10), timeout=30) == {"step": 7}
    how, after = ray.get(reader.read_until_closed.remote(channel), timeout=30)
    assert how == "RayChannelError" and after < 1.0, (how, after)
    assert ray.get(reader.read.remote(channel, 0.2), timeout=30) == "RayChannelError"  # closed stays closed
    assert issubclass(RayChannelTimeoutError, RayChannelError)  # why a timeout is named, not just caught


def test_give_waiting_edges_to_a_graph_built_elsewhere(ray_local):
    """What vLLM's compiled-graph executor gets (vllm_plugin): every edge without a transport of its own, the
    input's included, becomes a zmq edge; the graph then runs on them."""
    a, b = Node.remote(), Node.remote()
    with InputNode() as inp:
        first = a.add.bind(inp).with_tensor_transport("auto")  # vLLM's pp edges ask for "auto"
        last = b.add.bind(first)
    assert give_waiting_edges(last) == 3
    assert all(isinstance(n.type_hint, WaitingChannelType) for n in (inp, first, last))
    graph = last.experimental_compile()
    try:
        assert ray.get(graph.execute(1), timeout=30) == 3
    finally:
        graph.teardown(kill_actors=True)
