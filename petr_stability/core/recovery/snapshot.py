"""In-memory host copies of training state, and the ring that decides which of them count as healthy."""
import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ..tree import map_tensors

__all__ = ["Snapshot", "SnapshotRing", "copy_to_host", "copies_done", "load_optimizer_state"]


_PIN_FAILED = False


def _host_buffer(like: torch.Tensor, pin: bool) -> Tuple[torch.Tensor, bool]:
    """An empty host tensor shaped like ``like``, and whether it is pinned (asked for and granted).

    Pinned memory is page-locked host RAM; where the system cannot give more (a snapshot ring of a large model
    on every rank of a node), the copy goes to ordinary memory with a synchronous copy instead of failing the
    run: slower snapshots, same contents.
    """
    global _PIN_FAILED
    if pin and not _PIN_FAILED:
        try:
            return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True), True
        except RuntimeError as exc:
            _PIN_FAILED = True  # once: not one warning (and one failing allocation) per tensor
            warnings.warn(f"NanGuard: pinned host memory unavailable ({exc}); snapshots use pageable memory and "
                          "synchronous copies", RuntimeWarning, stacklevel=3)
    return torch.empty(like.shape, dtype=like.dtype, device="cpu"), False


def copy_to_host(obj: Any, reuse: Any = None, pin: bool = False) -> Any:
    """Deep-copies ``obj`` with every tensor copied to CPU memory.

    Tensors are copied into ``reuse``'s tensors where the structure, shape and dtype match, so a ring that
    recycles its oldest snapshot allocates nothing in steady state. Device tensors go through pinned
    memory with ``non_blocking`` copies when ``pin`` is set: the copies are queued on the current stream and
    the host does not wait for them; :func:`copies_done` marks their end, and :meth:`Snapshot.ready_payload`
    waits for that mark before the host reads the copy. Non-tensor leaves (scheduler fields, history buffers)
    are deep-copied.
    """

    def copy_one(t: torch.Tensor, old: Any) -> torch.Tensor:
        src = t.detach()
        if (isinstance(old, torch.Tensor) and old.shape == src.shape and old.dtype == src.dtype
                and old.device.type == "cpu" and old is not src):
            old.copy_(src, non_blocking=pin)
            return old
        if src.device.type == "cpu":
            return src.clone()
        out, pinned = _host_buffer(src, pin)
        out.copy_(src, non_blocking=pinned)
        return out

    return map_tensors(obj, copy_one, like=reuse, leaf=copy.deepcopy)


def copies_done(pin: bool, device: Any = None) -> Any:
    """An event recorded on ``device``'s current CUDA stream after the copies queued so far (None without ``pin``).

    The host does not wait: the copies run on the stream in order with the step that follows, and whatever
    writes the copied tensors next (the next forward's BatchNorm buffers, the next optimizer step) is queued
    behind them on the same stream. Only a host read of the copy has to wait (:meth:`Snapshot.ready_payload`).
    """
    if not pin:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _copy_state_inplace(optimizer: Any, saved: Dict[str, Any]) -> bool:
    live_groups = optimizer.param_groups
    saved_groups = saved.get("param_groups", [])
    if len(live_groups) != len(saved_groups):
        return False
    pairs = []
    for live_g, saved_g in zip(live_groups, saved_groups):
        if len(live_g["params"]) != len(saved_g["params"]):
            return False
        for p, idx in zip(live_g["params"], saved_g["params"]):
            live, old = optimizer.state.get(p, {}), saved["state"].get(idx, {})
            if set(live) != set(old):
                return False
            for k, v in old.items():
                cur = live[k]
                if isinstance(v, torch.Tensor) != isinstance(cur, torch.Tensor):
                    return False
                if isinstance(v, torch.Tensor) and (v.shape != cur.shape or v.dtype != cur.dtype):
                    return False
            pairs.append((live, old))
    for live, old in pairs:
        for k, v in old.items():
            if isinstance(v, torch.Tensor):
                live[k].copy_(v, non_blocking=True)
            else:
                live[k] = copy.deepcopy(v)
    for live_g, saved_g in zip(live_groups, saved_groups):
        for k, v in saved_g.items():
            if k != "params":
                live_g[k] = copy.deepcopy(v)  # lr, momentum...: schedulers write them here
    return True


def load_optimizer_state(optimizer: Any, state_dict: Dict[str, Any]) -> None:
    """Loads an optimizer state dict without aliasing it: the snapshot stays intact for a later restore.

    When the live state has the same layout (the usual case: the same optimizer, a few hundred steps later)
    every tensor is copied into the existing buffers, which costs one copy of the state and allocates nothing;
    otherwise a private copy is loaded with ``load_state_dict`` (torch keeps CPU tensors as given).
    """
    if not _copy_state_inplace(optimizer, state_dict):
        optimizer.load_state_dict(copy_to_host(state_dict))


@dataclass
class Snapshot:
    """A host copy of the training state taken after the optimizer step of ``iteration``.

    Attributes:
        iteration: completed iterations when it was taken (restoring it sets the counter back).
        epoch: the epoch counter then.
        payload: the adapter's state dicts with every tensor on the host.
        clean_steps: stable healthy optimizer steps in a row since (:meth:`SnapshotRing.tick`); it is *confirmed*
            once this reaches the ring's ``confirm_steps`` (a state on a path that is already diverging, finite or not,
            is not a state to return to).
        copied: the event that marks the end of its device-to-host copies (None when they were synchronous).
        generation: the guard's recovery count when it was taken (a confirmed snapshot of the current generation
            means the latest recovery held).
        tags: what the remedies recorded with it (:attr:`~..port.Payload.tags`).
        at_trouble: taken where the detector first saw trouble (the first skipped step of a streak: the weights of
            the last applied step), not by the snapshot clock: the restore point for bad data and a forward overflow
            the healthy weights show too (the state was fine, the batch or a module's fp16 range was not; not for
            one the weights grew into), never for the dynamics ladder while unconfirmed (a state at the edge of a
            divergence is no state to return to there).
    """

    iteration: int
    epoch: int
    payload: Dict[str, Any]
    clean_steps: int = 0
    nbytes: int = field(default=0)
    copied: Any = field(default=None, repr=False)
    generation: int = 0
    tags: Mapping[str, Any] = field(default_factory=dict)
    at_trouble: bool = False

    def ready_payload(self) -> Dict[str, Any]:
        """The payload, after its asynchronous copies (if any) have landed; the only way the host should read it.

        Waiting here costs nothing in practice: a snapshot is read on a rollback, hundreds of steps after it
        was taken.
        """
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        return self.payload


class SnapshotRing:
    """Keeps the newest ``keep`` snapshots and knows which are confirmed healthy.

    Args:
        keep: snapshots held (>= 2, so that a confirmed one survives while a newer one is pending).
        confirm_steps: W, clean steps after a snapshot before it counts as healthy.
    """

    def __init__(self, keep: int = 2, confirm_steps: int = 50) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            raise ValueError(f"keep_snapshots must be an integer >= 2, got {keep!r}")
        if isinstance(confirm_steps, bool) or not isinstance(confirm_steps, int) or confirm_steps < 0:
            raise ValueError(f"confirm_steps must be an integer >= 0, got {confirm_steps!r}")
        self.keep = keep
        self.confirm_steps = confirm_steps
        self.snapshots: List[Snapshot] = []  # oldest first
        #: The first unstable step of the trouble in course (watch/spikes.py), or None: while it lasts, no snapshot
        #: taken at or after it is confirmed, whatever stable steps followed it (trouble ends after a few calm ones).
        self.trouble_since: Optional[int] = None

    def __len__(self) -> int:
        return len(self.snapshots)

    def is_confirmed(self, snap: Snapshot) -> bool:
        """``confirm_steps`` stable steps in a row followed ``snap``, and it was not taken since the trouble in course
        started (a state on that path is no restore point until the trouble is over)."""
        return snap.clean_steps >= self.confirm_steps and (self.trouble_since is None
                                                           or snap.iteration < self.trouble_since)

    def recyclable(self) -> Optional[Dict[str, Any]]:
        """The payload that the next :meth:`add` will evict, to copy into instead of allocating."""
        if len(self.snapshots) < self.keep:
            return None
        victim = self._victim()
        return victim.payload if victim is not None else None

    def _victim(self) -> Optional[Snapshot]:
        newest_confirmed = self.newest_confirmed()
        for snap in self.snapshots:
            if snap is not newest_confirmed:
                return snap
        return None

    def add(self, snap: Snapshot) -> None:
        while len(self.snapshots) >= self.keep:
            victim = self._victim()
            if victim is None:
                break
            self.snapshots.remove(victim)
        self.snapshots.append(snap)

    def tick(self, stable: bool = True) -> None:
        """One clean optimizer step happened. An unstable one (finite, but its loss or grad_norm out of the run's
        band: watch/spikes.py) confirms nothing and sends every unconfirmed snapshot back to zero clean steps:
        healthy means ``confirm_steps`` stable steps in a row after it, not merely finite ones."""
        for snap in self.snapshots:
            if stable:
                snap.clean_steps += 1
            elif not self.is_confirmed(snap):
                snap.clean_steps = 0

    def newest_confirmed(self) -> Optional[Snapshot]:
        for snap in reversed(self.snapshots):
            if self.is_confirmed(snap):
                return snap
        return None

    def discard_unconfirmed(self) -> int:
        """Drops snapshots not yet confirmed (taken on the path that just diverged); returns how many."""
        before = len(self.snapshots)
        self.snapshots = [s for s in self.snapshots if self.is_confirmed(s)]
        return before - len(self.snapshots)

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)
