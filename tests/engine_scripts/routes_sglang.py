"""Encode expert routes the way an SGLang server does for `meta_info.routed_experts` on a /generate response.

Runs in the engine virtualenv (SGLang's wheel, installed without its dependencies; no Mint):

    python routes_sglang.py < CASES.json

CASES is a JSON list of {"name": str, "model": DIR, "layer_ids": [int], "ids": [[[int]]]}: DIR a checkpoint
directory (its config.json), layer_ids the decoder-layer index of each MoE layer, ids[s][j] the top-k expert ids of
position s at MoE layer layer_ids[j], [S, L_moe, k].

Each case's rows are laid out as SGLang's `RoutedExpertsCapturer` sizes its buffers (sglang/srt/state_capturer/
routed_experts.py: int32, one row per decoder layer, `hf_text_config.num_hidden_layers` of them, and
`num_experts_per_tok` ids; read here from config.json, since that module cannot be imported without torchvision), the
MoE layers' ids at their layer index and zeros elsewhere, as a dense layer leaves its rows. The detokenizer then
encodes each request's [S, L_all, k] tensor with `DetokenizerManager._b64_encode_per_request`, which this script calls.

sglang.srt.managers.detokenizer_manager imports sglang.srt.configs, which needs torchvision (the registry's
torchvision wheels for this torch are CUDA builds that do not load on a CPU torch), and SGLang's dependencies, which
the engine environment leaves out. Where that import fails, the function is compiled from the installed
detokenizer_manager.py itself (its source as SGLang ships it, with pybase64, the one name its body takes from its
module), and "via" names the missing module.

Prints one JSON object on stdout: {name: {"encoded": the base64 string, "num_layers": rows per position, "via": how
the encoder was reached}}, or {name: {"error": ...}}.
"""

import __future__

import ast
import importlib.util
import json
import os
import sys
from pathlib import Path

# SGLang may log to stdout; keep stdout for the one JSON object.
_stdout = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import pybase64  # noqa: E402
import torch  # noqa: E402

MODULE = "sglang.srt.managers.detokenizer_manager"
CLASS, FUNCTION = "DetokenizerManager", "_b64_encode_per_request"


def detokenizer_encoder():
    """(SGLang's per-request base64 encoder, how it was reached)."""
    try:
        from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    except ModuleNotFoundError as missing:  # the encoder itself needs only pybase64 and torch
        why = missing.name
    else:
        return DetokenizerManager._b64_encode_per_request, f"{MODULE}.{CLASS}.{FUNCTION}"
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    path = root / "srt" / "managers" / "detokenizer_manager.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == CLASS)
    fn = next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == FUNCTION)
    fn.decorator_list = []  # a @staticmethod: plain function once out of its class
    namespace = {"pybase64": pybase64}  # what its body uses; its annotations stay unevaluated strings
    module = ast.Module(body=[fn], type_ignores=[])
    exec(compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag), namespace)
    return namespace[FUNCTION], f"{CLASS}.{FUNCTION} compiled from {path.name} ({MODULE} needs {why}, absent here)"


def rows(model_dir: str, layer_ids: list[int], ids_S_M_K: torch.Tensor) -> torch.Tensor:
    """[S, num_hidden_layers, num_experts_per_tok] int32: the MoE layers' ids at their index, zeros elsewhere."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    num_layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    if ids_S_M_K.shape[2] != top_k or len(layer_ids) != ids_S_M_K.shape[1]:
        raise ValueError(f"ids {tuple(ids_S_M_K.shape)} do not fit {len(layer_ids)} MoE layers of top-{top_k}")
    out_S_L_K = torch.zeros((ids_S_M_K.shape[0], num_layers, top_k), dtype=torch.int32)
    out_S_L_K[:, layer_ids] = ids_S_M_K.to(torch.int32)
    return out_S_L_K


def main() -> None:
    cases = json.load(sys.stdin)
    try:
        encode, via = detokenizer_encoder()
    except Exception as error:
        failed = {"error": f"{type(error).__name__}: {error}"}
        report = {case["name"]: failed for case in cases}
    else:
        report = {}
        for case in cases:
            try:
                routes = rows(case["model"], case["layer_ids"], torch.tensor(case["ids"], dtype=torch.int64))
                report[case["name"]] = {"encoded": encode([routes])[0], "num_layers": routes.shape[1], "via": via}
            except Exception as error:
                report[case["name"]] = {"error": f"{type(error).__name__}: {error}"}
    _stdout.write(json.dumps(report) + "\n")
    _stdout.flush()


if __name__ == "__main__":
    main()
