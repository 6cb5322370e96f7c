"""How tensors cross Ray: a serializer for torch.Tensor that sends a tensor's bytes as one numpy buffer.

Ray pickles a torch tensor through torch's own storage reduction, which runs a `torch.save` into an in-memory zip
file per storage: tens of microseconds per tensor each way, whatever its size. A step's rollout holds a few small
tensors per response (tokens, logprobs, routes), so on the smoke recipe that overhead, not the bytes, was most of the
time the driver spent collecting a step's samples (about 14 ms of it; bench/wire.py and docs/benchmarks.md). A numpy
array pickles as a header and one buffer, out of band under protocol 5 as Ray uses it.

`register()` makes every torch.Tensor this process hands Ray travel as (its bytes viewed as a uint8 numpy array,
dtype, shape, device, requires_grad). It runs in every process that sends tensors: the driver (mint.train.driver)
and each actor at start-up (LearnerActor, RolloutActor). The receiver needs nothing: the pickle names
`from_wire`, which it imports. So the domain types (GroupRollout, Completion, GroupBatch) are plain dataclasses that
know nothing of transport.

Zero-copy where it can be: a contiguous CPU tensor's bytes are viewed, not copied, on the way out (every dtype,
bfloat16 included, since the view is uint8); on the way in the tensor wraps the buffer Ray hands back, copied once
only when Ray hands a read-only view of its object store (a tensor must own writable memory: the store's copy is
shared with every other reader). A non-contiguous tensor is made contiguous first (one copy); a tensor on another
device goes through the CPU and comes back on the device it left.
"""

from __future__ import annotations

import torch


def to_wire(tensor: torch.Tensor) -> tuple:
    """(bytes as a uint8 numpy array, dtype name, shape, device, requires_grad): what crosses Ray for `tensor`."""
    if tensor.layout != torch.strided:
        raise TypeError(f"mint.train.wire: only strided tensors cross Ray (got {tensor.layout})")
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return (
        flat.view(torch.uint8).numpy(),
        str(tensor.dtype).removeprefix("torch."),
        tuple(tensor.shape),
        str(tensor.device),
        tensor.requires_grad,
    )


def from_wire(wire: tuple) -> torch.Tensor:
    """The tensor `to_wire` sent: same dtype, shape, device, values and requires_grad, owning writable memory."""
    array, dtype, shape, device, requires_grad = wire
    if not array.size:  # no bytes to view (numpy gives an empty array stride 0, which torch cannot view)
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
    else:
        if not array.flags.writeable:  # a read-only view of Ray's object store
            array = array.copy()
        tensor = torch.from_numpy(array).view(getattr(torch, dtype)).reshape(shape)
    if device != "cpu":
        tensor = tensor.to(device)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def register() -> None:
    """Send every torch.Tensor this process hands Ray through `to_wire` (idempotent; needs no running Ray)."""
    import ray  # here, not at the top: preflight imports the actors' modules and must not import Ray

    ray.util.register_serializer(torch.Tensor, serializer=to_wire, deserializer=from_wire)
