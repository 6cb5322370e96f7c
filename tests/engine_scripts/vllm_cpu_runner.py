"""vLLM's CPU model runner for one checkpoint, built as its CPU worker builds it; shared by the engine scripts.

Imported by scripts that run in the engine virtualenv (vLLM, no Mint); the importer has already pointed stdout at
stderr (vLLM logs to stdout).
"""

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.distributed.parallel_state import destroy_model_parallel, model_parallel_is_initialized
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.network_utils import get_open_port
from vllm.v1.worker.cpu_model_runner import CPUModelRunner


def cpu_model_runner(args: EngineArgs):
    """(vllm config, CPUModelRunner with its model loaded) for `args`, inside one process-wide gloo world of one rank.

    The model-parallel groups are made per model, as its config makes them (an expert-parallel group only for a MoE
    config), so one process can build runners for several bases in turn. Callers that touch the model afterwards do
    so under `set_current_vllm_config(config)`."""
    config = args.create_engine_config()
    with set_current_vllm_config(config):
        if model_parallel_is_initialized():
            destroy_model_parallel()
        else:
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
                backend="gloo",
            )
        initialize_model_parallel(1, 1)
        runner = CPUModelRunner(config, torch.device("cpu"))
        runner.load_model()
    return config, runner
