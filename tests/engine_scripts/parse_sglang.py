"""Feed launch lines to SGLang's own argument parser and LoRA validation, and report what SGLang made of each.

Runs in the engine virtualenv (SGLang's wheel, installed without its dependencies; no Mint):

    python parse_sglang.py < CASES.json

CASES is a JSON list of {"name": str, "argv": [str, ...]}: one engine server's whole argv, as Mint would run it, in
the form `PYTHON -m sglang.launch_server ...`. The words after the module go to `prepare_server_args`, which is what
that module's __main__ calls: `ServerArgs.add_cli_args` on an argparse parser, then `ServerArgs.from_cli_args`.

Then the server's validation: `ServerArgs.resolve_once()` (the resolution pipeline a launch runs, which loads the
model's config) and `check_server_args()`. The pipeline imports sglang.srt.configs, which needs torchvision; where
that import fails (a CPU environment: the registry's torchvision wheels for this torch are CUDA builds), the record
is parsed again and only the LoRA part of the validation runs, `sglang.srt.arg_groups.lora_hook.
check_lora_server_args` (what check_server_args calls for LoRA: --max-lora-rank with --lora-target-modules, the
modules' set, "all" alone), and "validated" says so.

Prints one JSON object on stdout: {name: {"ok", "stage" ("import", "parse", "validate", or "" when ok), "error"
(SGLang's message), "validated" (which validation ran), "args": {"tp", "dtype", "max_lora_rank", "lora_modules",
"enable_lora", "routed_experts", "model"}}}. When SGLang itself cannot be imported, every case reports stage "import"
with the missing module.
"""

import contextlib
import io
import json
import os
import sys

# SGLang may log to stdout; keep stdout for the one JSON object.
_stdout = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

LAUNCH_MODULE = "sglang.launch_server"


class Refused(Exception):
    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage


def parse(prepare_server_args, argv: list[str]):
    """argv -> the ServerArgs `python -m sglang.launch_server` would start with; Refused("parse", why) if none."""
    if argv[1:3] != ["-m", LAUNCH_MODULE]:
        raise Refused("parse", f"not an SGLang launch line (`-m {LAUNCH_MODULE}`): {argv[:3]}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return prepare_server_args(argv[3:])
    except SystemExit:  # argparse's error(): usage, then "prog: error: ..." on stderr
        lines = [line for line in err.getvalue().splitlines() if "error:" in line]
        raise Refused("parse", lines[-1] if lines else err.getvalue().strip()) from None


def validate(prepare_server_args, argv: list[str]):
    """The parsed ServerArgs after SGLang's validation, and which validation that was."""
    from sglang.srt.arg_groups.lora_hook import check_lora_server_args

    server_args = parse(prepare_server_args, argv)
    try:
        server_args.resolve_once()
        server_args.check_server_args()
        return server_args, "resolve_once + check_server_args"
    except ModuleNotFoundError as missing:
        if missing.name != "torchvision":
            raise Refused("validate", f"{type(missing).__name__}: {missing}") from None
        reason = f"check_lora_server_args (resolve_once needs {missing.name}, absent here)"
    except Exception as error:  # SGLang validates with asserts and ValueErrors
        raise Refused("validate", f"{type(error).__name__}: {error}") from None
    server_args = parse(prepare_server_args, argv)  # a record whose resolution failed cannot be validated again
    try:
        check_lora_server_args(server_args)
    except Exception as error:
        raise Refused("validate", f"{type(error).__name__}: {error}") from None
    return server_args, reason


def check(prepare_server_args, argv: list[str]) -> dict:
    try:
        args, validated = validate(prepare_server_args, argv)
    except Refused as refused:
        return {"ok": False, "stage": refused.stage, "error": str(refused), "validated": "", "args": None}
    return {
        "ok": True,
        "stage": "",
        "error": "",
        "validated": validated,
        "args": {
            "tp": args.tp_size,
            "dtype": args.dtype,
            "max_lora_rank": args.max_lora_rank,
            "lora_modules": sorted(args.lora_target_modules or ()),
            "enable_lora": args.enable_lora,
            "routed_experts": args.enable_return_routed_experts,
            "model": args.model_path,
        },
    }


def main() -> None:
    cases = json.load(sys.stdin)
    try:
        from sglang.srt.server_args import prepare_server_args
    except ImportError as error:
        missing = {"ok": False, "stage": "import", "error": f"{type(error).__name__}: {error}", "validated": ""}
        report = {case["name"]: {**missing, "args": None} for case in cases}
    else:
        report = {case["name"]: check(prepare_server_args, case["argv"]) for case in cases}
    _stdout.write(json.dumps(report) + "\n")
    _stdout.flush()


if __name__ == "__main__":
    main()
