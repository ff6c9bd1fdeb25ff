"""pipejax.pp_utils: stage math, intermediate tensors, stage meshes, activation transport, topology."""

from pipejax.pp_utils.balance import PartCosts, balanced_partition
from pipejax.pp_utils.config import EXECUTOR_BACKENDS, ParallelConfig
from pipejax.pp_utils.intermediate import (
    IntermediateSpec,
    IntermediateTensors,
    SpecMismatchError,
    TensorSpec,
)
from pipejax.pp_utils.mesh import (
    TP_AXIS,
    ShardingRules,
    logical_sharding,
    logical_to_pspec,
    stage_devices,
    stage_mesh,
    stage_meshes,
)
from pipejax.pp_utils.partition import (
    PARTITION_ENV,
    parse_partition,
    partition_from_env,
    stage_layer_counts,
    stage_layer_range,
)
from pipejax.pp_utils.topology import (
    RankedWorker,
    WorkerRecord,
    rank_to_pp_tp,
    rank_workers,
)
from pipejax.pp_utils.transfer_transport import DESCRIPTOR_BYTES, TransferServerTransport
from pipejax.pp_utils.transport import (
    DEFAULT_RECEIVE_TIMEOUT_S,
    ActivationTransport,
    InProcessTransport,
    TransportAborted,
    TransportTimeout,
    place,
)

__all__ = [
    "PartCosts",
    "balanced_partition",
    "EXECUTOR_BACKENDS",
    "ParallelConfig",
    "DEFAULT_RECEIVE_TIMEOUT_S",
    "DESCRIPTOR_BYTES",
    "PARTITION_ENV",
    "partition_from_env",
    "TP_AXIS",
    "ActivationTransport",
    "InProcessTransport",
    "IntermediateSpec",
    "IntermediateTensors",
    "RankedWorker",
    "ShardingRules",
    "SpecMismatchError",
    "TensorSpec",
    "TransferServerTransport",
    "TransportAborted",
    "TransportTimeout",
    "WorkerRecord",
    "logical_sharding",
    "logical_to_pspec",
    "parse_partition",
    "place",
    "rank_to_pp_tp",
    "rank_workers",
    "stage_devices",
    "stage_layer_counts",
    "stage_layer_range",
    "stage_mesh",
    "stage_meshes",
]
