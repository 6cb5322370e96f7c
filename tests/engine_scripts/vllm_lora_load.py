"""Load LoRA adapter directories through vLLM's own LoRA path, on CPU, and report what vLLM holds.

Runs in the engine virtualenv (vLLM, no Mint):

    python vllm_lora_load.py OUT_DIR RANK BASE ADAPTER [BASE ADAPTER ...]

For each BASE (a checkpoint directory) it builds the model the way vLLM's CPU worker does (`CPUModelRunner`, then
`load_model`: the real model class for the architecture, its weights, and the LRU LoRA worker manager wrapping its
layers), and for each ADAPTER on that base calls `add_lora`, which is what /v1/load_lora_adapter reaches: PEFTHelper,
`LoRAModel.from_local_checkpoint` with the modules the model class declares, the format check, the packing of
per-expert LoRA into the fused-MoE wrapper, and `set_lora` into the stacked buffers the kernels read.

Prints one JSON object on stdout: {"bases": {BASE: {model class, is_3d_moe_weight, wrapper class per module}},
"adapters": [{"base", "adapter", "ok", "error", "dump"}]}. A loaded adapter's dump (OUT_DIR/<n>.safetensors) holds slot
0 of every stacked LoRA buffer, as `{module}.{buffer}.{slice}`, e.g. `model.layers.1.mlp.experts.w13_lora_a_stacked.0`
(gate_proj A of all experts, [E, max_rank, H]); vLLM folds the scale alpha / r into B when it packs.
"""

import json
import os
import sys

# vLLM logs to stdout; keep stdout for the one JSON object.
_stdout = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

from safetensors.torch import save_file  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.lora.layers import BaseLayerWithLoRA  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402
from vllm_cpu_runner import cpu_model_runner  # noqa: E402

BUFFERS = (
    "lora_a_stacked",
    "lora_b_stacked",
    "w13_lora_a_stacked",
    "w13_lora_b_stacked",
    "w2_lora_a_stacked",
    "w2_lora_b_stacked",
)


def runner_for(base: str, rank: int) -> CPUModelRunner:
    args = EngineArgs(
        model=base,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=rank,
        max_loras=1,
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        skip_tokenizer_init=True,
        # a VLM checkpoint (Qwen3_5MoeForConditionalGeneration) builds its multimodal processor from a tokenizer, which
        # the tiny bases lack: the text path only, as `--language-model-only` serves it (no effect on a text model)
        language_model_only=True,
    )
    return cpu_model_runner(args)[1]


def dump(runner: CPUModelRunner, path: str) -> None:
    """Slot 0 of each wrapped layer's stacked LoRA buffers (tuples of [max_loras, ...] tensors; the per-expert lists
    of FusedMoEWithLoRA are views into its w13/w2 buffers and are skipped)."""
    out = {}
    for name, module in runner.lora_manager._adapter_manager.modules.items():
        for buffer in BUFFERS:
            stacked = getattr(module, buffer, None)
            if isinstance(stacked, tuple):
                for i, t in enumerate(stacked):
                    out[f"{name}.{buffer}.{i}"] = t[0].detach().clone().contiguous()
    save_file(out, path)


def main(argv: list[str]) -> dict:
    out_dir, rank, pairs = argv[0], int(argv[1]), argv[2:]
    by_base: dict[str, list[tuple[int, str]]] = {}
    for n, (base, adapter) in enumerate(zip(pairs[0::2], pairs[1::2], strict=True)):
        by_base.setdefault(base, []).append((n, adapter))
    bases: dict[str, dict] = {}
    adapters = []
    for base, todo in by_base.items():  # one base at a time: its model-parallel groups are its own
        runner = runner_for(base, rank)
        manager = runner.lora_manager._adapter_manager
        bases[base] = {
            "model_class": type(runner.model).__name__,
            "is_3d_moe_weight": bool(getattr(manager.model, "is_3d_moe_weight", False)),
            "wrappers": {
                name: type(m).__name__ for name, m in manager.modules.items() if isinstance(m, BaseLayerWithLoRA)
            },
        }
        for n, adapter in todo:
            record = {"base": base, "adapter": adapter, "ok": False, "error": None, "dump": None}
            with set_current_vllm_config(runner.vllm_config):
                try:
                    runner.add_lora(LoRARequest(f"adapter-{n}", n + 1, adapter))
                except Exception as err:  # what /v1/load_lora_adapter turns into its error response
                    record["error"] = f"{type(err).__name__}: {err}"
                else:
                    record["ok"] = True
                    record["dump"] = os.path.join(out_dir, f"{n}.safetensors")
                    dump(runner, record["dump"])
                    runner.remove_lora(n + 1)
            adapters.append(record)
    return {"bases": bases, "adapters": adapters}


if __name__ == "__main__":
    result = main(sys.argv[1:])
    _stdout.write(json.dumps(result) + "\n")
    _stdout.flush()
