"""The catalog's command line: `mint revisions list|show|lineage|tag|gc|verify` and `mint export` (`mint serve` is
mint/serve/_cli.py).

Every command takes `--catalog DIR` (default: $MINT_CATALOG). Output is human-readable by default and JSON with
`--json` (one object per line for lists). Errors are `MintError`s: `mint` prints one line and exits 1. `verify` exits
0 when everything checked is whole, 1 when anything is bad, and 2 for a usage error (no catalog, an unknown ref).
`show` exits 1, after the metadata, when the revision's files do not check out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sqlite3
import sys
import time

from mint.errors import MintError

_WHERE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)\s*(<=|>=|!=|<|>|=)\s*(-?[0-9.eE+-]+)$")


def _catalog_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--catalog", default=os.environ.get("MINT_CATALOG"), help="catalog directory (default: $MINT_CATALOG)"
    )


def add_parsers(sub) -> None:
    """Register `revisions` and `export` on the `mint` subparsers."""
    rev = sub.add_parser("revisions", help="list, inspect, tag and garbage-collect adapter revisions")
    rsub = rev.add_subparsers(dest="revisions_command", required=True)

    p = rsub.add_parser("list", help="revisions, newest first")
    _catalog_arg(p)
    p.add_argument("--run", help="only this run")
    p.add_argument("--tag", help="only revisions with this tag")
    p.add_argument("--min-step", type=int)
    p.add_argument("--max-step", type=int)
    p.add_argument("--where", action="append", default=[], metavar="METRIC<OP>VALUE", help="e.g. reward_mean>=0.5")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true", help="one JSON object per line")

    for name, text in (("show", "one revision's metadata, tags and names"), ("lineage", "a revision and ancestors")):
        p = rsub.add_parser(name, help=text)
        _catalog_arg(p)
        p.add_argument("rev", help="id, id prefix, name, RUN@latest or RUN@STEP")
        p.add_argument("--json", action="store_true")
        if name == "lineage":
            p.add_argument("--limit", type=int, default=None)

    p = rsub.add_parser("tag", help="tag a revision (tagged revisions survive gc), or name it with --name")
    _catalog_arg(p)
    p.add_argument("rev")
    p.add_argument("label", help="the tag (or the name with --name)")
    p.add_argument("--name", action="store_true", help="set a unique name instead of a tag (moves an existing one)")
    p.add_argument("--remove", action="store_true", help="remove the tag or name")

    p = rsub.add_parser("gc", help="reclaim tensors of old revisions: keep the N latest per run plus tagged/named")
    _catalog_arg(p)
    p.add_argument("--keep-last", type=int, required=True, help="revisions kept per run (0 keeps all)")
    p.add_argument("--run", help="only reclaim in this run")
    p.add_argument("--drop-entries", action="store_true", help="also remove entries with no kept descendant")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")

    p = rsub.add_parser("verify", help="re-hash revisions and record shards and check them against the index (fsck)")
    _catalog_arg(p)
    p.add_argument("refs", nargs="*", metavar="REF", help="revisions to check, with their record shards")
    p.add_argument("--all", action="store_true", help="check every entry, every record shard and the index itself")
    p.add_argument("--json", action="store_true", help="one JSON object per finding, then a summary object")

    p = sub.add_parser("export", help="export a revision: peft (default), per-expert (vLLM/SGLang) or merged")
    _catalog_arg(p)
    p.add_argument("rev")
    p.add_argument("--format", default="peft", choices=("peft", "per-expert", "merged"))
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--base", help="base model path (default: the one the revision records)")


def _open(args, create: bool = False):
    from mint.hub.catalog import Catalog

    if not args.catalog:
        raise MintError("no catalog: pass --catalog DIR (a run publishes to runs/<name>/catalog) or set MINT_CATALOG")
    return Catalog(args.catalog, create=create)


def _line(meta) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(meta.created))
    reward = meta.metrics.get("reward_mean")
    reward = f"{reward:.3f}" if isinstance(reward, (int, float)) else "-"
    parent = meta.parent[:12] if meta.parent else "-"
    flag = "" if meta.stored else "  (tensors reclaimed)"
    return f"{meta.id[:12]}  {meta.run:<16} step {meta.step:>6}  parent {parent:<12}  reward {reward}  {when}{flag}"


def _parse_where(items: list[str]) -> list[tuple[str, str, float]]:
    out = []
    for item in items:
        m = _WHERE.match(item.strip())
        if not m:
            raise MintError(f"--where {item}: expected METRIC OP NUMBER, e.g. reward_mean>=0.5")
        out.append((m.group(1), m.group(2), float(m.group(3))))
    return out


def _usage_error(text: str) -> int:
    print(f"mint: error: {text}", file=sys.stderr)
    return 2


def _verify(args) -> int:
    """`mint revisions verify`: one line per bad or pruned entry, then a summary; exit 0, 1 (bad) or 2 (usage)."""
    from mint.hub.integrity import verify_catalog

    if bool(args.refs) == args.all:
        return _usage_error("revisions verify: name revisions (REF ...) or pass --all, not both")
    try:
        with _open(args) as cat:
            report = verify_catalog(cat, None if args.all else args.refs)
    except MintError as err:  # no catalog, or an unknown or ambiguous ref: nothing was checked
        return _usage_error(str(err))
    except sqlite3.DatabaseError as err:  # the index file itself is damaged
        print(f"mint: error: {args.catalog}: catalog index unreadable ({err})", file=sys.stderr)
        return 1
    for p in report.problems:
        print(json.dumps(dataclasses.asdict(p)) if args.json else p.line())
    if args.json:
        print(json.dumps({"revisions": report.revisions, "shards": report.shards, "ok": report.ok}))
    else:
        print(report.summary())
    return 0 if report.ok else 1


def _revisions(args) -> int:
    if args.revisions_command == "verify":
        return _verify(args)
    with _open(args) as cat:
        cmd = args.revisions_command
        if cmd == "list":
            metas = cat.list(
                args.run,
                tag=args.tag,
                min_step=args.min_step,
                max_step=args.max_step,
                metrics=_parse_where(args.where),
                limit=args.limit,
            )
            for m in metas:
                print(json.dumps(m.to_dict()) if args.json else _line(m))
        elif cmd == "show":
            meta = cat.get(args.rev)
            info = {
                **meta.to_dict(),
                "tags": [t for t, _ in cat.tags(meta.id)],
                "names": sorted(cat.names(meta.id)),
                "children": [c.id for c in cat.children(meta.id)],
                "path": str(cat.revision_dir(meta.id)),
                "records": [r.path for r in cat.records(revision=meta.id)],
            }
            print(json.dumps(info, indent=None if args.json else 2, sort_keys=True))
            from mint.hub.integrity import check_revision

            problem = check_revision(cat, meta)
            if problem is not None and problem.bad:
                print(f"mint: error: revision {meta.id[:12]}: {problem.what}", file=sys.stderr, flush=True)
                return 1
        elif cmd == "lineage":
            for m in cat.lineage(args.rev, args.limit):
                print(json.dumps(m.to_dict()) if args.json else _line(m))
        elif cmd == "tag":
            if args.name:
                rid = None if args.remove else cat.name(args.label, args.rev)
                if args.remove:
                    cat.unname(args.label)
            else:
                rid = cat.untag(args.rev, args.label) if args.remove else cat.tag(args.rev, args.label)
            verb = "removed" if args.remove else ("named" if args.name else "tagged")
            print(json.dumps({"label": args.label, "revision": rid, "action": verb}))
        elif cmd == "gc":
            plan = cat.plan_gc(args.keep_last, args.run, args.drop_entries)
            if not args.dry_run:
                cat.apply_gc(plan)
            print(
                json.dumps(
                    {
                        "dry_run": args.dry_run,
                        "kept": len(plan.keep),
                        "reclaimed": len(plan.prune),
                        "dropped_entries": len(plan.drop),
                        "orphans": len(plan.orphans),
                        "bytes_freed": plan.bytes_freed,
                    }
                )
            )
    return 0


def run_command(args) -> int:
    """Dispatch `revisions` and `export`."""
    if args.command == "revisions":
        return _revisions(args)
    if args.command == "export":
        from mint.hub.export import export

        with _open(args) as cat:
            print(json.dumps(export(cat, args.rev, args.out, args.format, args.base)))
        return 0
    raise MintError(f"unknown command {args.command}")
