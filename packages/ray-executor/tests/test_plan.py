"""``pipejax plan``: the layouts it lists are exactly the valid ones, ranked by predicted throughput, each split
by ``balanced_partition`` within its stage's memory; bad input and a model too large are refused by name."""

import dataclasses
import json
import math

import pytest

from pipejax.platform_tpu.hardware import Hardware
from pipejax.platform_tpu.layout import check_layout
from pipejax.pp_utils.balance import balanced_partition
from pipejax.pp_utils.config import ParallelConfig
from pipejax.ray_executor import cli, plan
from pipejax.runner.config import ModelConfig
from pipejax.runner.part_profile import PartProfile, PartTimes
from pipejax.worker.memory_probe import KINDS, StageMemory

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
             "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 128256,
             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "torch_dtype": "bfloat16", "tie_word_embeddings": False}
SMALL = {**LLAMA_70B, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
         "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152, "max_position_embeddings": 8192,
         "tie_word_embeddings": True}
WORK = plan.Workload(max_model_len=4096, concurrency=64, prompt_len=512, output_len=128)


def test_every_valid_layout_is_listed_once_ranked_and_split_within_memory():
    model = ModelConfig.from_hf(LLAMA_70B)
    hw = Hardware("tpu", num_hosts=4, chips_per_host=8, generation="v5e")
    device = plan.tpu_device(hw)
    found = plan.plan(model, hw, device, WORK)
    keys = [(p.pp, p.tp, p.dp) for p in found]
    assert len(keys) == len(set(keys))
    for p in found:
        check_layout(ParallelConfig(pipeline_parallel_size=p.pp, tensor_parallel_size=p.tp, data_parallel_size=p.dp),
                     hw)  # raises where the platform would refuse it
        assert model.num_kv_heads % p.tp == 0 or p.tp % model.num_kv_heads == 0
        assert sum(p.partition) == model.num_layers and len(p.partition) == p.pp
        stage_memory = device.memory_bytes * p.tp * plan.USABLE_MEMORY
        assert max(p.stage_weight_bytes) < stage_memory
        assert 1 <= p.rows <= math.ceil(WORK.concurrency / p.dp)
        # the KV its rows need at max_model_len, within what the weights leave: never more than either
        assert 0 < p.kv_blocks <= 1 + p.rows * WORK.max_model_len // 16
        assert all(m <= stage_memory for m in p.stage_memory_bytes)
        assert 0 <= p.bubble < 1
    assert [p.throughput for p in found] == sorted((p.throughput for p in found), reverse=True)
    # 131 GiB of bf16 weights: one 8-chip v5e host (128 GB HBM) cannot hold them, so every layout spans hosts
    assert all(p.pp * p.tp > 8 for p in found)
    # a valid layout the plan does not list would be a bug: tp=8 pp=2 dp=2 uses all 32 chips
    assert (2, 8, 2) in keys
    # the last stage holds the LM head: it gets fewer layers than an even split
    best_pp2 = next(p for p in found if p.pp == 2)
    assert best_pp2.partition[0] > best_pp2.partition[1]
    costs = model.part_costs()
    assert best_pp2.partition == balanced_partition(costs, 2, _limit(model, device, best_pp2))


def _limit(model, device, p):
    kv_token_layer = plan._kv_bytes_per_token(model, p.tp) / model.num_layers
    return (device.memory_bytes * p.tp * plan.USABLE_MEMORY
            - kv_token_layer * WORK.max_model_len * math.ceil(model.num_layers / p.pp))


def test_a_tp_that_does_not_divide_the_heads_is_never_planned():
    model = ModelConfig.from_hf(SMALL)  # 9 heads, 3 KV heads: tp in {1, 3, 9}
    hw = Hardware("cpu", num_hosts=1, chips_per_host=8)
    device = plan.DeviceSpec(memory_bytes=16 * plan.GIB, flops=100e9, bandwidth=20e9, source="test", shared_host=True,
                             step_overhead_s=plan.CPU_STEP_OVERHEAD_S)
    found = plan.plan(model, hw, device, WORK)
    assert {p.tp for p in found} == {1, 3}  # 9 devices do not fit one 8-device host
    # a shared host's rates are split over the devices a layout uses: one stage on 3 devices is no faster than
    # on 1 (only its all-reduces differ)
    by = {(p.pp, p.tp, p.dp): p for p in found}
    one, three = by[(1, 1, 1)].stage_time_s[0], by[(1, 3, 1)].stage_time_s[0]
    assert three - one == pytest.approx(2 * model.num_layers * plan.COLLECTIVE_S)


def test_a_model_larger_than_every_host_names_the_fewest_hosts_that_would_fit():
    model = ModelConfig.from_hf(LLAMA_70B)
    hw = Hardware("tpu", num_hosts=1, chips_per_host=8, generation="v5e")
    with pytest.raises(ValueError, match=r"the smallest that would: 2 such hosts") as err:
        plan.plan(model, hw, plan.tpu_device(hw), WORK)
    assert "131.42 GiB of weights" in str(err.value)
    assert plan.plan(model, Hardware("tpu", num_hosts=2, chips_per_host=8, generation="v5e"),
                     plan.tpu_device(hw), WORK)  # and 2 do


def test_the_cli_prints_the_table_and_the_commands_and_refuses_zero_hosts(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_70B))
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", str(folder), "--tpu", "v6e", "--hosts", "2", "--max-model-len", "8192",
                     "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    best = written["layouts"][0]
    assert f"pipejax serve --model {folder} -pp {best['pp']} -tp {best['tp']} -dp {best['dp']}" in printed
    assert written["best_commands"]["pipejax"] in printed and written["best_commands"]["vllm"] in printed
    if best["pp"] > 1:
        assert f"--pp-layer-partition {','.join(map(str, best['partition']))}" in printed
    assert "published per-chip figures" in printed
    assert cli.main(["plan", "--model", str(folder), "--hosts", "0"]) == 2
    assert "--hosts 0: a plan needs at least one host" in capsys.readouterr().err


def test_cpu_hosts_described_in_full_are_not_measured(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plan, "measure_cpu_host", lambda: pytest.fail("measured hosts described in full"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL))
    assert cli.main(["plan", "--model", str(folder), "--chips-per-host", "6", "--device-memory-gib", "8",
                     "--device-tflops", "0.15", "--device-bandwidth-gbs", "20"]) == 0
    assert "devices: given" in capsys.readouterr().out


def test_the_readmes_commands_plan_the_default_model_on_v6e_and_this_cpu_measured(capsys):
    # README: `pipejax plan --tpu v6e --hosts 2 --max-model-len 4096`, and the CPU host measured
    assert cli.main(["plan", "--tpu", "v6e", "--hosts", "2", "--max-model-len", "4096"]) == 0
    printed = capsys.readouterr().out
    assert "on 2 TPU v6e hosts x 8 chips" in printed and "\nbest: pp=" in printed
    assert "vllm serve " in printed and "SmolLM2-135M-Instruct" in printed  # vLLM is given the GGUF file's path
    host = plan.measure_cpu_host(seconds=0.05)
    assert host.shared_host and host.flops > 1e9 and host.bandwidth > 1e8 and host.memory_bytes > plan.GIB
    assert "measured" in host.source
    # README: `pipejax plan --chips-per-host 6 --measure` (SmolLM2's parts timed here, at tp 1 and 3)
    assert cli.main(["plan", "--chips-per-host", "6", "--measure"]) == 0
    printed = capsys.readouterr().out
    assert "decode steps from the model's parts measured on this host at 1, 16, 32, 64 rows" in printed
    assert "a stage process's memory" in printed and "proc GiB" in printed
    assert " 3 " in printed.split("best:")[0] and "\nbest: pp=" in printed  # tp=3 layouts, measured too


def test_hosts_are_read_from_ray_nodes_tpu_first_then_declared_devices():
    from pipejax.ray_executor.config import CPU_DEVICE_RESOURCE

    tpu = {"Alive": True, "Resources": {"CPU": 96, "TPU": 8, "accelerator_type:TPU-V6E": 1}}
    cpu = {"Alive": True, "Resources": {"CPU": 2, CPU_DEVICE_RESOURCE: 6, "memory": 8 * plan.GIB}}
    dead = {"Alive": False, "Resources": {"TPU": 8, "accelerator_type:TPU-V6E": 1}}
    hw, memory = plan.hosts_from_ray([tpu, tpu, dead, cpu], CPU_DEVICE_RESOURCE)
    assert (hw.platform, hw.generation, hw.num_hosts, hw.chips_per_host, memory) == ("tpu", "v6e", 2, 8, None)
    small = {"Alive": True, "Resources": {CPU_DEVICE_RESOURCE: 4, "memory": 6 * plan.GIB}}
    hw, memory = plan.hosts_from_ray([cpu, small], CPU_DEVICE_RESOURCE)
    assert (hw.platform, hw.num_hosts, hw.chips_per_host, memory) == ("cpu", 2, 4, 6 * plan.GIB)
    with pytest.raises(ValueError, match=r"lists no node with TPU chips or 'pipejax_cpu_device' devices \(1 alive\)"):
        plan.hosts_from_ray([{"Alive": True, "Resources": {"CPU": 2}}, dead], CPU_DEVICE_RESOURCE)


def test_the_cli_plans_for_a_live_ray_cluster(tmp_path, capsys, monkeypatch):
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a test cluster (Ray 2.60 turns token auth on by default)

    from pipejax.ray_executor.config import CPU_DEVICE_RESOURCE

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {CPU_DEVICE_RESOURCE: 4}})
    try:
        cluster.add_node(num_cpus=1, resources={CPU_DEVICE_RESOURCE: 4})
        cluster.wait_for_nodes()
        folder = tmp_path / "model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(SMALL))
        assert cli.main(["plan", "--model", str(folder), "--ray-address", cluster.address, "--device-tflops", "0.15",
                         "--device-bandwidth-gbs", "20"]) == 0
        printed = capsys.readouterr().out
        assert "on 2 CPU (simulated devices) hosts x 4 simulated devices = 8 devices" in printed
        assert "given: memory_bytes, flops, bandwidth" in printed  # the nodes' memory, the rates given
    finally:
        cluster.shutdown()


def test_weights_kept_quantized_are_planned_at_their_kept_size(tmp_path, capsys):
    """Llama-70B on one host of 4 v6e chips (4 x 32 GB): in bf16 its 141 GB of weights do not fit, kept int4 (~44 GB)
    they do; the commands carry the flag (vLLM's too, where it serves pipejax's int8 / int4)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_70B))
    hw = Hardware("tpu", num_hosts=1, chips_per_host=4, generation="v6e")
    bf16, int4 = (ModelConfig.from_pretrained(folder, quantization=q) for q in (None, "int4"))
    weights = [m.part_costs().stage_bytes(0, 80, 1, 0) for m in (bf16, int4)]
    assert 0.3 < weights[1] / weights[0] < 0.35  # ~0.63 of a byte a weight (Q4_0, its float32 scales) against 2
    with pytest.raises(ValueError, match=r"no layout fits .*131.42 GiB of weights.* 2 such hosts"):
        plan.plan(bf16, hw, plan.tpu_device(hw), WORK)
    best = plan.plan(int4, hw, plan.tpu_device(hw), WORK)[0]
    assert best.pp * best.tp * best.dp <= 4 and sum(best.stage_weight_bytes) < weights[0] / 2
    assert cli.main(["plan", "--model", str(folder), "--tpu", "v6e", "--chips-per-host", "4", "--max-model-len",
                     "4096", "--quantization", "int4"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("--quantization int4") == 2, printed


class _SameParts:
    """Stands in for ``plan.MeasuredParts``: the same measured parts at every batch size and tp, on 2 cores."""

    cores = 2

    def __init__(self, part: PartTimes, prefill: PartTimes | None = None, memory: StageMemory | None = None):
        self.part, self.prefill = part, prefill
        self._memory = memory or StageMemory(1, 0.0, dict.fromkeys(KINDS, 0.0), 0.0, "test")

    def __call__(self, tp: int) -> PartProfile:
        return PartProfile(tp, 576, (self.part,), "test", prefill=self.prefill)

    def memory(self, tp: int) -> StageMemory:
        return self._memory


def test_measured_parts_set_the_split_and_the_stage_times_slowed_by_the_cores_shared():
    model = ModelConfig.from_hf(SMALL)  # 30 layers
    ms = 1e-3
    part = PartTimes(64, layer_s=(1 * ms,) * 30, first_s=0.0, last_s=4 * ms, overhead_s=0.5 * ms, busy_cores=1.5)
    device = plan.DeviceSpec(memory_bytes=16 * plan.GIB, flops=100e9, bandwidth=20e9, source="test", shared_host=True,
                             parts=_SameParts(part))
    hw = Hardware("cpu", chips_per_host=8)
    alone = plan.predict(model, hw, device, WORK, pp=1, tp=1)
    assert alone.stage_time_s == pytest.approx((34.5 * ms,))  # 1.5 cores wanted of 2: not slowed
    # the head and sampler cost 4 layers: 17 / 13 evens the stages; two stages busy at once want 3 cores of 2
    split = plan.predict(model, hw, device, WORK, pp=2, tp=1)
    assert split.partition == (17, 13)
    assert split.stage_time_s == pytest.approx((17.5 * ms * 1.5, 17.5 * ms * 1.5))
    assert split.tpot_s == pytest.approx(2 * 17.5 * ms * 1.5)
    # the modelled costs (the head ~8 layers) would split otherwise: the measured ones decide
    assert balanced_partition(model.part_costs(), 2) == (19, 11)
    two_engines = plan.predict(model, hw, device, WORK, pp=1, tp=1, dp=2)
    assert two_engines.stage_time_s == pytest.approx((34.5 * ms * 1.5,))
    on_two_hosts = plan.predict(model, Hardware("cpu", num_hosts=2, chips_per_host=4), device, WORK, pp=1, tp=1, dp=2)
    assert on_two_hosts.stage_time_s == pytest.approx((34.5 * ms,))


def test_engines_sharing_the_cores_are_slowed_by_the_cores_their_whole_steps_keep_busy():
    model = ModelConfig.from_hf(SMALL)  # 30 layers
    ms = 1e-3
    # one-layer stages keep 1.2 cores busy, but a layer alone keeps 2 (all of this host's): a whole stage ~1.97
    cpu = PartTimes(64, layer_s=(2 * ms,) * 30, first_s=0.0, last_s=4 * ms, overhead_s=0.5 * ms, busy_cores=0.0)
    part = PartTimes(64, layer_s=(1 * ms,) * 30, first_s=0.0, last_s=4 * ms, overhead_s=0.5 * ms, busy_cores=1.2,
                     cpu=cpu)
    device = plan.DeviceSpec(memory_bytes=16 * plan.GIB, flops=100e9, bandwidth=20e9, source="test", shared_host=True,
                             parts=_SameParts(part))
    hw = Hardware("cpu", chips_per_host=8)
    whole = 34.5 * ms
    cores = 64.5 / 34.5  # the whole stage's CPU seconds over its seconds
    assert plan.predict(model, hw, device, WORK, pp=1, tp=1).stage_time_s == pytest.approx((whole,))
    # four engines at once want 4 x 1.87 cores of 2, where the one-layer stages' 1.2 would say 2.4x
    four = plan.predict(model, hw, device, WORK, pp=1, tp=1, dp=4)
    assert four.stage_time_s == pytest.approx((whole * 4 * cores / 2,))


def test_measure_is_refused_for_a_tpu_plan(capsys):
    assert cli.main(["plan", "--tpu", "v5e", "--measure"]) == 2
    assert "--measure times the model's parts on this host's CPU devices" in capsys.readouterr().err


def test_a_measured_prefill_step_sets_the_time_to_first_token_and_the_waves_throughput():
    model = ModelConfig.from_hf(SMALL)
    ms = 1e-3
    decode = PartTimes(64, layer_s=(1 * ms,) * 30, first_s=0.0, last_s=4 * ms, overhead_s=0.5 * ms, busy_cores=1.0)
    prefill = PartTimes(512, layer_s=(2 * ms,) * 30, first_s=0.0, last_s=1 * ms, overhead_s=1 * ms, busy_cores=1.0)
    device = plan.DeviceSpec(memory_bytes=16 * plan.GIB, flops=100e9, bandwidth=20e9, source="test", shared_host=True,
                             parts=_SameParts(decode, prefill))
    p = plan.predict(model, Hardware("cpu", chips_per_host=8), device, WORK, pp=1, tp=1)
    per_token = 62 * ms / 512  # the 512-token step's stage, taken as linear in tokens
    assert p.ttft_s == pytest.approx(per_token * WORK.prompt_len)
    assert p.rows == 64 and p.tpot_s == pytest.approx(34.5 * ms)
    wave = 64 * WORK.prompt_len * per_token + WORK.output_len * p.tpot_s  # 64 prompts prefilled, then decoded
    assert p.throughput == pytest.approx(64 * WORK.output_len / wave)
    # two stages: the prompts' chunks in flight overlap as decode steps do, the slower stage setting the pace
    two = plan.predict(model, Hardware("cpu", chips_per_host=8), device, WORK, pp=2, tp=1)
    first, second = two.partition
    stage_tokens = [(1 + 2 * first) * ms / 512, (1 + 2 * second + 1) * ms / 512]
    chunks = 64 * WORK.prompt_len // 512
    prefill_wave = chunks / 2 * max(2 * max(stage_tokens), sum(stage_tokens)) * 512
    assert two.throughput == pytest.approx(64 * WORK.output_len / (prefill_wave + WORK.output_len * two.tpot_s))


def test_the_kv_cache_is_what_the_rows_need_and_a_process_holds_its_runtime_and_its_stages():
    model = ModelConfig.from_hf(SMALL)  # 30 layers, bf16: 23040 bytes of K and V per token
    mib = 2**20
    part = PartTimes(64, layer_s=(1e-3,) * 30, first_s=0.0, last_s=4e-3, overhead_s=0.5e-3, busy_cores=1.0)
    memory = StageMemory(1, process_bytes=300 * mib, kind_bytes={"first": 20 * mib, "middle": 10 * mib,
                                                                  "last": 100 * mib, "whole": 110 * mib},
                         layer_bytes=2 * mib, source="test")
    device = plan.DeviceSpec(memory_bytes=16 * plan.GIB, flops=100e9, bandwidth=20e9, source="test", shared_host=True,
                             parts=_SameParts(part, memory=memory))
    hw = Hardware("cpu", chips_per_host=8)
    whole = plan.predict(model, hw, device, WORK, pp=1, tp=1)
    # 64 rows of max_model_len 4096: 256 blocks each and the padding block, though the host has room for more
    assert whole.kv_blocks == 1 + 64 * 256
    kv = whole.kv_blocks * 16 * 23040
    assert whole.stage_memory_bytes == pytest.approx((whole.stage_weight_bytes[0] + kv + 110 * mib + 30 * 2 * mib,))
    assert whole.process_memory_bytes == pytest.approx((300 * mib + whole.stage_memory_bytes[0],))
    # pp=2 in one process ('uni'): the runtime once, both stages; on Ray: an actor per stage, each its runtime
    one = plan.predict(model, hw, device, WORK, pp=2, tp=1)
    first, last = one.partition
    own = (20 * mib + 2 * mib * first, 100 * mib + 2 * mib * last)
    assert one.stage_memory_bytes == pytest.approx(tuple(
        w + one.kv_blocks * 16 * 23040 / 30 * n + o
        for w, n, o in zip(one.stage_weight_bytes, one.partition, own, strict=True)))
    assert one.process_memory_bytes == pytest.approx((300 * mib + sum(one.stage_memory_bytes),))
    actors = plan.predict(model, hw, device, WORK, pp=2, tp=1, backend="ray")
    assert actors.process_memory_bytes == pytest.approx(tuple(
        300 * mib + plan.RAY_ACTOR_BYTES + m for m in actors.stage_memory_bytes))
    # modelled (nothing measured): a stage's weights and KV, and no process figure
    modelled = plan.predict(model, hw, dataclasses.replace(device, parts=None), WORK, pp=1, tp=1)
    assert modelled.kv_blocks == whole.kv_blocks and modelled.process_memory_bytes == ()
    assert modelled.stage_memory_bytes == pytest.approx((modelled.stage_weight_bytes[0] + kv,))
