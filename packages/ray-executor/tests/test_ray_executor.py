"""The Ray executor on simulated multi-node clusters (ray.cluster_utils.Cluster), against the in-process executor."""

import os
import pickle
import signal
import time

import pytest
import ray
from oracle import hf_greedy, make_checkpoint, mixed_prompts
from ray.cluster_utils import Cluster

from pipejax.ray_executor import LLM, SamplingParams
from pipejax.ray_executor.engine.engine import EngineDeadError
from pipejax.ray_executor.executor.ray_placement import CPU_DEVICE_RESOURCE

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["Hello, pipejax!", "The quick brown fox", "pipelines", "x" * 40, "a", "tensor parallel"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def expected():
    llm = LLM("builtin", pipeline_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=128, warmup=False)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


def start_cluster(devices_per_node: list[int]) -> Cluster:
    """The first entry is the head node (where the driver runs); each node declares its devices."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {CPU_DEVICE_RESOURCE: devices_per_node[0]}},
    )
    for devices in devices_per_node[1:]:
        cluster.add_node(num_cpus=1, resources={CPU_DEVICE_RESOURCE: devices})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def stop_cluster(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()


def run(pp: int, tp: int, compiled: bool = False):
    llm = LLM(
        "builtin",
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        distributed_executor_backend="ray",
        num_kv_blocks=128,
        warmup=False,
        ray_compiled_graph=compiled,
        step_trace_len=1024,
    )
    outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return llm, outputs


def assert_contiguous_per_node(placement, driver_node=None):
    nodes = [p["node_id"] for p in placement]
    groups = [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n]
    assert len(groups) == len(set(groups)), f"ranks not contiguous per node: {nodes}"
    for node in set(nodes):
        local = [p["local_rank"] for p in placement if p["node_id"] == node]
        assert local == list(range(len(local)))
        assert {p["local_world_size"] for p in placement if p["node_id"] == node} == {len(local)}
    if driver_node is not None:
        assert nodes[0] == driver_node


def count_driver_traffic(monkeypatch) -> tuple[list[int], list[int]]:
    """The pickled bytes of every batch the driver sends its stages, and of every result it gets back."""
    from pipejax.ray_executor.executor import ray_executor

    sent, received = [], []
    real_submit = ray_executor.RayExecutor.execute_model
    real_done = ray_executor.RayExecutor._stage_done

    def submit(self, batch):
        sent.append(len(pickle.dumps(batch)) * len(self.actors))
        return real_submit(self, batch)

    def done(self, rank, stage_future, result):
        if stage_future.exception() is None:
            received.append(len(pickle.dumps(stage_future.result())))
        return real_done(self, rank, stage_future, result)

    monkeypatch.setattr(ray_executor.RayExecutor, "execute_model", submit)
    monkeypatch.setattr(ray_executor.RayExecutor, "_stage_done", done)
    return sent, received


@pytest.mark.parametrize(
    "pp,tp,devices",
    [(2, 2, [2, 2]), (2, 2, [0, 2, 2])],  # two stages per node: the compiled-graph test below
    ids=["pp2tp2-2nodes", "pp2tp2-driver-node-without-devices"],
)
def test_outputs_match_inprocess_and_ranks_follow_hosts(expected, pp, tp, devices, monkeypatch):
    """Same tokens as in-process; ranks contiguous per host; everything the driver sends or gets back is small
    control data while the stages move the activations; shutdown removes the actors and placement group."""
    sent, received = count_driver_traffic(monkeypatch)
    cluster = start_cluster(devices)
    try:
        llm, outputs = run(pp, tp)
        placement = llm.engine.executor.placement
        driver_node = ray.get_runtime_context().get_node_id()
        assert_contiguous_per_node(placement, driver_node if devices[0] else None)
        assert len({p["node_id"] for p in placement}) == 2
        assert len({p["pid"] for p in placement}) == pp  # one process per stage
        if not devices[0]:
            assert driver_node not in {p["node_id"] for p in placement}
        assert outputs == expected
        activation_bytes = llm.engine.executor.activation_bytes_sent()
        actors, pg = llm.engine.executor.actors, llm.engine.executor.pg
        llm.shutdown()
        for actor in actors:  # shutdown removed the actors ...
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.ping.remote(), timeout=30)
        assert ray.util.placement_group_table(pg)["state"] == "REMOVED"  # ... and the placement group
    finally:
        stop_cluster(cluster)
    hidden = 256 * 4  # built-in model: hidden 256, float32
    assert activation_bytes[0] >= len(sent) * hidden  # at least one token's hidden state per step
    assert activation_bytes[-1] == 0  # the last stage sends nothing
    assert sum(sent) + sum(received) < activation_bytes[0] / 4
    assert max(received) < 16 * hidden  # no result is as large as even the smallest activation


def test_compiled_graph_mode_matches_and_pipelines(expected):
    """Compiled-graph mode: two stages per node, same outputs, several batches in flight."""
    cluster = start_cluster([4, 4])
    try:
        llm, outputs = run(4, 2, compiled=True)
        assert llm.engine.executor.pipeline is not None  # the graph really ran the steps
        assert outputs == expected
        placement = llm.engine.executor.placement
        assert_contiguous_per_node(placement, ray.get_runtime_context().get_node_id())
        assert len({p["node_id"] for p in placement}) == 2 and len({p["pid"] for p in placement}) == 4
        assert max(n for _, n in llm.engine.in_flight_trace) > 1
        # collective_rpc reaches the stages while they sit in the graph (their main thread)
        assert [i.pp_rank for i in llm.engine.executor.stage_infos()] == [0, 1, 2, 3]
        assert {0, 1, 2, 3} <= {step for _, step, _, _ in llm.engine.executor.step_trace()}
        llm.shutdown()
    finally:
        stop_cluster(cluster)


def test_dead_stage_fails_every_request_with_a_clear_error_when_recovery_is_off():
    cluster = start_cluster([2, 2])
    try:
        llm = LLM(
            "builtin",
            pipeline_parallel_size=2,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            num_kv_blocks=128,
            warmup=False,
            recovery="off",
        )
        engine = llm.engine
        victim = engine.executor.placement[1]
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"r{i}", f"request {i}", long)
        for _ in range(4):
            engine.step()
        os.kill(victim["pid"], signal.SIGKILL)  # the stage-1 actor process this test's cluster started
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"stage 1 \(host {victim['host']}, ip {victim['ip']}") as err:
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 30
        failed = {o.request_id: o.outputs[0] for o in err.value.failed_outputs}
        assert sorted(failed) == ["r0", "r1", "r2", "r3"]
        assert all(o.finish_reason == "error" and "stage 1" in o.stop_reason for o in failed.values())
        with pytest.raises(EngineDeadError):
            engine.add_request("late", "too late", long)
        llm.shutdown()
    finally:
        stop_cluster(cluster)


def test_torchax_model_impl_under_ray(tmp_path):
    """The torchax bridge's stages run as Ray stage actors, pp2 on 2 nodes, same tokens as transformers."""
    tokens = mixed_prompts(4)
    expected = hf_greedy(make_checkpoint(tmp_path, "LlamaForCausalLM"), tokens, GREEDY.max_tokens)
    prompts = [{"prompt_token_ids": p} for p in tokens]
    cluster = start_cluster([1, 1])
    try:
        llm = LLM(
            str(tmp_path),
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
            model_impl="torchax",
            num_kv_blocks=64,
            block_size=8,
            warmup=False,
        )
        assert len({p["node_id"] for p in llm.engine.executor.placement}) == 2
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
        llm.shutdown()
    finally:
        stop_cluster(cluster)


def test_pinned_stages_get_disjoint_cores(expected):
    """pin_stage_cpus: two stages on one node split its cores between them, outputs unchanged; more
    stages than cores is refused with an error that names the fix."""
    cores = sorted(os.sched_getaffinity(0))
    cluster = start_cluster([4])
    try:
        llm = LLM("builtin", pipeline_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="ray",
                  num_kv_blocks=128, warmup=False, pin_stage_cpus=True)
        actors = llm.engine.executor.actors
        pinned = ray.get([a.allowed_cpus.remote() for a in actors], timeout=60)
        share = len(cores) // 2
        if share:
            assert pinned == [cores[:share], cores[share : 2 * share]]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        llm.shutdown()
    finally:
        stop_cluster(cluster)
    if len(cores) < 4:  # one core per stage at most: 4 stages on this node cannot each get one
        cluster = start_cluster([4])
        try:
            with pytest.raises(ValueError, match=r"pin_stage_cpus: stage \d .* drop pin_stage_cpus"):
                LLM("builtin", pipeline_parallel_size=4, distributed_executor_backend="ray", num_kv_blocks=64,
                    warmup=False, pin_stage_cpus=True)
        finally:
            stop_cluster(cluster)
