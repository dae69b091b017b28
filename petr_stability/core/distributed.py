"""Cross-rank agreement on host-side values, so every rank takes the same decision and none waits alone."""
import copy
import socket
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from .tree import map_tensors

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
    "reduce_max",
    "PendingMax",
    "reduce_max_async",
    "PendingGather",
    "gather_tensor_async",
    "broadcast_object",
    "gather",
    "strip_tensors",
    "fill_tensors",
    "broadcast_payload",
    "node_group",
]

_GROUP: Any = None
_NODE: Optional[Tuple[Any, int, List[int]]] = None


def is_distributed() -> bool:
    """True when a process group is up, one rank included.

    A one-GPU job started by a distributed launcher (``torchrun --nproc_per_node 1``, ``dist_train.sh CONFIG 1``)
    takes the same path as eight GPUs: one code path, and the agreement is exercised wherever a group exists. On one
    rank it costs one local gloo all-reduce of one integer per step.
    """
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's global rank (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of ranks (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _host_group() -> Any:
    # A gloo group reduces CPU tensors: agreeing on a few host ints adds no host-device sync, whatever the
    # training backend (NCCL would need the values on the GPU and a sync to read them back).
    global _GROUP
    if _GROUP is None:
        _GROUP = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return _GROUP


def reduce_max(values: List[int]) -> List[int]:
    """Element-wise maximum of ``values`` over all ranks (identity when not distributed).

    Every rank must call it at the same point, the same number of times: the guard calls it once per
    optimizer step, from the same hook, on every rank.
    """
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_host_group())
    return [int(v) for v in t.tolist()]


class PendingMax:
    """An element-wise MAX over all ranks in flight on the host group: issued by :func:`reduce_max_async`, read by
    :meth:`wait` (at once without a process group)."""

    __slots__ = ("_values", "_work")

    def __init__(self, values: torch.Tensor, work: Any) -> None:
        self._values, self._work = values, work

    def wait(self) -> List[int]:
        """Waits until every rank's values have arrived (a no-op once they have) and returns the maximum.

        Raises:
            RuntimeError: the collective failed (a rank died: gloo reports its closed connection), or timed out after
                the process group's timeout.
        """
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
        return [int(v) for v in self._values.tolist()]


def reduce_max_async(values: List[int], buffer: Optional[torch.Tensor] = None) -> PendingMax:
    """Starts :func:`reduce_max` without waiting for it: the all-reduce runs on gloo's own threads while this rank goes
    on, and :meth:`PendingMax.wait` reads it later.

    Every rank must issue the same collectives on the host group in the same order (an issued one counts where it is
    issued, not where it is waited for); between issuing and waiting a rank may run other collectives. Not
    distributed: the values themselves, nothing in flight.

    Args:
        values: this rank's integers.
        buffer: an int64 CPU tensor of ``len(values)`` elements to reduce in (filled here; nothing else may touch it
            until :meth:`PendingMax.wait` returned). Defaults to a new one.
    """
    if buffer is None:
        t = torch.tensor(values, dtype=torch.int64)
    elif buffer.dtype != torch.int64 or buffer.numel() != len(values) or buffer.device.type != "cpu":
        raise ValueError(f"buffer must be an int64 CPU tensor of {len(values)} elements, got {buffer.dtype} "
                         f"{tuple(buffer.shape)} on {buffer.device}")
    elif len(values) == 1:
        t = buffer.fill_(values[0])
    else:
        t = buffer.copy_(torch.tensor(values, dtype=torch.int64))
    if not is_distributed():
        return PendingMax(t, None)
    return PendingMax(t, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_host_group(), async_op=True))


class PendingGather:
    """Every rank's tensor in flight on the host group: issued by :func:`gather_tensor_async`, read by :meth:`wait` (at
    once without a process group)."""

    __slots__ = ("_tensors", "_work")

    def __init__(self, tensors: List[torch.Tensor], work: Any) -> None:
        self._tensors, self._work = tensors, work

    def wait(self) -> List[torch.Tensor]:
        """Waits until every rank's tensor has arrived (a no-op once they have) and returns them in rank order.

        Raises:
            RuntimeError: the collective failed (a rank died), or timed out after the process group's timeout.
        """
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()
        return list(self._tensors)


def gather_tensor_async(tensor: torch.Tensor) -> PendingGather:
    """Starts an all-gather of ``tensor`` (a CPU tensor of the same shape and dtype on every rank) over the host group
    without waiting for it, as :func:`reduce_max_async` does for a MAX; :meth:`PendingGather.wait` reads it later.
    Every rank must issue it at the same point. Not distributed: ``[tensor]``, nothing in flight."""
    if tensor.device.type != "cpu":
        raise ValueError(f"gather_tensor_async gathers CPU tensors over the gloo host group, got one on "
                         f"{tensor.device}")
    if not is_distributed():
        return PendingGather([tensor], None)
    out = [torch.empty_like(tensor) for _ in range(get_world_size())]
    return PendingGather(out, dist.all_gather(out, tensor.contiguous(), group=_host_group(), async_op=True))


def gather(obj: Any) -> List[Any]:
    """Every rank's ``obj`` (small, picklable host values), in rank order, on every rank: ``[obj]`` without a group.

    The one collective of an incident's agreement (:mod:`~.recovery.chain`): each rank decides locally, then all
    decide the same from the same list. Every rank must call it at the same point.
    """
    if not is_distributed():
        return [obj]
    gathered: List[Any] = [None] * get_world_size()
    dist.all_gather_object(gathered, obj, group=_host_group())
    return gathered


def broadcast_object(obj: Optional[Any], src: int = 0) -> Any:
    """Sends ``obj`` from ``src`` to every rank over the host group and returns it on all of them."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_host_group())
    return box[0]


class _Slot:
    """Stands for a tensor inside a stripped payload: its position in the tensor list, shape and dtype."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape: torch.Size, dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, tuple(shape), dtype

    def __repr__(self) -> str:
        return f"_Slot({self.index}, {self.shape}, {self.dtype})"


def strip_tensors(obj: Any) -> Tuple[Any, List[torch.Tensor]]:
    """Splits nested state into a tensor-free skeleton (deep-copied) and its tensors in traversal order.

    The skeleton is small and picklable; :func:`fill_tensors` puts tensors back into it.
    """
    tensors: List[torch.Tensor] = []

    def slot(t: torch.Tensor, _: Any) -> _Slot:
        tensors.append(t)
        return _Slot(len(tensors) - 1, t.shape, t.dtype)

    return map_tensors(obj, slot, leaf=copy.deepcopy), tensors


def _slots(skeleton: Any) -> List[_Slot]:
    found: List[_Slot] = []
    map_tensors(skeleton, lambda t, _: t, leaf=lambda v: found.append(v) if isinstance(v, _Slot) else None)
    return found


def fill_tensors(skeleton: Any, tensors: List[torch.Tensor]) -> Any:
    """The inverse of :func:`strip_tensors`: a copy of ``skeleton`` with every slot replaced by its tensor."""
    return map_tensors(skeleton, lambda t, _: t, leaf=lambda v: tensors[v.index] if isinstance(v, _Slot) else v)


def _send_view(t: torch.Tensor) -> torch.Tensor:
    # Gloo has no bool reduction type on every build: bools travel as bytes.
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def broadcast_payload(payload: Any, src: int = 0, group: Any = None, known_structure: bool = False) -> Any:
    """Sends nested state with tensors from ``src`` to the ranks of ``group`` (default: all ranks).

    The structure travels pickled once; each tensor travels by itself over the gloo host group, so no rank
    ever holds a second pickled copy of a large state, and the receivers need no filesystem. Every rank of
    the group must call it at the same point.

    Args:
        payload: the state on ``src`` (host tensors); elsewhere ignored, or the receiver's own
            :func:`strip_tensors` skeleton with ``known_structure``.
        src: the sending global rank. Defaults to 0.
        group: a gloo process group holding ``src``. Defaults to the host group over all ranks.
        known_structure: every receiver passes its own skeleton (a per-node snapshot): only a signature is
            checked and only the tensors travel. Must be the same on all ranks. Defaults to False.

    Returns:
        The state on every rank (``payload`` itself on ``src``).

    Raises:
        RuntimeError: a receiver's skeleton does not match the sender's tensors.
    """
    if not is_distributed():
        return payload
    group = _host_group() if group is None else group
    me = get_rank()
    if me == src:
        sent_skeleton, tensors = strip_tensors(payload)
        signature = [(tuple(t.shape), str(t.dtype)) for t in tensors]
    else:
        sent_skeleton, tensors, signature = None, [], None
    box = [signature if known_structure else (signature, sent_skeleton)]
    dist.broadcast_object_list(box, src=src, group=group)
    if known_structure:
        signature, skeleton = box[0], payload
    else:
        signature, skeleton = box[0]
    mismatch = 0
    if me != src:
        slots = sorted(_slots(skeleton), key=lambda s: s.index)
        mine = [(tuple(s.shape), str(s.dtype)) for s in slots]
        mismatch = int(mine != signature)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in slots] if not mismatch else []
    if known_structure:
        # Agreed, so that a mismatch anywhere stops every rank here instead of leaving the sender waiting.
        flag = torch.tensor([mismatch], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag):
            raise RuntimeError(
                f"rank {me}: a rank's state structure differs from rank {src}'s; snapshot_copies='node' needs "
                "replicated state (plain DDP), not sharded optimizers"
            )
    for i, t in enumerate(tensors):
        if me == src and not t.is_contiguous():
            t = tensors[i] = t.contiguous()
        dist.broadcast(_send_view(t), src=src, group=group)
    return payload if me == src else fill_tensors(skeleton, tensors)


def node_group() -> Tuple[Any, int, List[int]]:
    """(gloo group of this node's ranks, this node's leader rank, the node's ranks), built once.

    Nodes are told apart by host name, so it works whatever the launcher sets for local ranks. Every rank
    must call it the first time at the same point (it creates one group per node, on all ranks).
    """
    global _NODE
    if _NODE is None:
        if not is_distributed():
            _NODE = (None, 0, [0])
            return _NODE
        hosts: List[Any] = [None] * get_world_size()
        dist.all_gather_object(hosts, socket.gethostname(), group=_host_group())
        mine = None
        for host in sorted(set(hosts)):
            ranks = [r for r, h in enumerate(hosts) if h == host]
            group = dist.new_group(ranks, backend="gloo")  # every rank takes part in creating every group
            if get_rank() in ranks:
                mine = (group, ranks[0], ranks)
        _NODE = mine
    return _NODE
