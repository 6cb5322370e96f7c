"""The nodes of a run, checked before any actor starts, and the launch scripts' wait for them.

Every node that will host an actor runs one small task there (0 CPUs, pinned to the node; the cluster's start-up,
`mint.train.cluster.check_nodes`, runs them: `node_checks` prepares each node's check, `check_node` is the task,
`NodeChecks.paths` reads the answers) before the actors are created, so a hidden one-machine assumption fails in
seconds with one line naming the node:

- **The base model.** A local `model.path` must be a model directory at the same absolute path on that node; a hub
  id must be in that node's Hugging Face cache (nothing is downloaded). A `tiny:` base is built once, on the driver,
  and its files are shipped through the object store into the node's own cache (`$MINT_CACHE`, else
  ~/.cache/mint, as the node's Ray daemon sees it). A node that already holds a build under the same name keeps
  using it only when its digest (sha256 over the file names and bytes) equals the driver's; otherwise the shipped
  copy goes beside it, named by its digest, so every actor loads the same bytes.
- **The run directory.** Learner ranks write their parts of each checkpoint into it, so a learner rank on a node
  other than the driver's needs the run directory at the same path: shared storage. The driver leaves a probe file
  there and each such node must read it back.

`python -m mint.train.nodes wait --address HOST:PORT --nodes N [--gpus G] [--timeout S]` (launch/wait_for_nodes.sh)
polls the cluster until N nodes with G GPUs in all have joined, or fails after S seconds with one line naming what is
missing.

On a Ray this process started (no `ray.address`) the driver's node is this machine, and its check runs in the
driver: the model is already where the driver put it, and a task would cost a worker process of its own (its
start-up and imports: about 1.5 s of a 1-step smoke run's 29 on 2 cores, on every run and every test that trains).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.runtime_context import get_runtime_context

from mint.config import Config
from mint.errors import ConfigError, MintError
from mint.train.placement import Node, local_node, memory_plan, node_name, order_nodes, plan_layout

PROBE_PREFIX = ".node-probe-"


def driver_model_path(spec: str) -> str:
    """The model path the driver hands its nodes: a `tiny:` base built here (its cache folder), a local directory
    made absolute (a node's worker does not share the driver's working directory), a hub id unchanged."""
    from mint.models.tiny import resolve_model_path

    path = resolve_model_path(spec)
    return os.path.abspath(path) if os.path.isdir(path) else path


def check_run_paths(config: Config) -> None:
    """The driver's own paths, before anything is written. Under `ray job submit --working-dir`, the driver runs in
    Ray's temporary copy of that directory, which is deleted with the job: a relative logging.root or catalog.path
    would vanish with it, so they must be absolute there (launch/submit.sh passes one). And the catalog must not be
    on a network filesystem (mint.hub.require_local_fs)."""
    from mint.hub import catalog_dir, require_local_fs

    cwd = os.getcwd()
    if f"{os.sep}working_dir_files{os.sep}" in cwd + os.sep:
        for key, value in (("logging.root", config.logging.root), ("catalog.path", config.catalog.path)):
            if value and not os.path.isabs(value):
                raise ConfigError(
                    f"{key}: {value!r} is relative, and this driver runs in Ray's temporary copy of the working "
                    f"directory ({cwd}), deleted with the job; give an absolute path (launch/submit.sh passes "
                    "logging.root=$RUN_ROOT)"
                )
    require_local_fs(catalog_dir(config), "catalog.path: the catalog")


def tree_digest(directory: str) -> str:
    """sha256 over the sorted file names and bytes of a flat directory: a tiny build's identity."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _read_tree(directory: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def _install_tiny(name: str, digest: str, files: dict[str, bytes]) -> str:
    """On a node: the folder in this node's cache holding the shipped tiny build (written atomically if absent)."""
    from mint.models.tiny import default_cache_dir, is_complete

    parent = os.path.join(default_cache_dir(), "tiny")
    target = os.path.join(parent, name)
    if is_complete(target) and tree_digest(target) == digest:
        return target
    if os.path.exists(target):  # another build under this name (another torch, a partial one): keep it, go beside
        target = f"{target}.{digest[:12]}"
        if is_complete(target) and tree_digest(target) == digest:
            return target
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.ship-", dir=parent)
    try:
        for file, data in files.items():
            with open(os.path.join(tmp, file), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        try:
            os.rename(tmp, target)  # atomic; fails when another process put it there first
        except OSError:
            if not (is_complete(target) and tree_digest(target) == digest):
                raise
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_node(kind: str, spec: str, payload, probe: tuple[str, str] | None) -> tuple[str, str]:
    """Runs on one node (a Ray task pinned there): ("", node-local model path), or ("problem", "") naming the key
    and the fix. `kind`: "tiny" (`payload` is the shipped build: name, digest, files), "dir" or "hub"."""
    if kind == "tiny":
        name, digest, files = payload
        try:
            path = _install_tiny(name, digest, files)
        except OSError as e:
            return f"model.path: cannot write the shipped {spec} base into this node's cache: {e}", ""
    elif kind == "dir":
        path = spec
        if not os.path.isfile(os.path.join(spec, "config.json")):
            return (
                f"model.path: {spec} is not a model directory here (no config.json); copy it to this path on every "
                "node, or put it on shared storage",
                "",
            )
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(spec, "config.json")
        if not isinstance(found, str):
            return (
                f"model.path: {spec} is not in this node's Hugging Face cache (HF_HOME="
                f"{os.environ.get('HF_HOME', '~/.cache/huggingface')}); download it there or give a shared directory",
                "",
            )
        path = spec
    if probe is not None:
        file, token = probe
        try:
            seen = Path(file).read_text()
        except OSError:
            seen = ""
        if seen != token:
            return (
                f"logging.root: this node does not see the run directory {os.path.dirname(file)}, where its learner "
                "ranks write their checkpoint parts; put logging.root on storage every learner node mounts at the "
                "same path, or keep the learner on the driver's node",
                path,
            )
    return "", path


def connect(address: str) -> None:
    """Join the Ray cluster at `address`; one line when that fails (with the fix for token authentication)."""
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError) as e:
        chain, err = [], e
        while err is not None:
            chain.append(f"{type(err).__name__}: {err}")
            err = err.__cause__
        text = " ".join(" ".join(chain).split())
        hint = ""
        if "AuthToken" in text or "Authentication" in text:
            hint = (
                "; the cluster uses token authentication: set RAY_AUTH_MODE=token and make its token readable here "
                "(~/.ray/auth_token or RAY_AUTH_TOKEN)"
            )
        raise MintError(f"ray.address {address}: cannot join the Ray cluster ({chain[0][:200]}){hint}") from None


@dataclass
class NodeChecks:
    """The check of every node that will host an actor, prepared on the driver: `args[node]` is what `check_node`
    takes there. `paths` reads the answers; `close` removes the run-directory probe."""

    args: dict[str, tuple]  # node id -> check_node's arguments
    names: dict[str, str]  # node id -> its name for messages
    probe_file: Path | None = None

    def paths(self, answers: Iterable[tuple[str, tuple[str, str]]]) -> dict[str, str]:
        """Node id -> the model path its actors load, from (node id, check_node's answer) pairs; ConfigError with
        one line naming the first node with a problem (read as the answers come)."""
        paths = {}
        for node, (problem, path) in answers:
            if problem:
                raise ConfigError(f"node {self.names[node]}: {problem}")
            paths[node] = path
        return paths

    def close(self) -> None:
        if self.probe_file is not None:
            self.probe_file.unlink(missing_ok=True)


def node_checks(
    config: Config,
    model_path: str,
    nodes: dict[str, str],
    learner_nodes: set[str],
    run_dir: Path | None,
    local: str | None = None,
) -> NodeChecks:
    """Prepare the check of every node that will host an actor (and for a tiny base, its shipping). `nodes`: node id
    -> its name for messages. `model_path` is the driver's (driver_model_path); `learner_nodes` the nodes of learner
    ranks, whose view of `run_dir` is checked when they are not the driver's node (a probe file written here).
    `local`: the driver's node when its check runs in the driver (a local Ray): there the model is the directory
    `model_path`, a tiny base included (built here), and nothing is shipped."""
    spec = config.model.path
    if spec.startswith("tiny:"):
        kind, payload = "tiny", None
        if set(nodes) - {local}:  # stored once, fetched by each node: a top-level task argument, so Ray resolves it
            name = os.path.basename(model_path.rstrip("/"))
            payload = ray.put((name, tree_digest(model_path), _read_tree(model_path)))
    else:
        kind, spec, payload = ("dir" if os.path.isabs(model_path) else "hub"), model_path, None
    here = local or get_runtime_context().get_node_id()
    checks = NodeChecks({}, dict(nodes))
    probe = None
    if run_dir is not None and learner_nodes - {here}:
        checks.probe_file = Path(run_dir) / f"{PROBE_PREFIX}{secrets.token_hex(4)}"
        probe = (str(checks.probe_file), secrets.token_hex(16))
        checks.probe_file.write_text(probe[1])
    checks.args = {
        node: (kind, spec, payload, probe if node in learner_nodes and node != here else None) for node in nodes
    }
    if local in checks.args:
        checks.args[local] = ("dir", model_path, None, None)
    return checks


# ---- the launch scripts' wait ---------------------------------------------------------------------------------------


def wait_for_nodes(address: str, nodes: int, gpus: float = 0, timeout: float = 300.0, poll: float = 1.0) -> str:
    """Poll the Ray cluster at `address` (host:port of the head's GCS) until `nodes` alive nodes with `gpus` GPUs in
    all have joined; returns a line saying so. Raises MintError (one line: what joined, what is missing) after
    `timeout` seconds, counted from the call, whether the head never answered or a node never joined."""
    deadline = time.monotonic() + timeout
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"wait: --address {address!r} is not HOST:PORT (the head's GCS, e.g. 10.0.0.1:6379)")
    while not _reachable(host, int(port)):
        if time.monotonic() > deadline:
            raise MintError(f"wait: no Ray head answered at {address} within {timeout:g} s; is `ray start --head` up?")
        time.sleep(poll)
    connect(address)
    try:
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            have_gpus = sum(float(n["Resources"].get("GPU", 0)) for n in alive)
            if len(alive) >= nodes and have_gpus + 1e-9 >= gpus:
                return f"mint: wait: {len(alive)} node(s) with {have_gpus:g} GPU(s) joined {address}"
            if time.monotonic() > deadline:
                joined = ", ".join(f"{node_name(n)} ({float(n['Resources'].get('GPU', 0)):g} GPU)" for n in alive)
                missing = [f"{nodes - len(alive)} node(s)"] if len(alive) < nodes else []
                missing += [f"{gpus - have_gpus:g} GPU(s)"] if have_gpus < gpus else []
                raise MintError(
                    f"wait: after {timeout:g} s, {len(alive)} of {nodes} node(s) and {have_gpus:g} of {gpus:g} GPU(s) "
                    f"joined {address} (missing {' and '.join(missing)}; joined: {joined}); check the missing nodes' "
                    "`ray start` output"
                )
            time.sleep(poll)
    finally:
        ray.shutdown()


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mint.train.nodes", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait", help="wait until the cluster has N nodes and G GPUs, or fail after --timeout")
    wait.add_argument("--address", required=True, help="HOST:PORT of the head's GCS (ray start --head --port)")
    wait.add_argument("--nodes", type=int, required=True, help="nodes expected, the head included")
    wait.add_argument("--gpus", type=float, default=0, help="GPUs expected over all nodes")
    wait.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    args = parser.parse_args(argv)
    try:
        print(wait_for_nodes(args.address, args.nodes, args.gpus, args.timeout), flush=True)
    except MintError as e:
        print(f"mint: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


def cluster_nodes() -> list[Node]:
    """The alive nodes of the Ray cluster this process is connected to, in fill order."""
    here = get_runtime_context().get_node_id()
    nodes = [
        Node(
            n["NodeID"],
            node_name(n),
            float(n["Resources"].get("CPU", 0)),
            float(n["Resources"].get("GPU", 0)),
            n["NodeID"] == here,
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return order_nodes(nodes)


def dry_run(config: Config, prompt_len: int, gpu_memory: str = "96GB") -> str:
    """`mint train RECIPE --dry-run`: the layout on the cluster at `ray.address` (read, nothing started), or on the
    local node a run would start, and the memory plan where one exists. No actor, no placement group."""
    if config.ray.address:
        connect(config.ray.address)
        try:
            nodes = cluster_nodes()
        finally:
            ray.shutdown()
    else:
        nodes = [local_node(config)]
    layout = plan_layout(config, nodes)
    return f"{layout.table()}\n{memory_plan(config, prompt_len, gpu_memory)}"


if __name__ == "__main__":
    sys.exit(main())
