"""distributed package: process groups (tensor and pipeline parallel) and their collectives."""
from pagedllm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_model_parallel,
    get_pp_group,
    get_tp_group,
    init_model_parallel,
)
from pagedllm.distributed.pipeline import IntermediateTensors, stage_layer_range

__all__ = [
    "GroupCoordinator", "IntermediateTensors", "destroy_model_parallel", "get_pp_group", "get_tp_group",
    "init_model_parallel", "stage_layer_range",
]
