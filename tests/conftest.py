"""Shared fixtures: tiny MoE models built locally (nothing is downloaded), saved and loaded through from_pretrained."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
from scheduling import pytest_collection_modifyitems, pytest_xdist_make_scheduler  # noqa: F401 (pytest's hooks)
from transformers import AutoModelForCausalLM

from mint.models.specs import tiny_config

# Tests run on 2 cores next to Ray workers: one torch thread each keeps them from fighting over the cores.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")


def build_random_tiny(family: str, directory: str, vocab_size: int = 97, seed: int = 0, init_std: float = 0.05) -> str:
    """Save a randomly initialised tiny MoE to `directory` and return it.

    init_std 0.05 instead of transformers' 0.02: with 0.02 the random experts are so weak that routing barely moves
    the logits, which would let route bugs pass unnoticed.
    """
    torch.manual_seed(seed)
    config = tiny_config(family, vocab_size, initializer_range=init_std)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session", params=["qwen3_moe", "qwen2_moe"])
def random_tiny_path(request, tmp_path_factory) -> str:
    """Path of a random-init tiny MoE of each family (parametrized), saved with save_pretrained."""
    family = request.param
    return build_random_tiny(family, str(tmp_path_factory.mktemp(family)))


@pytest.fixture(scope="session")
def random_qwen3_path(tmp_path_factory) -> str:
    return build_random_tiny("qwen3_moe", str(tmp_path_factory.mktemp("qwen3_moe_only")))


@pytest.fixture(scope="session")
def random_glm_path(tmp_path_factory) -> str:
    """A random-init tiny GLM-4.5-style MoE (tiny_config("glm4_moe")) whose routers' e_score_correction_bias is
    non-zero, so the bias moves which experts are picked (and must stay out of their weights), as in a trained GLM."""
    path = build_random_tiny("glm4_moe", str(tmp_path_factory.mktemp("glm4_moe_biased")))
    model = load_fp32(path)
    gen = torch.Generator().manual_seed(11)
    for layer in model.model.layers[model.config.first_k_dense_replace :]:
        bias = layer.mlp.gate.e_score_correction_bias
        bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
    model.save_pretrained(path)
    return path


def load_fp32(path: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def lora_model(path: str, target_modules: list[str] | None = None) -> torch.nn.Module:
    """The fp32 base at `path`, frozen, with the default LoRA (or LoRA on `target_modules` and the experts) and
    lora_B ~ N(0, 0.05^2) (seeded): PEFT starts B at zero, which would make LoRA a no-op on the forward, so every K/V
    and expert output would ignore it."""
    from mint.config import LoraConfig
    from mint.models.lora import add_lora

    base = load_fp32(path)
    for p in base.parameters():
        p.requires_grad_(False)
    lora = LoraConfig() if target_modules is None else LoraConfig(target_modules=target_modules)
    model = add_lora(base, lora, seed=0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while fn() runs."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes)


def assert_three_way(kernel, ref_same, ref_fp32, atol, rtol):
    """Kernel vs reference in the same dtype, and vs the fp32 reference, for every returned tensor."""
    assert kernel.keys() == ref_same.keys() == ref_fp32.keys()
    for name in kernel:
        k, s, f = kernel[name].float(), ref_same[name].float(), ref_fp32[name].float()
        torch.testing.assert_close(k, s, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n} vs same-dtype ref: {m}")
        torch.testing.assert_close(k, f, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n} vs fp32 ref: {m}")


def run_interp_tests_in_subprocess(test_file: str, min_passed: int) -> None:
    """Re-run a kernel test file's `interp_` tests in a fresh interpreter with TRITON_INTERPRET=1.

    The variable must be set before triton is first imported (even tl.sum is jitted at import), which an already
    running pytest process cannot undo; so the Triton-under-interpreter tests run in a subprocess, and fail here if any
    fails or fewer than `min_passed` ran.
    """
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(Path(test_file).resolve()),
        "-q",
        "-k",
        "interp_",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed, report
    assert "skipped" not in proc.stdout.splitlines()[-1], report


def compile_for_hopper(kernel, cfg: dict, pointers: dict, floats=(), **constexprs) -> None:
    """Compile `kernel` through Triton's whole pipeline to an sm_90 cubin; this needs no GPU.

    cfg: a launcher's tile config (BLOCK_* are constexprs, num_warps/num_stages compile options). pointers: argument
    name -> Triton pointer type; `floats` are fp32 scalars, other arguments i32. The interpreter runs kernels as
    numpy and lets through what only the compiler rejects, such as a kernel reading a global that is not a
    tl.constexpr (which these kernels once did).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {k: v for k, v in cfg.items() if k.startswith("BLOCK_")} | constexprs
    options = {k: v for k, v in cfg.items() if not k.startswith("BLOCK_")}
    signature = {
        n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in floats else "i32") for n in kernel.arg_names
    }
    try:
        source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
    except TypeError as err:  # the compiler's internal API changes between Triton releases
        pytest.skip(f"this Triton's ASTSource takes other arguments: {err}")
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def run_rank_processes(ctx, run_dir, world: int, main, args: tuple, timeout: float) -> list:
    """Start main(run_dir, rank, *args) for every rank in `ctx`'s processes, wait up to `timeout` s, kill stragglers,
    and return each rank's result (what `finish_rank` saved) in rank order. Any rank's traceback fails the test: the
    rank that failed first, then its peers, which only report the closed connection."""
    procs = [ctx.Process(target=main, args=(str(run_dir), r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = sorted(
        (e.read_text() for e in Path(run_dir).glob("error_*.txt")),
        key=lambda text: "by peer" in text or "Connection" in text,
    )
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * world, [p.exitcode for p in procs]
    return [torch.load(Path(run_dir) / f"result_{r}.pt", weights_only=False) for r in range(world)]


def finish_rank(run_dir: str, rank: int, body) -> None:
    """In a rank's process: save body()'s result, or its traceback, and leave without pytest's (and DeepSpeed's)
    atexit handlers, which a forked child must not run."""
    code = 0
    try:
        torch.set_num_threads(1)
        torch.save(body(), f"{run_dir}/result_{rank}.pt")
    except BaseException:
        with open(f"{run_dir}/error_{rank}.txt", "w") as f:
            f.write(f"rank {rank}:\n{traceback.format_exc()}")
        code = 1
    os._exit(code)


# ---- the real serving engines (`make engines`: vLLM's CPU build, and SGLang's wheel without its dependencies) ----

ENGINE_ENV = Path(
    os.environ.get("MINT_ENGINE_ENV", Path(__file__).resolve().parents[1] / ".engines" / "vllm")
).absolute()


@pytest.fixture(scope="session")
def engine_python() -> Path:
    """The Python of the engine virtualenv (`make engines`), which runs vLLM and SGLang's own code. `make test`
    installs it first; under CI its absence is a failure, elsewhere the engine tests skip with the command to run."""
    python = ENGINE_ENV / "bin" / "python"
    if not python.exists():
        message = f"no engine environment at {ENGINE_ENV}: `make engines` installs vLLM's CPU build there"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


# ---- the processes of one test's own run: the machine may be running other jobs' Ray actors at the same time ----

RUN_MARK_VAR = "MINT_TEST_RUN_MARK"


ENGINE_SCRIPTS = Path(__file__).resolve().parent / "engine_scripts"


def run_engine_script(engine_python: Path, script: str, payload, workdir: Path, timeout: float = 300.0) -> dict:
    """Run tests/engine_scripts/`script` in the engine virtualenv, `payload` as JSON on stdin; its JSON report (the
    last line of its stdout). Offline, one thread, no usage reports."""
    import json
    import subprocess

    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "OMP_NUM_THREADS": "1",
    }
    # Mint's tree must stay off the engine's path: its top-level `kernels` package would shadow the `kernels`
    # package transformers probes for, and the engine's import fails inside transformers.
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [str(engine_python), str(ENGINE_SCRIPTS / script)],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0 and proc.stdout.strip(), f"{script} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def new_run_mark() -> str:
    """A fresh value for RUN_MARK_VAR. Put run_mark_env(mark) in the environment of the process that starts Ray, before
    it does: the raylet inherits it, every worker the raylet starts (restarted actors too) and whatever they start."""
    import uuid

    return f"mint-test-{uuid.uuid4().hex}"


def run_mark_env(mark: str) -> dict[str, str]:
    """The variables that mark a run's processes so that processes_of_run can find them.

    SPT_NOENV=1 keeps the mark readable. A Ray worker sets its title ("ray::LearnerActor") with the setproctitle code
    Ray bundles, which by default takes the memory of the process's original environment as room for the title and
    zeroes the start of it, and /proc/PID/environ reads that memory. Whether a worker's mark survived then depended on
    where the variable fell in the environment the raylet builds for it (a hash map's order), which differs between
    machines: a drill found both of its learner ranks on one machine and neither on another. With SPT_NOENV the title
    stays within the argument list (a worker's is hundreds of bytes long) and the environment is left alone."""
    return {RUN_MARK_VAR: mark, "SPT_NOENV": "1"}


def processes_of_run(mark: str, title: str) -> list[int]:
    """Ids of the processes whose command line contains `title` (a Ray worker's is its title, "ray::RolloutActor")
    and whose environment holds RUN_MARK_VAR=`mark` (the run was started with run_mark_env(mark)).

    An inherited environment rather than the process tree: it holds wherever Ray puts a process (a worker is the
    raylet's child, the raylet the driver's, a process whose parent died is adopted by init and keeps it), it needs no
    consistent walk of parent links while processes come and go, and it works alike for a `mint train` subprocess and
    for train() inside pytest. Another job's processes lack the mark; another user's cannot be read and are skipped.
    It needs a Ray started by the marked process: workers of a cluster joined through RAY_ADDRESS do not inherit it.
    """
    wanted = f"{RUN_MARK_VAR}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone since the listing, or another user's
            continue
        if title.encode() in cmdline and wanted in environ:
            pids.append(int(entry.name))
    return pids


def wait_for_processes(mark: str, title: str, count: int, timeout: float = 60) -> list[int]:
    """processes_of_run(mark, title) once it finds `count` of them. A worker's /proc entry can be briefly unreadable
    or untitled (Ray sets the title when the actor's task starts), so one look may miss a process that is there."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        pids = processes_of_run(mark, title)
        if len(pids) >= count or time.monotonic() > deadline:
            return pids
        time.sleep(0.5)


# ---- tolerances from the dtype and the size of the sum, and learning thresholds from the headroom ----


def sum_atol(dtype: torch.dtype, magnitude: float, terms: int) -> float:
    """Absolute tolerance between two evaluations of the same sums in `dtype` that add in another order (AVX2's 8
    fp32 lanes against AVX-512's 16, another GEMM blocking, a chunked capture against a whole one):
    eps(dtype) * magnitude * sqrt(terms).

    Each addition rounds by at most half an ulp of its running value, which `magnitude` bounds (the largest value
    compared, the scale of the terms behind it), and the two evaluations' independent rounding errors add like a
    random walk, so they part by about eps * magnitude * sqrt(terms). `terms`: the longest chain of roundings behind
    a compared value, e.g. the layers below it times the widest reduction of a layer. Measured on the tiny GLM's K/V
    (3 layers, widest reduction 128: sqrt(384) = 19.6): the largest difference was 5.1 eps * magnitude, under the
    default, AVX2 and AVX-512 kernels alike, so the bound holds with about 4x to spare and stays orders below a
    real bug (a rotary on the wrong dims moves K by O(1)).
    """
    import math

    return torch.finfo(dtype).eps * magnitude * math.sqrt(terms)


def headroom_closed(first: float, last: float) -> float:
    """The fraction of the headroom 1 - first that training closed, (last - first) / (1 - first), for a reward in
    [0, 1]. An absolute gain is harder to reach from a higher start (0.5 from 0.49 needs 0.99); this is not."""
    return (last - first) / max(1.0 - first, 1e-9)


def kill_when_logged(metrics: Path, find_pids, steps: int, killed: list[int], wait_s: float = 900.0):
    """A daemon thread that SIGKILLs the processes `find_pids()` names once `metrics` (a run's metrics.jsonl) holds
    `steps` lines, and appends to `killed` how many it held then (nothing when it found no process to kill)."""
    import signal
    import threading
    import time

    def kill():
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                pids = find_pids()
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                if pids:
                    killed.append(len(metrics.read_text().splitlines()))
                return
            time.sleep(0.1)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


# One GRPO update's worth of inputs for the LongStraw-against-HF tests: G=3 responses of unequal lengths after a
# P=23 prompt, and a GRPO-shaped objective (policy gradient plus a squared log-ratio to the reference).
UPDATE_P, UPDATE_LENGTHS, UPDATE_ADV = 23, (2, 5, 9), (1.0, -0.5, 0.7)


def update_inputs(vocab: int, prompt_len: int = UPDATE_P, lengths=UPDATE_LENGTHS):
    gen = torch.Generator().manual_seed(1)
    tokens_P = torch.randint(0, vocab, (prompt_len,), generator=gen)
    return tokens_P, [torch.randint(0, vocab, (r,), generator=gen) for r in lengths]


def update_objective(i, logp_R, ref_logp_R):
    loss = -(UPDATE_ADV[i] * logp_R).mean()
    if ref_logp_R is not None:
        loss = loss + 0.3 * (logp_R - ref_logp_R).pow(2).mean()
    return loss, {}


def pop_lora_grads(model) -> dict[str, torch.Tensor]:
    """The LoRA gradients, cloned; every .grad is cleared."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return grads


def forced_routes(model, tokens_P: torch.Tensor, responses: list[torch.Tensor]):
    """R3 routes a replay must force: the routes an HF forward over each prompt + response[:-1] records, with every
    other row's experts rotated by one (rows where that would pick one expert twice keep theirs). Returns
    (SequenceRoutes for the update, per response the forced routes of its whole sequence [P + R - 1, L, k])."""
    from longstraw.routing import RouteRecorder, SequenceRoutes

    recorded = []
    with RouteRecorder(model) as recorder, torch.no_grad():
        for r in responses:
            model(input_ids=torch.cat([tokens_P, r[:-1]])[None])
            recorded.append(recorder.pop())
    experts = getattr(model.config, "num_experts", None) or model.config.n_routed_experts
    forced = [(r + torch.arange(r.shape[0])[:, None, None] % 2) % experts for r in recorded]
    forced = [torch.where(f[..., :1] == f[..., 1:], r, f) for f, r in zip(forced, recorded, strict=True)]
    p1 = tokens_P.shape[0] - 1
    rows = [(f[p1:], torch.ones(len(r), dtype=torch.bool)) for f, r in zip(forced, responses, strict=True)]
    return SequenceRoutes(forced[0][:p1], torch.ones(p1, dtype=torch.bool), rows), forced
