"""`mint` command line: `mint train RECIPE [section.key=value ...] [--resume | --dry-run]`, `mint keys`, the catalog's
commands (`mint revisions list|show|lineage|tag|gc|verify`, `mint export`; see mint/hub/cli.py), `mint serve` (the
server; mint/serve/), and `mint report RUN_DIR [--out DIR]` (plots and report.md of a run; mint/train/report.py).

A MintError (bad recipe, bad data path, unknown reward...), raised here or inside a Ray actor, prints one line and
exits 2 for configuration errors, 1 otherwise; no traceback. Ctrl-C exits 130 (docs/reliability.md). The last line
of a training run's stdout is one JSON object: the run summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mint.errors import ConfigError, MintError
from mint.hub import add_parsers as add_catalog_parsers
from mint.hub import run_command as run_catalog_command
from mint.serve import add_parsers as add_serve_parsers
from mint.serve import run_command as run_serve_command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mint", description="LoRA GRPO post-training on frozen sparse-MoE bases.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a GRPO recipe")
    train.add_argument("recipe", help="path to a TOML recipe, e.g. recipes/smoke.toml")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
    train.add_argument(
        "--resume", action="store_true", help="continue <logging.root>/<logging.name> from its latest checkpoint"
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="print the placement (actors on nodes and GPUs) and memory plan; start nothing",
    )
    train.add_argument("--gpu-memory", default="96GB", help="with --dry-run: memory per GPU for the plan, e.g. 141GB")
    sub.add_parser("keys", help="list every recipe key with its default and help")
    plan = sub.add_parser("plan", help="per-GPU memory plan of a recipe's learner at a real base's shapes")
    plan.add_argument("recipe", help="path to a TOML recipe")
    plan.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
    plan.add_argument("--gpus", type=int, default=None, help="learner GPUs (default: the recipe's learner.num_ranks)")
    plan.add_argument("--gpu-memory", default="96GB", help="memory per GPU, e.g. 96GB (H20), 141GB (H200)")
    plan.add_argument("--prompt-len", type=int, required=True, help="P: the longest prompt, in tokens")
    plan.add_argument(
        "--shape",
        default=None,
        help="a key of mint.models.shapes.SHAPES, e.g. qwen3_30b_a3b, qwen35_35b_a3b (default: model.path)",
    )
    plan.add_argument(
        "--expert-parallel",
        type=int,
        default=None,
        help="EP group size, experts split over it (default: the recipe's learner.expert_parallel)",
    )
    plan.add_argument(
        "--context-parallel",
        type=int,
        default=None,
        help="CP group size, prefix pages split over it (default: the recipe's longstraw.context_parallel)",
    )
    report = sub.add_parser("report", help="plots and a markdown report of a run directory")
    report.add_argument("run", help="a run directory, e.g. runs/smoke")
    report.add_argument("--out", default=None, help="where report.md and plots/ go (default: the run directory)")
    add_catalog_parsers(sub)
    add_serve_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # parse_known_args: overrides may also follow --resume (argparse stops a nargs="*" positional at a flag).
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command != "train" or any(a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides += extra
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.command in ("revisions", "export"):
            return run_catalog_command(args)
        if args.command == "serve":
            return run_serve_command(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "report":
            return _report(args)
        if args.command == "keys":
            from mint.config import config_markdown

            print(config_markdown())
            return 0
        from mint.config import load_config

        config = load_config(args.recipe, args.overrides)
        from mint.train.preflight import preflight

        checked = preflight(config)  # model, tokenizer, data, reward, stop tokens: before Ray is even imported
        if args.dry_run:  # the layout a run would reserve (docs/multinode.md); no actor, no placement group
            from mint.train.nodes import dry_run

            print(dry_run(config, checked.longest_prompt, args.gpu_memory))
            return 0
        from mint.train.driver import train  # heavy imports (ray, deepspeed) only once the recipe is valid

        summary = train(config, resume=args.resume, checked=checked)
    except KeyboardInterrupt:
        print("mint: interrupted; the step in flight was not checkpointed (resume with --resume)", file=sys.stderr)
        return 130
    except MintError as e:
        cause = _cause(e)
        kind = "config error" if isinstance(cause, ConfigError) else "error"
        print(f"mint: {kind}: {_one_line(cause)}", file=sys.stderr)
        return 2 if isinstance(cause, ConfigError) else 1
    print(json.dumps(summary), flush=True)
    _report_after_run(summary["run_dir"])
    if summary.get("interrupted"):
        print(
            f"mint: interrupted after step {summary['steps']}; checkpoint {summary['checkpoint']}; "
            f"continue with: mint train {args.recipe} --resume",
            file=sys.stderr,
        )
        return 130
    return 0


def _plan(args) -> int:
    """`mint plan`: print the per-GPU budget table; exit 0 when it fits, 1 when it does not."""
    from mint.config import load_config
    from mint.models.plan import Job, hub_shape, largest_prompt, make_plan, parse_bytes
    from mint.models.shapes import layer_config, shape
    from mint.train.preflight import check_expert_parallel

    # The layout flags become the recipe's own keys, so the learner's rules (EP x CP divides the ranks, EP on
    # ZeRO-1, CP under LongStraw) refuse here what `mint train` would refuse: a plan never fits a layout no run takes.
    layout = {
        "learner.num_ranks": args.gpus,
        "learner.expert_parallel": args.expert_parallel,
        "longstraw.context_parallel": args.context_parallel,
    }
    config = load_config(args.recipe, [*args.overrides, *(f"{k}={v}" for k, v in layout.items() if v is not None)])
    key = args.shape or hub_shape(config.model.path)
    if key is None:
        raise ConfigError(f"model.path {config.model.path!r} is not a known real base; pass --shape")
    real = shape(key)
    if config.learner.expert_parallel > 1:
        check_expert_parallel(config, layer_config(real, 1))  # preflight's check, on a config of the real dims
    job = Job(
        prompt_len=args.prompt_len,
        group=config.rollout.group_size,
        response_len=config.rollout.max_tokens,
        lora_rank=config.lora.rank,
        chunk=config.longstraw.chunk_size,
        mode="detached" if config.longstraw.mode != "exact" else "exact",
        data_parallel=config.learner.num_ranks,
        expert_parallel=config.learner.expert_parallel,
        context_parallel=config.longstraw.context_parallel,
        dtype_bytes=4 if config.model.dtype == "float32" else 2,
        indexer_replay=config.grpo.indexer_replay,
        quantization=config.model.quantization if config.model.quantization in ("fp8", "int4") else "none",
    )
    result = make_plan(real, key, job, parse_bytes(args.gpu_memory))
    print(result.table())
    largest = largest_prompt(real, key, job, parse_bytes(args.gpu_memory))
    print(f"largest prompt that fits at G={job.group}, R={job.response_len}: P = {largest:,}")
    return 0 if result.fits else 1


def _report_after_run(run_dir: str) -> None:
    """Every run ends with its report (`mint report`), named on stderr; a failed report never fails the run."""
    from mint.train.report import write_report

    try:
        print(f"mint: report {write_report(run_dir)}", file=sys.stderr)
    except (MintError, OSError, ValueError) as e:
        print(f"mint: no report ({_one_line(e)})", file=sys.stderr)


def _report(args) -> int:
    """`mint report`: print the path of the report written; exit 2 with one line when RUN is not a run directory."""
    from mint.train.report import NotARunError, write_report  # matplotlib, only for this command

    try:
        path = write_report(args.run, args.out)
    except NotARunError as e:
        print(f"mint: report: {_one_line(e)}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _cause(e: BaseException) -> BaseException:
    """The MintError itself, also when Ray wrapped it on its way out of an actor (RayTaskError keeps it as .cause)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, MintError) else e


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
