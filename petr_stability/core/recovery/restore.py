"""The restore points of one run, in a stated order, and the lineage that keeps a rollback inside its own run.

Snapshots (:class:`~.snapshot.SnapshotRing`) and the start state are host copies this process took; checkpoints are
read from disk by rank 0 alone and sent to the others, and only files that carry this run's ``run_id`` and an
iteration not beyond the current one are used (another run's files in a reused work dir, or a later, abandoned
path's, never are).
"""
import uuid
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Set, Tuple

import torch

from .. import distributed
from ..errors import UnsafeCheckpointError
from ..port import GuardIO, Payload
from ..tree import iter_tensors, nbytes
from ..watch.health import ByDesign, all_finite, by_design, first_nonfinite, state_dict_finite
from .snapshot import Snapshot, SnapshotRing, copies_done, copy_to_host

__all__ = ["RESTORE_ORDER", "RestorePoints", "checkpoint_finite", "check_checkpoint"]

#: How a restore point taken where the trouble started is named (a healthy state to use without a warning).
_AT_TROUBLE = "memory (where the trouble started)"
#: Where a rollback looks, in this order; each point is tried at most once per incident chain (until a state
#: taken after the latest recovery is confirmed). docs/how-it-works.md, "Restore points", says why.
RESTORE_ORDER = (
    "for bad data and a forward overflow the healthy weights show too (not one the weights grew into) only: the "
    "snapshot taken where the trouble started",
    "confirmed snapshots, newest first",
    "unconfirmed snapshots of this run, newest first, but for those taken since it left its stability band",
    "the state the run started from (before its first step, or right after resume)",
    "unconfirmed snapshots taken since the run left its stability band (after its newest healthy state: on a loss "
    "or grad_norm explosion's path), newest first",
    "this run's finite checkpoints, newest first",
)


def checkpoint_finite(checkpoint: Dict[str, Any], design: Optional[ByDesign] = None) -> bool:
    """The one "is this checkpoint finite" rule: its model weights and its optimizer state, but for the model's
    entries non-finite by design (``design``: a causal ``-inf`` mask buffer, unchanged since the run's start)."""
    weights = checkpoint.get("state_dict", checkpoint)
    return state_dict_finite(weights if isinstance(weights, Mapping) else {}, design) and all_finite(
        iter_tensors(checkpoint.get("optimizer", {})))


def check_checkpoint(checkpoint: Dict[str, Any], what: str, design: Optional[ByDesign] = None) -> None:
    """Raises :class:`~..errors.UnsafeCheckpointError` if a checkpoint's model or optimizer tensors are not all
    finite, but for the entries non-finite by design (a checkpoint being saved or loaded)."""
    if checkpoint_finite(checkpoint, design):
        return
    design = design if design is not None else ByDesign()
    bad = first_nonfinite(
        (k, v) for k, v in dict(checkpoint.get("state_dict", {})).items()
        if isinstance(v, torch.Tensor) and not design.allows(str(k), v))
    raise UnsafeCheckpointError(
        f"{what} holds non-finite values (first: {bad or 'optimizer state'}); refusing to use it. "
        "Pick an earlier checkpoint; the incident log in the work dir says when training diverged.")


@dataclass
class _Point:
    """One restore point: where it lives and how to read it (lazily: a checkpoint is read only when tried)."""

    key: str
    kind: str
    iteration: int
    read: Callable[[], Optional[Payload]] = field(repr=False)


class RestorePoints:
    """The run's snapshots, its start state and its checkpoints, offered in :data:`RESTORE_ORDER`.

    Args:
        io: the runner adapter.
        keep: snapshots held in host memory.
        confirm_steps: clean steps after a snapshot before it counts as healthy.
        from_checkpoints: offer this run's own finite checkpoints after the in-memory states.
        node_copies: ``snapshot_copies='node'``: one copy per node, on its lowest rank.
        tags_of: the remedies' restore tags in a checkpoint's guard state (:meth:`~..remedies.registry.Remedies.
            tags_in`). Defaults to None (none).
    """

    def __init__(self, io: GuardIO, keep: int, confirm_steps: int, from_checkpoints: bool,
                 node_copies: bool, tags_of: Optional[Callable[[Optional[Dict[str, Any]]], Dict[str, Any]]] = None
                 ) -> None:
        self.io = io
        self.tags_of = tags_of or (lambda _: {})
        self.ring = SnapshotRing(keep, confirm_steps)
        self.start: Optional[Snapshot] = None
        self.from_checkpoints = from_checkpoints
        self.node_copies = node_copies
        #: Names this run in every checkpoint it saves: a rollback only ever uses checkpoints carrying it.
        self.run_id = uuid.uuid4().hex
        self._foreign_logged = False

    # ------------------------------------------------------------------ taking states
    def take(self, iteration: int, epoch: int, recycle: bool, generation: int,
             tags: Optional[Dict[str, Any]] = None, at_trouble: bool = False) -> Snapshot:
        """A host copy of the live state. Pinned host memory and asynchronous copies where the model lives on a
        GPU, with an event marking their end: no host wait here (the copies are queued on the current stream ahead
        of anything that writes the state again; docs/gpu.md says why not a side stream); the host waits only when
        it reads the snapshot. ``recycle``: copy into the ring's oldest snapshot instead of allocating."""
        if self._holds_no_tensors():
            # The node's leader keeps the tensors; this rank keeps the structure and its own small state.
            payload, device, pin = distributed.strip_tensors(self.io.capture())[0], None, False
        else:
            device = next((p.device for p in self.io.model().parameters()), None)
            pin = device is not None and device.type == "cuda"
            payload = copy_to_host(self.io.capture(), reuse=self.ring.recyclable() if recycle else None, pin=pin)
        return Snapshot(iteration, epoch, payload, nbytes=nbytes(payload), copied=copies_done(pin, device),
                        generation=generation, tags=MappingProxyType(dict(tags or {})),
                        at_trouble=at_trouble)

    def healthy(self) -> Optional[Snapshot]:
        """The newest state known healthy: the newest confirmed snapshot, else the start state."""
        return self.ring.newest_confirmed() or self.start

    def healthy_weights(self) -> Tuple[Optional[Snapshot], Optional[Dict[str, torch.Tensor]], str]:
        """(the newest state known healthy, its model weights where it holds real tensors, how records name it):
        what a replay on healthy weights starts from."""
        snap = self.healthy()
        weights = as_tensors(snap.ready_payload()) if snap is not None else None
        where = ("the run's start state" if snap is self.start else f"snapshot of iter {snap.iteration}"
                 if snap is not None else "")
        return snap, weights, where

    def drop_after(self, iteration: int) -> None:
        """Forgets snapshots newer than ``iteration``: they belong to the abandoned path."""
        self.ring.snapshots = [s for s in self.ring.snapshots if s.iteration <= iteration]

    # ------------------------------------------------------------------ offering them
    def _points(self, now: int, tried: Set[str], trouble_first: bool = False,
                unstable_since: Optional[int] = None) -> Iterator[_Point]:
        ring = self.ring
        confirmed = [s for s in reversed(ring.snapshots) if ring.is_confirmed(s)]
        pending = [s for s in reversed(ring.snapshots) if not ring.is_confirmed(s)]
        # Where the trouble started, first: for a class whose state was fine (bad data, a forward overflow the healthy
        # weights show too) it is the closest healthy state. For the others an unconfirmed one is no restore point at
        # all.
        trouble = [s for s in pending if s.at_trouble]
        pending = [s for s in pending if not s.at_trouble]
        # A state taken since the run left its band lies on the explosion's path: after the run's start state.
        since = unstable_since if unstable_since is not None else float("inf")
        during = [s for s in pending if s.iteration >= since]
        pending = [s for s in pending if s.iteration < since]
        for kind, snaps in (((_AT_TROUBLE, trouble),) if trouble_first else ()) + (
                ("memory", confirmed), ("memory (unconfirmed)", pending)):
            yield from self._snapshot_points(kind, snaps)
        if self.start is not None:
            yield _Point(self.start_key(), "start", self.start.iteration, lambda: self.payload(self.start, "start"))
        yield from self._snapshot_points("memory (unconfirmed, taken since the run left its band)", during)
        if self.from_checkpoints:
            yield _Point("checkpoints", "checkpoint", -1, lambda: self._checkpoint_payload(now, tried))

    def _snapshot_points(self, kind: str, snaps: List[Snapshot]) -> Iterator[_Point]:
        for snap in snaps:
            yield _Point(f"snapshot of iter {snap.iteration} (path {snap.generation})", kind, snap.iteration,
                         lambda snap=snap: self.payload(snap))

    def start_key(self) -> str:
        """How the start state is named in an incident chain's ``tried`` set."""
        return f"start state (iter {self.start.iteration})" if self.start is not None else ""

    def next(self, now: int, tried: Set[str], trouble_first: bool = False,
             unstable_since: Optional[int] = None) -> Optional[Payload]:
        """The first point in :data:`RESTORE_ORDER` not in ``tried`` (which it extends); None when all are spent. With
        ``trouble_first`` (a class whose state was fine: bad data, a forward overflow the healthy weights show too), the
        unconfirmed snapshots taken where the trouble started come first; otherwise they are not offered. Unconfirmed
        snapshots taken at or after ``unstable_since`` (the first step judged unstable since the newest healthy state:
        a loss or grad_norm explosion, in course or ended) come after the start state: they lie on the explosion's
        path.

        When every point is spent but the run trained on from its start state for more than one iteration (on data
        that moved on), the start state cannot be what diverged: it is the last healthy state of this run and is
        offered again (bounded by ``max_recoveries``) rather than giving up while it exists. A run whose steps after
        a restore are all loss-scale calibration (no snapshot can be confirmed) needs this. Every rank must call it
        at the same point (reading a checkpoint is a collective).
        """
        payload = self._first_untried(now, tried, trouble_first, unstable_since)
        if payload is None and self.start is not None and now - self.start.iteration > 1:
            tried.discard(self.start_key())
            payload = self._first_untried(now, tried, trouble_first, unstable_since)
        return payload

    def start_payload(self, tried: Set[str]) -> Optional[Payload]:
        """The run's start state, whether tried or not (which it marks): where an incident whose stop did not hold
        there is answered from (:meth:`~.chain.Evidence.overturned`); None without one."""
        if self.start is None:
            return None
        tried.add(self.start_key())
        return self.payload(self.start, "start")

    def _first_untried(self, now: int, tried: Set[str], trouble_first: bool,
                       unstable_since: Optional[int] = None) -> Optional[Payload]:
        for point in self._points(now, tried, trouble_first, unstable_since):
            if point.key in tried:
                continue
            if point.kind != "checkpoint":
                tried.add(point.key)
                if point.kind not in ("memory", _AT_TROUBLE):
                    self.io.log(f"NanGuard: no confirmed snapshot is left; using {point.kind} state of iter "
                                f"{point.iteration}", "warning")
            payload = point.read()
            if payload is not None:
                return payload
        return None

    def payload(self, snap: Snapshot, source: str = "memory") -> Payload:
        """A snapshot as a :class:`~..port.Payload` (from the node's leader where ``snapshot_copies='node'``)."""
        state = snap.ready_payload()
        if self.node_copies and distributed.is_distributed():
            group, leader, _ = distributed.node_group()
            state = distributed.broadcast_payload(state, src=leader, group=group, known_structure=True)
        return Payload(state, snap.iteration, snap.epoch, source=source, tags=snap.tags)

    def _holds_no_tensors(self) -> bool:
        if not self.node_copies or not distributed.is_distributed():
            return False
        return distributed.node_group()[1] != distributed.get_rank()

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_payload(self, now: int, tried: Set[str]) -> Optional[Payload]:
        # Rank 0 alone lists, reads and checks the files; the others receive its choice and its tensors, so
        # no shared filesystem is needed and every rank restores the same state (or gives up together).
        found = self._read_own_checkpoint(now, tried) if distributed.get_rank() == 0 else None
        meta = distributed.broadcast_object(
            None if found is None else (found.source, found.iteration, found.epoch, dict(found.tags)))
        if meta is None:
            return None
        state = distributed.broadcast_payload(found.state if found is not None else None)
        if found is None:
            self.io.log(f"NanGuard: received checkpoint {meta[0]} from rank 0")
        tried.add(meta[0])
        return Payload(state, meta[1], meta[2], source=meta[0], strict=False, tags=meta[3])

    def _candidates(self, now: int, tried: Set[str]) -> List[Tuple[int, str, Payload]]:
        candidates: List[Tuple[int, str, Payload]] = []
        foreign: List[str] = []
        for path in self.io.checkpoint_files():
            if path in tried:
                continue
            try:
                payload, guard_state = self.io.read_checkpoint(path)
            except Exception as exc:  # a truncated or foreign file must not end the recovery
                self.io.log(f"NanGuard: skipping checkpoint {path}: {type(exc).__name__}: {exc}", "warning")
                tried.add(path)
                continue
            if (guard_state or {}).get("run_id") != self.run_id or payload.iteration > now:
                foreign.append(f"{path} (iter {payload.iteration})")
                continue
            payload.tags = self.tags_of(guard_state)
            candidates.append((payload.iteration, path, payload))
        if foreign and not self._foreign_logged:
            self._foreign_logged = True
            self.io.log(f"NanGuard: ignoring {len(foreign)} checkpoint(s) not written by this run before iter {now} "
                        f"(another run's, or from an abandoned later path): {', '.join(foreign[:5])}", "warning")
        return candidates

    def _read_own_checkpoint(self, now: int, tried: Set[str]) -> Optional[Payload]:
        for _, path, payload in sorted(self._candidates(now, tried), key=lambda c: c[0], reverse=True):
            rest = {k: v for k, v in payload.state.items() if k != "state_dict"}
            if state_dict_finite(payload.state.get("state_dict", {}), by_design(self.io.model())) and all_finite(
                    iter_tensors(rest)):
                return payload
            self.io.log(f"NanGuard: skipping checkpoint {path}: it holds non-finite values", "warning")
            tried.add(path)
        return None


def as_tensors(state: Any) -> Optional[Dict[str, torch.Tensor]]:
    """A snapshot's model state dict when it holds real tensors (not a node copy's bare structure), else None."""
    weights = (state or {}).get("state_dict")
    if not weights or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        return None
    return weights
