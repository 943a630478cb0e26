"""Tensor parallelism: the sharding plan, the rank provider, the communicator, the engine's
step runner and the fixed-batch multi-process session (docs/parallel.md)."""

from core.parallel.comm import CommError, HostCommunicator
from core.parallel.runner import TensorParallelRunner
from core.parallel.session import RankError, TensorParallelSession
from core.parallel.shard import ShardPlan, plan_shards

__all__ = ["CommError", "HostCommunicator", "RankError", "ShardPlan", "TensorParallelRunner", "TensorParallelSession",
           "plan_shards"]
