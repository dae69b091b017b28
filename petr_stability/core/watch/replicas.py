"""Data-parallel replicas that drift apart: compared every few hundred steps off the critical path, repaired from the
majority's copy.

Data-parallel ranks must hold the same weights. A silent hardware or memory fault, a rank-local in-place write or a
buffer only one rank updates makes one rank's copy differ without a NaN, and from then on the ranks train on different
models. At a check iteration every rank digests each parameter, and each buffer DDP keeps in step, on its device (two
integer sums over the tensor's raw bits: exact, and the same whatever order a reduction adds in), copies the digests to
the host once and issues an all-gather of them over the host gloo group; it reads them one iteration later (or at the
epoch's end), when DDP's gradient all-reduce has brought every rank's already. Between checks nothing runs. Only on a
mismatch: every rank's differing tensors are checked finite (a NaN is the divergence path's), the copy most ranks hold
(rank 0's where two ranks tie) is sent to the ranks whose copy differs, model and optimizer state, and a
``replica_drift`` record names them, the tensors and how far apart they were (docs/distributed.md, "Replicas that drift
apart"). A rank that drifts again and again is named in a :class:`~..errors.ReplicaDriftError`.
"""
import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import distributed
from ..errors import ReplicaDriftError
from ..port import Change, GuardIO
from ..records import Event, step_record
from ..recovery.snapshot import load_optimizer_state
from ..tree import map_tensors
from .detector import Decision, StepSignals, Verdict

__all__ = ["DRIFT_LIMIT", "DRIFT_WINDOW", "RANK_LOCAL_BUFFERS", "tensor_digest", "digests", "replicated_tensors",
           "unreplicated", "Mismatch", "compare", "Outcome", "ReplicaCheck"]

#: A rank found drifting at this many of the last :data:`DRIFT_WINDOW` checks is faulty: the run stops naming it.
DRIFT_LIMIT = 3
DRIFT_WINDOW = 10
#: Buffers of normalization layers that each rank's forward updates from its own batch (after DDP's broadcast at the
#: forward's start, or with none: ``broadcast_buffers=False``): rank-local by design, never compared.
RANK_LOCAL_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
#: Elements per reduction of a large tensor's digest: bounds the temporary memory a check takes on the device.
_CHUNK = 1 << 24
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Tensor types that hold a shard of a parameter (FSDP, tensor-parallel plans, torch's sharded tensors).
_SHARDED = ("DTensor", "FlatParameter", "ShardedTensor")
_SHARDING_MODULES = ("FullyShardedDataParallel", "FSDPModule")


def _raw_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as a flat integer tensor of the same width (floats compared bit for bit: -0.0 is not 0.0)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype == torch.bool else t.view(_INTS[t.element_size()])


def _sums(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`tensor_digest`'s two sums as 0-d tensors on ``t``'s device (a tensor of up to :data:`_CHUNK` elements, the
    usual case, in two reductions)."""
    bits = _raw_bits(t)
    n = bits.numel()
    if n <= _CHUNK:
        mixed = torch.sum(bits[:-1] ^ bits[1:], dtype=torch.int64)
        return torch.sum(bits, dtype=torch.int64), mixed  # second: the bits are still in cache
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    mixed = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, n, _CHUNK):
        part = bits[start:start + _CHUNK + 1]  # one element more: the pair that straddles two chunks
        if part.numel() > 1:
            mixed += torch.sum(part[:-1] ^ part[1:], dtype=torch.int64)
        total += torch.sum(part[:_CHUNK], dtype=torch.int64)
    return total, mixed


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """Two int64 on ``t``'s device: the sum of its raw bits (any change of one element changes it) and the sum of each
    element's bits XOR the next one's (an exchange of two elements changes it). Integer sums wrap alike on every rank
    and do not depend on the order a reduction adds in."""
    return torch.stack(_sums(t))


def digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """An ``[n, 2]`` int64 host tensor: :func:`tensor_digest` of each, reduced on their device and copied to the host
    in one transfer (the only host-device synchronization a check takes)."""
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64)
    sums = [s for t in tensors for s in _sums(t)]
    device = sums[0].device
    return torch.stack([s if s.device == device else s.to(device) for s in sums]).view(-1, 2).cpu()


def replicated_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """What every data-parallel rank must hold alike, by name: every parameter, then every buffer (non-persistent ones
    too) but the :data:`RANK_LOCAL_BUFFERS` of normalization layers."""
    found = list(model.named_parameters())
    for prefix, module in model.named_modules():
        local = isinstance(module, nn.modules.batchnorm._NormBase)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and not (local and name in RANK_LOCAL_BUFFERS):
                found.append((f"{prefix}.{name}" if prefix else name, buffer))
    return found


def unreplicated(model: nn.Module) -> Optional[str]:
    """Why ``model``'s parameters are not whole copies on this rank (sharded by FSDP, a tensor-parallel plan or
    DeepSpeed ZeRO), or None."""
    for name, p in model.named_parameters():
        kind = next((k for k in (type(p).__name__, type(p.data).__name__) if k in _SHARDED), None)
        if kind is not None:
            return f"parameter {name} is a {kind} (sharded by FSDP or a tensor-parallel plan)"
        if hasattr(p, "ds_id"):
            return f"parameter {name} is partitioned by DeepSpeed ZeRO"
    for name, module in model.named_modules():
        if any(c.__name__ in _SHARDING_MODULES for c in type(module).__mro__):
            return f"module {name or '(the model)'} is sharded by FSDP ({type(module).__name__})"
    return None


@dataclass(frozen=True)
class Mismatch:
    """Copies that differ.

    Attributes:
        reference: the rank whose copy the others take: the copy most ranks hold, the lowest rank's among copies held
            by as many (rank 0's where two ranks differ).
        drifted: the ranks whose copy differs from the reference's.
        tensors: the positions (in :func:`replicated_tensors`' order) of the tensors that differ on any of them.
    """

    reference: int
    drifted: Tuple[int, ...]
    tensors: Tuple[int, ...]


def compare(gathered: Sequence[torch.Tensor]) -> Optional[Mismatch]:
    """Every rank's :func:`digests`, in rank order, compared; None where every copy is the same."""
    groups: List[List[int]] = []
    for rank, rows in enumerate(gathered):
        same = next((g for g in groups if torch.equal(gathered[g[0]], rows)), None)
        if same is None:
            groups.append([rank])
        else:
            same.append(rank)
    if len(groups) < 2:
        return None
    majority = max(groups, key=lambda g: (len(g), -g[0]))  # groups are opened in rank order: g[0] is their lowest
    reference = gathered[majority[0]]
    drifted = tuple(r for r in range(len(gathered)) if r not in majority)
    differ = torch.zeros(reference.shape[0], dtype=torch.bool)
    for rank in drifted:
        differ |= (gathered[rank] != reference).any(dim=1)
    return Mismatch(majority[0], drifted, tuple(int(i) for i in differ.nonzero().flatten().tolist()))


@dataclass
class Outcome:
    """What reading one check came to.

    Attributes:
        records: the records to write (a ``replica_drift``; a ``gave_up`` before the error).
        error: the error to raise once they are written (a rank that keeps drifting), or None.
        repaired: the drifted ranks took the reference's copy.
        clean_since: the iteration since which every copy was known to be the same (the last check that found them
            so, or the last repair): a snapshot taken after it may hold a drifted copy.
    """

    records: List[Dict[str, Any]] = field(default_factory=list)
    error: Optional[Exception] = None
    repaired: bool = False
    clean_since: int = 0


class _Issued(NamedTuple):
    """A check in flight: the gather and the step it describes."""

    gather: distributed.PendingGather
    signals: StepSignals
    epoch: int
    token: int


def _finite(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex()) or bool(torch.isfinite(t).all())


def _signature(named: Sequence[Tuple[str, torch.Tensor]]) -> str:
    text = repr([(n, tuple(t.shape), str(t.dtype)) for n, t in named])
    return hashlib.sha256(text.encode()).hexdigest()


def _why_off(views: Sequence[Tuple[Optional[str], str, List[List[int]]]]) -> str:
    """Why the ranks' start views say they hold no replicas (empty where they do)."""
    sharded = [f"rank {r}: {why}" for r, (why, _, _) in enumerate(views) if why]
    if sharded:
        return "; ".join(sharded[:2]) + ": which ranks hold the same shard is not the guard's to tell"
    if len({signature for _, signature, _ in views}) > 1:
        return ("the ranks hold different tensors (model or pipeline parallel): which ranks hold the same copy is not "
                "the guard's to tell")
    if any(rows != views[0][2] for _, _, rows in views):
        return ("the ranks start from different weights (a tensor-parallel shard per rank, or a model DDP did not "
                "broadcast as it was built): replicas cannot be told from shards")
    return ""


class ReplicaCheck:
    """Compares the data-parallel ranks' copies of the model every ``interval`` iterations and repairs a drift.

    The guard issues a check at a check iteration (:meth:`issue`) and reads it at the next one, or as the epoch ends
    (:meth:`conclude`), every rank at the same point. It never runs without a process group of two ranks or more.

    Args:
        interval: iterations between checks; 0 turns the check off.
        max_recoveries: the guard's budget (the records say it, as every record does).
        log_path: the incident log, named by the error.

    Attributes:
        on: checks run in this run (decided by :meth:`start` alike on every rank).
        pending: the check issued and not read yet (plain data: a run without a process group never calls in here).
        counts: what a checkpoint keeps: checks read, drifts found, repairs made, the iteration since which every copy
            was known to be the same (``last_clean``: the last check that found them so, or the last repair), and the
            recent drifts (check number, iteration, ranks).
    """

    def __init__(self, interval: int, max_recoveries: int = 0, log_path: Optional[str] = None) -> None:
        self.interval = interval
        self.max_recoveries = max_recoveries
        self.log_path = log_path
        self.on = False
        self.pending: Optional[_Issued] = None
        self.counts: Dict[str, Any] = {"checks": 0, "drifts": 0, "repairs": 0, "last_clean": 0, "history": []}

    def start(self, io: GuardIO, iteration: int) -> None:
        """As the run starts, on every rank: on where a process group of two ranks or more holds whole copies of the
        model, alike as the run starts (DDP sent rank 0's copy to every rank as it was built); one blocking gather
        compares them. Otherwise off, with one log line saying why."""
        self.on = False
        if self.interval == 0 or distributed.get_world_size() < 2:
            return
        model = io.model()
        why = unreplicated(model)
        named = [] if why else replicated_tensors(model)
        rows = digests([t for _, t in named]).tolist()
        off = _why_off(distributed.gather((why, _signature(named), rows)))
        if off:
            io.log(f"NanGuard: the replica check is off: {off}", "warning")
            return
        self.on = True
        self.counts["last_clean"] = iteration

    def issue(self, io: GuardIO, signals: StepSignals, epoch: int, token: int) -> None:
        """At a check iteration, on every rank: the digests, reduced on the device and copied to the host at once, and
        an all-gather of them issued; nothing waits for it.

        Args:
            io: the runner adapter.
            signals: the step's signals (the record's).
            epoch: the runner's epoch counter.
            token: the guard's recoveries: a rollback before the check is read leaves nothing for it to describe.

        Raises:
            RuntimeError: a check is still in flight (:meth:`conclude` it first).
        """
        if self.pending is not None:
            raise RuntimeError("ReplicaCheck: a check is still in flight; conclude() it before issuing another")
        rows = digests([t for _, t in replicated_tensors(io.model())])
        self.pending = _Issued(distributed.gather_tensor_async(rows), signals, epoch, token)

    def conclude(self, io: GuardIO, now: int, token: int) -> Outcome:
        """Reads the check in flight (every rank at the same point; under DDP it has arrived) and acts on it.

        Args:
            io: the runner adapter.
            now: completed iterations (the records' ``acted_at`` where later than the check's iteration).
            token: the guard's recoveries now: where a rollback came since the check, its state is gone; nothing.

        Returns:
            Nothing where every copy is the same; a drift's records, and whether the copies were repaired.
        """
        issued, self.pending = self.pending, None
        if issued is None:
            return Outcome(clean_since=self.counts["last_clean"])
        gathered = issued.gather.wait()
        if token != issued.token:
            return Outcome(clean_since=self.counts["last_clean"])
        self.counts["checks"] += 1
        found = compare(gathered)
        if found is None:
            self.counts["last_clean"] = issued.signals.iteration
            return Outcome(clean_since=self.counts["last_clean"])
        return self._drift(io, issued, found, now, token)

    # ------------------------------------------------------------------ on a mismatch only
    def _drift(self, io: GuardIO, issued: _Issued, found: Mismatch, now: int, recoveries: int) -> Outcome:
        named = replicated_tensors(io.model())
        differing = [named[i] for i in found.tensors]
        finite = distributed.gather(all(_finite(t) for _, t in differing))
        outcome = Outcome(clean_since=self.counts["last_clean"])
        if not all(finite):
            bad = [r for r, ok in enumerate(finite) if not ok]
            io.log(f"NanGuard: the replicas differ at iter {issued.signals.iteration} and rank(s) {bad} hold "
                   "non-finite values there: left to the divergence path (the step's health checks)", "warning")
            return outcome
        reference = _reference_state(io, dict(named), found.reference)
        rows = _differences(dict(differing), reference, found)
        self.counts["drifts"] += 1
        faulty = self._faulty(issued.signals.iteration, found.drifted)
        if not faulty and distributed.get_rank() in found.drifted:
            _load(io, dict(named), reference)
        outcome.repaired = not faulty
        outcome.records = [self._record(issued, found, rows, len(named), now, recoveries, outcome.repaired)]
        io.log(_line(issued.signals.iteration, found, rows, outcome.repaired, outcome.clean_since), "warning")
        if faulty:
            outcome.error = self._give_up(io, issued, faulty, outcome.records, recoveries)
        else:  # every copy is the same again from here on: a later drift spares the snapshots taken after now
            self.counts["repairs"] += 1
            self.counts["last_clean"] = now
        return outcome

    def _faulty(self, iteration: int, drifted: Sequence[int]) -> List[int]:
        """The ranks found drifting at :data:`DRIFT_LIMIT` of the last :data:`DRIFT_WINDOW` checks, this one included
        (the history keeps the drifts of those checks)."""
        check = self.counts["checks"]
        history = [h for h in self.counts["history"] if h["check"] > check - DRIFT_WINDOW]
        history.append({"check": check, "iteration": iteration, "ranks": list(drifted)})
        self.counts["history"] = history
        return [r for r in drifted if sum(r in h["ranks"] for h in history) >= DRIFT_LIMIT]

    def _record(self, issued: _Issued, found: Mismatch, rows: List[Dict[str, Any]], checked: int, now: int,
                recoveries: int, repaired: bool) -> Dict[str, Any]:
        """The ``replica_drift`` record: the schema every record has, then the ranks, the tensors and the repair."""
        ranks = ", ".join(str(r) for r in found.drifted)
        worst = max(rows, key=lambda row: row["max_abs_diff"], default=None)
        largest = "" if worst is None else (f" (largest: {worst['name']} on rank {worst['rank']}, max |diff| "
                                            f"{worst['max_abs_diff']:.3g})")
        reason = (f"replicas differ: rank(s) {ranks} hold a copy unlike rank {found.reference}'s in "
                  f"{len({row['name'] for row in rows})} tensor(s){largest}")
        action = (f"rank {found.reference}'s model and optimizer state sent to rank(s) {ranks}" if repaired else
                  "none: the rank keeps drifting, the run stops (ReplicaDriftError)")
        evidence = (f"the replica check of iter {issued.signals.iteration}: the digests of "
                    f"{len(found.tensors)} of {checked} compared tensor(s) differ from rank {found.reference}'s on "
                    f"rank(s) {ranks}, every differing value finite")
        cause = {"cause": "replica_drift", "evidence": evidence, "action": action, "modules": [],
                 "signals": {"tensors_checked": checked, "checks": self.counts["checks"]},
                 "ranks": {str(r): "replica_drift" for r in found.drifted}}
        changes = [Change(f"rank {r}: model and optimizer state", "its own copy (drifted)",
                          f"rank {found.reference}'s copy") for r in found.drifted] if repaired else []
        extra = {"acted_at": now} if now > issued.signals.iteration else {}
        return step_record(Event.REPLICA_DRIFT, issued.signals, Decision(Verdict.HEALTHY, reason), changes,
                           recoveries, self.max_recoveries, distributed.get_world_size(), **extra,
                           epoch=issued.epoch, cause=cause, samples=[], restored_from=None, iterations_lost=0,
                           diagnosis=None, drifted_ranks=list(found.drifted), reference_rank=found.reference,
                           tensors=rows, repaired=repaired)

    def _give_up(self, io: GuardIO, issued: _Issued, faulty: List[int], records: List[Dict[str, Any]],
                 recoveries: int) -> ReplicaDriftError:
        seen = [h["iteration"] for h in self.counts["history"] if set(faulty) & set(h["ranks"])]
        why = (f"rank(s) {', '.join(map(str, faulty))} drifted from the others' copy at {len(seen)} of the last "
               f"{DRIFT_WINDOW} replica checks (iters {', '.join(map(str, seen))}): a repair does not hold there. A "
               "faulty device or host memory, or code that writes to one rank's weights alone (an in-place update on "
               "one rank, a buffer only one rank updates): take that node out of the job, or find the write")
        records.append(step_record(Event.GAVE_UP, issued.signals, Decision(Verdict.HEALTHY, records[0]["reason"]), [],
                                   recoveries, self.max_recoveries, distributed.get_world_size(), epoch=issued.epoch,
                                   cause=records[0]["cause"], samples=[], restored_from=None, iterations_lost=0,
                                   diagnosis=None, why=why))
        message = f"NanGuard gave up at iter {issued.signals.iteration}: {why}.\nIncident log: {self.log_path}"
        io.log(message, "error")
        return ReplicaDriftError(message, faulty)

    # ------------------------------------------------------------------ persistence (the guard saves :attr:`counts`)
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key, default in (("checks", 0), ("drifts", 0), ("repairs", 0), ("last_clean", 0)):
            self.counts[key] = int(state.get(key, default))
        self.counts["history"] = [dict(h) for h in state.get("history", [])]


def _reference_state(io: GuardIO, named: Dict[str, torch.Tensor], src: int) -> Dict[str, Any]:
    """The reference rank's replicated tensors and optimizer state, on every rank (host tensors over the host group)."""
    host = map_tensors({"tensors": named, "optimizers": [o.state_dict() for o in io.optimizers()]},
                       lambda t, _: t.detach().to("cpu")) if distributed.get_rank() == src else None
    return distributed.broadcast_payload(host, src=src)


def _differences(differing: Dict[str, torch.Tensor], reference: Dict[str, Any], found: Mismatch
                 ) -> List[Dict[str, Any]]:
    """Every drifted rank's differing tensors against the reference's (one gather): name, rank, max |diff|, elements."""
    mine: List[Dict[str, Any]] = []
    if distributed.get_rank() in found.drifted:
        for name, t in differing.items():
            ref = reference["tensors"][name].to(t.device)
            apart = _raw_bits(t) != _raw_bits(ref)  # bit for bit, as the digests compare (-0.0 is not 0.0)
            if not bool(apart.any()):
                continue
            wide = torch.complex128 if t.is_complex() else torch.float64
            diff = (t.detach().to(wide) - ref.to(wide)).abs().max()
            mine.append({"name": name, "rank": distributed.get_rank(), "max_abs_diff": float(diff),
                         "elements": int(apart.sum())})
    return [row for rows in distributed.gather(mine) for row in rows]


def _load(io: GuardIO, named: Dict[str, torch.Tensor], reference: Dict[str, Any]) -> None:
    """This rank takes the reference's copy: every replicated tensor and the optimizers' state, copied in place."""
    with torch.no_grad():
        for name, t in named.items():
            t.copy_(reference["tensors"][name])
    for optimizer, state in zip(io.optimizers(), reference["optimizers"]):
        load_optimizer_state(optimizer, state)


def _line(iteration: int, found: Mismatch, rows: List[Dict[str, Any]], repaired: bool, clean_since: int) -> str:
    shown = "; ".join(f"{r['name']} on rank {r['rank']}: max |diff| {r['max_abs_diff']:.3g} ({r['elements']} "
                      "element(s))" for r in rows[:5]) + (f"; and {len(rows) - 5} more" if len(rows) > 5 else "")
    ranks = ", ".join(map(str, found.drifted))
    then = (f"rank {found.reference}'s model and optimizer state sent to rank(s) {ranks}; snapshots taken after iter "
            f"{clean_since} (every copy was last known the same there) dropped" if repaired else "not repaired")
    return f"NanGuard: replicas drifted apart at iter {iteration}: {shown}; {then}"
