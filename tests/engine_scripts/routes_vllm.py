"""Encode expert routes the way a vLLM server does for `routed_experts` on a completions response.

Runs in the engine virtualenv (vLLM, no Mint):

    python routes_vllm.py < CASES.json

CASES is a JSON list of {"name": str, "model": DIR, "ids": [[[int]]]}: DIR a checkpoint directory (config.json only:
the weights are vLLM's dummy ones), ids[s][j] the top-k expert ids of position s at the j-th MoE layer, [S, L_moe, k];
other keys are ignored.

For each case the model is built as vLLM's CPU worker builds it (`CPUModelRunner.load_model`, load_format "dummy":
the real model class for the architecture, its dense and MoE layers), and a `RoutedExpertsCapturer` (the worker's
buffer: one row per decoder layer, ids narrowed to uint8 up to 256 experts, else uint16) is bound to its MoE routers
with `bind_routed_experts_capturer`, as the worker binds it. Each router's own capture callback then gets the j-th MoE
layer's ids, routers taken in vLLM's layer order; `snapshot_routing_data` gives the [S, L_all, k] rows (a dense
layer's stay zero) that the server sends, and `vllm.utils.serial_utils.numpy2base64` (what the completions endpoint
calls on `output.routed_experts`) encodes them. One step of S tokens stands for the server's prefill and decode
steps; the per-request gathering between capture and response (the aux-output connector) is not run.

Prints one JSON object on stdout: {name: {"encoded": the base64 string, "layer_ids": the decoder-layer index of each
MoE router vLLM bound, "num_layers": rows per position, "dtype": the array's dtype}}, or {name: {"error": ...}}.
"""

import json
import os
import sys

# vLLM logs to stdout; keep stdout for the one JSON object.
_stdout = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.fused_moe.layer import MoERunner  # noqa: E402
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (  # noqa: E402
    RoutedExpertsCapturer,
    bind_routed_experts_capturer,
)
from vllm.utils.serial_utils import numpy2base64  # noqa: E402
from vllm_cpu_runner import cpu_model_runner  # noqa: E402

MAX_TOKENS = 64


def encode(model_dir: str, ids_S_M_K: torch.Tensor) -> dict:
    config, runner = cpu_model_runner(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            load_format="dummy",
            enforce_eager=True,
            max_model_len=MAX_TOKENS,
            max_num_seqs=1,
            max_num_batched_tokens=MAX_TOKENS,
            skip_tokenizer_init=True,
        )
    )
    with set_current_vllm_config(config):
        model = runner.model
        capturer = RoutedExpertsCapturer(max_num_batched_tokens=MAX_TOKENS, vllm_config=config)
        bind_routed_experts_capturer(model, capturer)
        routers = sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
        if len(routers) != ids_S_M_K.shape[1]:
            raise ValueError(f"vLLM bound {len(routers)} MoE routers; the case has {ids_S_M_K.shape[1]} MoE layers")
        with set_forward_context(None, config):
            for j, runner in enumerate(routers):
                runner.router.capture_fn(ids_S_M_K[:, j].contiguous())
        rows_S_L_K = capturer.snapshot_routing_data(ids_S_M_K.shape[0]).cpu().numpy()
    return {
        "encoded": numpy2base64(rows_S_L_K),
        "layer_ids": [m.layer_id for m in routers],
        "num_layers": int(rows_S_L_K.shape[1]),
        "dtype": str(rows_S_L_K.dtype),
    }


def main() -> None:
    report = {}
    for case in json.load(sys.stdin):
        try:
            report[case["name"]] = encode(case["model"], torch.tensor(case["ids"], dtype=torch.int64))
        except Exception as error:
            report[case["name"]] = {"error": f"{type(error).__name__}: {' '.join(str(error).split())}"}
    _stdout.write(json.dumps(report) + "\n")
    _stdout.flush()


if __name__ == "__main__":
    main()
