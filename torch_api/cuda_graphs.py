"""CUDA-graph replay of the solvers' fixed launch sequences.

A solve launches 2-3 kernels per half-step and reads its marginal error on the host
once per block of iterations. At n = m = 8192 a half-step runs for 40-120 us on the
H100 while its launches cost 30-45 us of host time, so the eager loop is host-bound
(docs/performance.md). Between two host reads the launches are fixed by the shapes and the
loop options: a :class:`GraphSet` captures each such *segment* once per problem shape,
over static buffers, and replays it with one launch.

Rules that keep a replay equal to the eager launches (bitwise; tests/test_torch_graphs_gpu.py):

* the same kernels with the same arguments run in the same order; inputs are copied into
  the set's static buffers (one multi-tensor copy) before the first replay of a solve;
* every tensor a segment hands to the next segment or to the caller is either a static
  buffer (allocated outside any graph) or a graph output kept alive by the set, so graphs
  sharing the set's memory pool never overwrite each other's live results;
* a shape is graphed from its second solve on: the first runs eagerly, which compiles
  and loads every kernel the capture will record.

Graphs are used on CUDA when no stream capture is already under way (a user capturing
the whole step gets the eager launches), for n m <= 2^28 (beyond that a half-step is
long enough that launches are hidden, and the static copies would cost memory), and
unless ``OT_TRITON_CUDA_GRAPHS=0`` is set in the environment. Four shapes are kept;
the least recently used set is dropped with its graphs. Sets are per thread (solves running
concurrently in two threads never share static buffers).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from ot_triton_jax.core import runtime

MAX_PAIRS = 2 ** 28  # n m above which the eager launches are used
_KEPT_SETS = 4
_sets: OrderedDict = OrderedDict()
_seen: OrderedDict = OrderedDict()


class GraphSet:
    """Static buffers, one memory pool and one captured graph per segment kind, for one
    problem shape on one device."""

    def __init__(self, device: torch.device, statics: dict[str, torch.Tensor]):
        self.device = device
        self.statics = {k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in statics.items()}
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict = {}
        self._held: dict = {}  # immutable tensors whose values the static buffers hold (load)

    def load(self, values: dict[str, torch.Tensor], immutable: tuple[str, ...] = ()) -> None:
        """Copy ``values`` into the static buffers of the same names (one fused launch). A
        name in ``immutable`` holding the very tensor it was last loaded from is skipped:
        only for tensors nobody writes (the library's cached weights' logs and kernel
        parameters), never for the caller's tensors, which may change in place."""
        names = [k for k in values if not (k in immutable and self._held.get(k) is values[k])]
        for k in immutable:
            self._held[k] = values.get(k)
        if names:
            torch._foreach_copy_([self.statics[k] for k in names], [values[k] for k in names])

    def run(self, kind, body: Callable[[dict], tuple], read: bool = False) -> tuple:
        """Run ``body(statics)`` (its launches) through the graph kept for ``kind``,
        capturing it on first use; returns the tuple ``body`` returned at capture (graph
        outputs, rewritten by each replay of this kind). ``body`` must not read the host
        and must return no tensor that aliases a static buffer it later writes. With
        ``read``, the last output (a 0-d tensor) is replaced by a :class:`HostScalar` that
        the graph fills as its last step."""
        hit = self._graphs.get(kind)
        if hit is None:
            host = HostScalar() if read else None
            graph = torch.cuda.CUDAGraph()
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(current)
            with torch.cuda.device(self.device), torch.cuda.stream(side):  # the tensors' device, not the current one
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    outs = body(self.statics)
                    if host is not None:
                        host.value.copy_(outs[-1], non_blocking=True)
                        outs = outs[:-1] + (host,)
                finally:
                    graph.capture_end()
            current.wait_stream(side)
            hit = self._graphs[kind] = (graph, outs, host)
        with torch.cuda.device(self.device):
            hit[0].replay()
        if hit[2] is not None:
            hit[2].event.record(torch.cuda.current_stream(self.device))
        return hit[1]


class HostScalar:
    """A graph's 0-d result, copied into page-locked host memory by the graph itself:
    ``float()`` waits for the replay (an event recorded after it) and reads that memory,
    with no device-to-host copy launched after the GPU is done (the loops' host reads)."""

    def __init__(self):
        self.value = torch.empty((), dtype=torch.float64, pin_memory=True)
        self.event = torch.cuda.Event()

    def __float__(self) -> float:
        self.event.synchronize()
        return float(self.value)


def graph_set(key: tuple, device: torch.device, pairs: int, statics: dict[str, torch.Tensor]) -> GraphSet | None:
    """The :class:`GraphSet` for ``key`` (a problem shape), or None where the eager launches
    are to be used: off the GPU, during a stream capture, above :data:`MAX_PAIRS`, when
    ``OT_TRITON_CUDA_GRAPHS=0``, and on a shape's first solve. ``statics``: example tensors
    (shape, dtype) of the static buffers, used when the set is made."""
    if (device.type != "cuda" or not runtime.on_gpu() or pairs > MAX_PAIRS
            or os.environ.get("OT_TRITON_CUDA_GRAPHS", "1") == "0" or torch.cuda.is_current_stream_capturing()):
        return None
    key = key + (device, threading.get_ident())  # one set per thread: static buffers are not shared
    hit = _sets.get(key)
    if hit is not None:
        _sets.move_to_end(key)
        return hit
    if key not in _seen:
        _seen[key] = True
        if len(_seen) > 64:
            _seen.popitem(last=False)
        return None
    hit = _sets[key] = GraphSet(device, statics)
    if len(_sets) > _KEPT_SETS:
        _sets.popitem(last=False)
    return hit


def _usable(device: torch.device) -> bool:
    return (device.type == "cuda" and runtime.on_gpu() and os.environ.get("OT_TRITON_CUDA_GRAPHS", "1") != "0"
            and not torch.cuda.is_current_stream_capturing())


def while_blocks(cond: Callable, body: Callable, state, block: int):
    """``while cond(state): state = body(...body(state))`` (``block`` bodies between two host
    reads of ``cond``), with the blocks replayed from one CUDA graph on the GPU: the first block
    runs eagerly (it compiles and loads the kernels), the second is captured over static copies
    of the state (the graph writes its result back into them) and replayed for it and every later
    block of this loop. ``body`` must launch the same work from any state and read nothing on the
    host. The graph lives for this loop only: its capture costs about one eager block, every
    replay saves one (a CG iteration is tens of small launches). Eager elsewhere (as
    :func:`graph_set`: off the GPU, in a capture, with ``OT_TRITON_CUDA_GRAPHS=0``)."""
    flat, spec = pytree.tree_flatten(state)
    device = flat[0].device
    graph, blocks = None, 0
    while bool(cond(state)):
        if blocks == 0 or not _usable(device):
            for _ in range(block):
                state = body(state)
        else:
            if graph is None:
                statics = [t.clone() for t in pytree.tree_flatten(state)[0]]
                graph = torch.cuda.CUDAGraph()
                current = torch.cuda.current_stream(device)
                side = torch.cuda.Stream(device)
                side.wait_stream(current)
                with torch.cuda.device(device), torch.cuda.stream(side):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        st = pytree.tree_unflatten(statics, spec)
                        for _ in range(block):
                            st = body(st)
                        for dst, src in zip(statics, pytree.tree_flatten(st)[0]):
                            dst.copy_(src)
                    finally:
                        graph.capture_end()
                current.wait_stream(side)
                state = pytree.tree_unflatten(statics, spec)
            with torch.cuda.device(device):
                graph.replay()
        blocks += 1
    return state


def clear() -> None:
    """Drop every kept graph and static buffer (and forget which shapes were seen)."""
    _sets.clear()
    _seen.clear()
