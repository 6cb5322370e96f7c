"""`mint` command line: `mint train RECIPE [section.key=value ...]`, `mint keys`, and the catalog's commands
(`mint revisions list|show|lineage|tag|gc`, `mint export`, `mint serve`; see mint/revisions_cli.py).

A MintError (bad recipe, bad data path, unknown reward...) prints one line and exits 2 for configuration errors,
1 otherwise; no traceback. The last line of a training run's stdout is one JSON object: the run summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mint.errors import ConfigError, MintError
from mint.hub import add_parsers
from mint.hub import run_command as run_catalog_command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mint", description="LoRA GRPO post-training on frozen sparse-MoE bases.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a GRPO recipe")
    train.add_argument("recipe", help="path to a TOML recipe, e.g. recipes/smoke.toml")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
    sub.add_parser("keys", help="list every recipe key with its default and help")
    add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.command in ("revisions", "export", "serve"):
            return run_catalog_command(args)
        if args.command == "keys":
            from mint.config import config_markdown

            print(config_markdown())
            return 0
        from mint.config import load_config

        config = load_config(args.recipe, args.overrides)
        from mint.train.driver import train  # heavy imports (ray, deepspeed) only once the recipe is valid

        summary = train(config)
    except ConfigError as e:
        print(f"mint: config error: {e}", file=sys.stderr)
        return 2
    except MintError as e:
        print(f"mint: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
