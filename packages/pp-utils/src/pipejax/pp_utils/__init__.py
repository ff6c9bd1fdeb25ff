"""pipejax.pp_utils: stage math, intermediate tensors, stage meshes, activation transport, topology.

Names load with their module on first use (PEP 562), so the modules that need no JAX (``config``,
``partition``, ``balance``) can be imported before JAX is configured: the command line reads the
layout's defaults from them before it sets the simulated devices JAX reads at import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_MODULES = {
    "balance": ("PartCosts", "balanced_partition"),
    "config": ("EXECUTOR_BACKENDS", "ParallelConfig"),
    "intermediate": ("IntermediateSpec", "IntermediateTensors", "SpecMismatchError", "TensorSpec"),
    "mesh": ("TP_AXIS", "ShardingRules", "logical_sharding", "logical_to_pspec", "stage_devices", "stage_mesh",
             "stage_meshes"),
    "partition": ("PARTITION_ENV", "parse_partition", "partition_from_env", "stage_layer_counts",
                  "stage_layer_range"),
    "topology": ("RankedWorker", "WorkerRecord", "rank_to_pp_tp", "rank_workers"),
    "transfer_descriptor": ("DESCRIPTOR_BYTES",),
    "transfer_transport": ("TransferServerTransport",),
    "transport": ("DEFAULT_RECEIVE_TIMEOUT_S", "ActivationTransport", "InProcessTransport", "TransportAborted",
                  "TransportTimeout", "place"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # the same names, for type checkers and editors
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
    from pipejax.pp_utils.transfer_descriptor import DESCRIPTOR_BYTES
    from pipejax.pp_utils.transfer_transport import TransferServerTransport
    from pipejax.pp_utils.transport import (
        DEFAULT_RECEIVE_TIMEOUT_S,
        ActivationTransport,
        InProcessTransport,
        TransportAborted,
        TransportTimeout,
        place,
    )
