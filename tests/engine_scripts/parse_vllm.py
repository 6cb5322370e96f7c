"""Feed launch lines to vLLM's own argument parser and config validation, and report what vLLM made of each.

Runs in the engine virtualenv (vLLM, no Mint):

    python parse_vllm.py < CASES.json

CASES is a JSON list of {"name": str, "argv": [str, ...]}: one engine server's whole argv, as Mint would run it.
Two forms are understood, each through the parser its own entry point builds:

- `vllm serve MODEL ...`: the `vllm` CLI's top-level parser with the `serve` subcommand (`ServeSubcommand`
  .subparser_init, i.e. `make_arg_parser`), then `ServeSubcommand.validate` and the model_tag -> model step of
  `ServeSubcommand.cmd`;
- `PYTHON -m vllm.entrypoints.openai.api_server ...`: that module's `main` parser (`make_arg_parser` on a
  `FlexibleArgumentParser`), then `validate_parsed_serve_args`.

Then `AsyncEngineArgs.from_cli_args(args).create_engine_config()`: the VllmConfig a server would start with (model
config read from MODEL's config.json, LoRA config with its rank check, parallel config), which builds and starts
nothing.

One substitution, reported as "cpu_substitution": vLLM on a machine without Triton (this CPU build) refuses
--enable-return-routed-experts with "AuxOutput Connector requires Model Runner V2", a check of the platform, not of
the launch line; a GPU with Triton picks Model Runner V2 by default. There the config is built with the flag off, the
flag is set on the built config, and the config's own `_verify_aux_output_compatibility` runs with
VLLM_USE_V2_MODEL_RUNNER=1 (the runner a GPU picks), so the flag's other checks (MoE model, generate runner, prefix
caching, no PP/CP) still run.

Prints one JSON object on stdout: {name: {"ok", "stage" (where it was refused: "parse", "config" or "" when ok),
"error" (vLLM's message), "config": {"max_lora_rank", "max_loras", "tp", "dtype", "routed_experts", "is_moe",
"model"}, "cpu_substitution"}}.
"""

import argparse
import contextlib
import copy
import io
import json
import os
import sys
from pathlib import Path

# vLLM logs to stdout; keep stdout for the one JSON object.
_stdout = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args  # noqa: E402
from vllm.triton_utils import HAS_TRITON  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
NO_MRV2 = "AuxOutput Connector requires Model Runner V2"


class Refused(Exception):
    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


def parse(argv: list[str]) -> argparse.Namespace:
    """argv -> the Namespace vLLM's entry point would run with; Refused("parse", why) when it would not."""
    if Path(argv[0]).name == "vllm" and argv[1:2] == ["serve"]:
        parser = FlexibleArgumentParser(description="vLLM CLI")
        command = ServeSubcommand()
        command.subparser_init(parser.add_subparsers(required=False, dest="subparser"))
        words, validate = argv[1:], command.validate
    elif argv[1:3] == ["-m", API_SERVER_MODULE]:
        parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
        words, validate = argv[3:], validate_parsed_serve_args
    else:
        raise Refused("parse", f"not a vLLM launch line (`vllm serve` or `-m {API_SERVER_MODULE}`): {argv[:3]}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(words)
    except SystemExit:  # argparse's error(): usage, then "prog: error: ..." on stderr
        lines = [line for line in err.getvalue().splitlines() if "error:" in line]
        raise Refused("parse", lines[-1] if lines else err.getvalue().strip()) from None
    try:
        validate(args)
    except (ValueError, TypeError) as error:
        raise Refused("parse", str(error)) from None
    if getattr(args, "model_tag", None) is not None:  # ServeSubcommand.cmd: the positional model wins
        args.model = args.model_tag
    return args


def engine_config(args: argparse.Namespace):
    """The VllmConfig `args` start a server with, and the CPU substitution made (or "")."""
    try:
        return AsyncEngineArgs.from_cli_args(args).create_engine_config(), ""
    except Exception as error:  # pydantic's ValidationError and vLLM's ValueErrors alike
        if HAS_TRITON or NO_MRV2 not in str(error) or not getattr(args, "enable_return_routed_experts", False):
            raise Refused("config", " ".join(str(error).split())) from None
    # EngineArgs.__post_init__ sets the flag on the Namespace's AuxOutputConfig too: switch it off on a copy
    aux_off = copy.deepcopy(args.aux_output_config)
    aux_off.enable_return_routed_experts = False
    without = argparse.Namespace(**{**vars(args), "enable_return_routed_experts": False, "aux_output_config": aux_off})
    try:
        config = AsyncEngineArgs.from_cli_args(without).create_engine_config()
        config.aux_output_config.enable_return_routed_experts = True
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        try:
            config._verify_aux_output_compatibility()
        finally:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    except Exception as error:
        raise Refused("config", " ".join(str(error).split())) from None
    return config, f"no Triton here ({NO_MRV2}): routed-experts checks run as on Model Runner V2"


def check(argv: list[str]) -> dict:
    try:
        config, substitution = engine_config(parse(argv))
    except Refused as refused:
        return {"ok": False, "stage": refused.stage, "error": str(refused), "config": None, "cpu_substitution": ""}
    lora = config.lora_config
    return {
        "ok": True,
        "stage": "",
        "error": "",
        "config": {
            "max_lora_rank": lora.max_lora_rank if lora else None,
            "max_loras": lora.max_loras if lora else None,
            "tp": config.parallel_config.tensor_parallel_size,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "routed_experts": config.aux_output_config.enable_return_routed_experts,
            "is_moe": config.model_config.is_moe,
            "model": config.model_config.model,
        },
        "cpu_substitution": substitution,
    }


def main() -> None:
    cases = json.load(sys.stdin)
    report = {case["name"]: check(case["argv"]) for case in cases}
    _stdout.write(json.dumps(report) + "\n")
    _stdout.flush()


if __name__ == "__main__":
    main()
