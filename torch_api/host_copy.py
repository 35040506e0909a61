"""Small host-to-GPU copies (run-time numbers, loop records) that neither synchronize nor allocate.

A plain copy from pageable host memory waits for the stream (a synchronization), and
``tensor.pin_memory()`` allocates page-locked memory on every call (cudaHostAlloc, which
costs about 1 ms per solve at n = 8192 on the H100). Here a few pinned
staging buffers are allocated once per device and reused: a buffer is taken only when
the copy that last read it has completed (its CUDA event), so a copy never overwrites
data still in flight and never waits for the GPU.
"""

from __future__ import annotations

import torch

_RING: dict = {}  # device -> list of [pinned uint8 buffer, cuda event or None]
_MAX_SLOTS = 32


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor goes to a CUDA device through a reused pinned buffer
    and a non-blocking copy (no host synchronization, no allocation after warm-up)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type != "cpu" or device.type != "cuda" or torch.compiler.is_compiling():
        return t.to(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    src = t.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = src.numel()
    ring = _RING.setdefault(device, [])
    slot = next((s for s in ring if s[0].numel() >= nbytes and (s[1] is None or s[1].query())), None)
    if slot is None:
        if len(ring) >= _MAX_SLOTS:  # every buffer still in flight: fall back to a fresh pinned copy
            return t.pin_memory().to(device, non_blocking=True)
        slot = [torch.empty(max(nbytes, 1024), dtype=torch.uint8, pin_memory=True), None]
        ring.append(slot)
    buf = slot[0][:nbytes]
    buf.copy_(src)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.reshape(-1).view(torch.uint8).copy_(buf, non_blocking=True)
    if slot[1] is None:
        slot[1] = torch.cuda.Event()
    slot[1].record(torch.cuda.current_stream(device))
    return out
