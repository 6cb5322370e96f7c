"""A step's samples through Ray: tensors as numpy buffers (mint.train.wire) against torch's own pickling, side by side.

The payload is what a rollout actor hands the driver in one step: GroupRollouts of G completions, each with its
tokens, logprobs and routes [R, L, k]. The same payload goes through a real local Ray (`ray.put` in the driver, a
`ray.get` in another worker process and back), once with mint.train.wire's serializer registered in both processes
(as the driver and every actor register it) and once without (torch's pickling: the path before it). Two sizes:

    smoke   the smoke recipe's step: 8 prompts x G=8, R=2, 2 layers, top-2 (what bench/overlap.py runs)
    large   64 prompts x G=8, R=1024, 48 layers, top-8 (uint8 routes: about 200 MB, a Qwen3-30B-A3B-like step)

    python bench/wire.py              # median of 5 round trips per size and path

The last stdout line is one JSON object: seconds per round trip of each path and `torch_over_numpy_seconds` per size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SIZES = {"smoke": (8, 8, 2, 2, 2, 20), "large": (64, 8, 1024, 48, 8, 256)}  # prompts, G, R, L, k, P


def make_step(prompts: int, group: int, length: int, layers: int, top_k: int, prompt_len: int):
    from mint.rollout.engine import Completion, GroupRollout

    gen = torch.Generator().manual_seed(0)
    return [
        GroupRollout(
            torch.randint(0, 1000, (prompt_len,), generator=gen),
            torch.randint(0, 128, (prompt_len - 1, layers, top_k), generator=gen, dtype=torch.uint8),
            [
                Completion(
                    torch.randint(0, 1000, (length,), generator=gen),
                    torch.randn(length, generator=gen),
                    torch.randint(0, 128, (length, layers, top_k), generator=gen, dtype=torch.uint8),
                    "stop",
                )
                for _ in range(group)
            ],
        )
        for _ in range(prompts)
    ]


def use_wire(on: bool) -> None:
    """Register mint.train.wire's serializer for torch.Tensor in this process, or drop it (torch's own pickling)."""
    import ray

    from mint.train import wire

    if on:
        wire.register()
    else:
        ray.util.deregister_serializer(torch.Tensor)


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, refs):  # a worker process fetches the payload and sends it back
            return ray.get(refs[0])

        def use_wire(self, on: bool) -> None:
            use_wire(on)

    echo = Echo.remote()
    ray.get(echo.echo.remote([ray.put(1)]))  # the worker is up before timing starts
    result: dict = {"repeats": args.repeats}
    for name, dims in SIZES.items():
        step = make_step(*dims)
        times: dict[str, list[float]] = {"numpy": [], "torch": []}
        for _ in range(args.repeats):
            for path in times:  # interleaved: a change in load hits both
                use_wire(path == "numpy")
                ray.get(echo.use_wire.remote(path == "numpy"))
                t0 = time.perf_counter()
                back = ray.get(echo.echo.remote([ray.put(step)]))
                times[path].append(time.perf_counter() - t0)
                del back
        for path, ts in times.items():
            result[f"{name}_{path}_seconds"] = round(statistics.median(ts), 5)
        result[f"{name}_torch_over_numpy_seconds"] = round(
            result[f"{name}_torch_seconds"] / result[f"{name}_numpy_seconds"], 2
        )
        result[f"{name}_tensors"] = sum(3 * len(g.completions) + 2 for g in step)
    ray.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
