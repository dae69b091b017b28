"""Data quarantine: a bounded skip list of dataset indices and a sampler wrapper that never yields them again.

Bad data (:data:`~..causes.Cause.DATA`) would come back every epoch; its samples go into a :class:`SkipList` (kept in
the guard's checkpoint state, and in the patched config) and the :class:`QuarantineSampler` around the loader's index
source (:class:`~..tracking.SampleTracker` puts it there) replaces them by healthy indices from then on, also after a
resume. :func:`quarantine_samples` is the remedy. Torch only: MMEngine's and MMCV 1.x's samplers are duck-typed.
"""
import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..causes import Cause
from ..samples import indices_of, resolve_indices
from ..samples import key as _key
from .base import Context, Remedy, When
from .change import Change

__all__ = ["SkipList", "QuarantineSampler", "QuarantineRefused", "quarantine_samples", "Quarantine",
           "short_samples"]

#: Samples remembered for the recurrence rule (the newest kept): far more than any run's bad samples.
_MAX_SIGHTINGS = 100000


class SkipList:
    """Dataset indices quarantined for the rest of the run, bounded so that a bug cannot hide behind it.

    Args:
        dataset_size: ``len(dataset)`` of the training set (the indices the sampler yields). 0 means unknown:
            the bound is then ``min_count`` and indices are not range-checked.
        max_fraction: at most this fraction of the dataset can be quarantined. Defaults to 0.001 (28 of
            nuScenes' 28130 training samples).
        min_count: the bound is at least this many samples, however small the dataset. Defaults to 1.
        allowance: extra room on top of the bound, for samples a config quarantines from the start (what an earlier
            run learnt: they must not use up this run's own bound). Defaults to 0.
    """

    def __init__(self, dataset_size: int, max_fraction: float = 0.001, min_count: int = 1,
                 allowance: int = 0) -> None:
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 0:
            raise ValueError(f"dataset_size must be an integer >= 0, got {dataset_size!r}")
        if (isinstance(max_fraction, bool) or not isinstance(max_fraction, (int, float))
                or not 0 <= max_fraction <= 1):
            raise ValueError(f"max_fraction must be a number in [0, 1], got {max_fraction!r}")
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 0:
            raise ValueError(f"min_count must be an integer >= 0, got {min_count!r}")
        self.dataset_size = dataset_size
        self.max_fraction = float(max_fraction)
        self.min_count = min_count
        self.allowance = max(0, int(allowance))
        self._meta: Dict[int, Dict[str, Any]] = {}

    @property
    def capacity(self) -> int:
        """How many indices the list may hold: ``allowance + max(min_count, floor(max_fraction * dataset_size))``."""
        return self.allowance + max(self.min_count, int(math.floor(self.max_fraction * self.dataset_size)))

    @property
    def full(self) -> bool:
        """True when no further index can be added."""
        return len(self._meta) >= self.capacity

    def add(self, indices: Iterable[Any], meta: Optional[Mapping[str, Any]] = None) -> bool:
        """Quarantines ``indices``, all or none.

        Args:
            indices: dataset indices (what the sampler yields).
            meta: what to remember with each new index (iteration, sample ids, incident). Defaults to None.

        Returns:
            True when every index is now quarantined (already-quarantined ones cost nothing); False, adding none,
            when the new ones would pass :attr:`capacity`: data quarantine is spent and the run is structural.

        Raises:
            ValueError: an index is not an integer in ``[0, dataset_size)``.
        """
        new = []
        for index in indices:
            key = _key(index)
            if isinstance(key, bool) or not isinstance(key, int) or key < 0 or (
                    self.dataset_size and key >= self.dataset_size):
                raise ValueError(f"dataset index must be an integer in [0, {self.dataset_size}), got {index!r}")
            if key not in self._meta and key not in new:
                new.append(key)
        if len(self._meta) + len(new) > self.capacity:
            return False
        for key in new:
            self._meta[key] = dict(meta or {})
        return True

    def meta(self, index: int) -> Dict[str, Any]:
        """What was recorded with ``index`` when it was quarantined."""
        return self._meta[_key(index)]

    def __contains__(self, index: Any) -> bool:
        return _key(index) in self._meta

    def __len__(self) -> int:
        return len(self._meta)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._meta))

    def state_dict(self) -> Dict[str, Any]:
        # String keys: a checkpoint's state also goes through JSON-minded tools.
        return {"version": 1, "indices": {str(k): dict(v) for k, v in sorted(self._meta.items())}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # The bound is this run's (the config may have changed); what was quarantined stays quarantined.
        self._meta = {int(k): dict(v) for k, v in dict(state.get("indices", {})).items()}


_HOLE = object()


class QuarantineSampler:
    """Wraps a sampler (or a batch sampler) and replaces every quarantined index by a healthy one.

    It yields exactly as many indices (batches) as the wrapped sampler, so epoch lengths, iteration counts and
    the lockstep of DDP ranks do not change, and it asks ``skip`` at yield time, so indices quarantined mid-epoch
    take effect from the next index the loader requests (a loader's workers may already hold a few prefetched
    batches). Any other attribute (``set_epoch``, ``epoch``, ``seed``, ``dataset``, ...) is the wrapped
    sampler's: MMEngine's ``DefaultSampler`` / ``InfiniteSampler``, MMCV 1.x's ``GroupSampler`` /
    ``DistributedGroupSampler`` / ``DistributedSampler``, torch's samplers.

    The substitute, deterministic and rank-local: the previous healthy index this sampler yielded in the same
    position (for a batch sampler, the same slot of the batch), else, at the start, the first healthy index that
    position yields next (the batch waits for it; after 16 waiting batches, any healthy index seen).

    StreamPETR's sequential data: with a scene-ordered sampler (MMCV 1.x ``GroupSampler`` without shuffle, or
    StreamPETR's ``InfiniteGroupEachSampleInBatchSampler``, where slot *j* of every batch walks one scene frame
    by frame), a quarantined frame is replaced by the previous frame of the same scene (the same slot), so only
    that frame is dropped: the rest of the scene trains as before, in order, and the memory queue sees the
    preceding frame twice (a zero time step, as at a stationary ego vehicle). A quarantined first frame of a
    slot is replaced by that slot's next frame. Quarantining whole scenes is a choice left to the caller: add
    every index of the scene (:func:`resolve_indices` with the ``scene_token``).

    Args:
        sampler: the wrapped sampler or batch sampler (an iterable of indices, or of lists of indices), or an
            iterator already under way (a loader's live index stream).
        skip: the quarantined indices (:class:`SkipList` or any container of ints).
        on_pass: called with no argument as each pass over ``sampler`` starts (a new epoch's iterator). Defaults
            to None.
        on_yield: called with each item as it is yielded (what the loader fetches). Defaults to None.
    """

    _MAX_WAIT = 16

    def __init__(self, sampler: Any, skip: Any, on_pass: Optional[Callable[[], None]] = None,
                 on_yield: Optional[Callable[[Any], None]] = None) -> None:
        self.wrapped = sampler
        self.skip = skip
        self.replaced = 0
        self.on_pass = on_pass
        self.on_yield = on_yield

    def __getattr__(self, name: str) -> Any:
        if name in ("wrapped", "skip", "replaced", "on_pass", "on_yield") or name.startswith("__"):
            raise AttributeError(name)  # not set yet (unpickling): never recurse into the wrapped sampler
        return getattr(self.wrapped, name)

    def __getstate__(self) -> Dict[str, Any]:
        # The callbacks belong to this process's tracker (a loader's workers pickle their sampler on spawn).
        return dict(self.__dict__, on_pass=None, on_yield=None)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __len__(self) -> int:
        return len(self.wrapped)

    def _bad(self, index: Any) -> bool:
        return _key(index) in self.skip

    def __iter__(self) -> Iterator[Any]:
        if self.on_pass is not None:
            self.on_pass()
        for item in self._substituted():
            if self.on_yield is not None:
                self.on_yield(item)
            yield item

    def _substituted(self) -> Iterator[Any]:
        last: Dict[int, Any] = {}
        queue: List[Tuple[bool, List[Any]]] = []
        seen = 0
        for item in self.wrapped:
            is_batch = isinstance(item, list)
            indices = item if is_batch else [item]
            seen += len(indices)
            out = []
            for slot, index in enumerate(indices):
                if not self._bad(index):
                    if slot not in last:  # this position's first healthy index fills its waiting holes
                        for _, waiting in queue:
                            if slot < len(waiting) and waiting[slot] is _HOLE:
                                waiting[slot] = index
                                self.replaced += 1
                    last[slot] = index
                    out.append(index)
                elif slot in last:
                    out.append(last[slot])
                    self.replaced += 1
                else:
                    out.append(_HOLE)
            queue.append((is_batch, out))
            if len(queue) > self._MAX_WAIT and last:
                self._fill(queue, next(iter(last.values())))
            while queue and not any(x is _HOLE for x in queue[0][1]):
                batch, done = queue.pop(0)
                yield done if batch else done[0]
        if queue:
            if not last:
                raise RuntimeError(f"all {seen} indices this sampler yielded are quarantined: nothing healthy to "
                                   "train on (the skip list should have stopped the run as structural first)")
            self._fill(queue, next(iter(last.values())))
            for batch, done in queue:
                yield done if batch else done[0]

    def _fill(self, queue: List[Tuple[bool, List[Any]]], index: Any) -> None:
        for _, waiting in queue:
            for i, value in enumerate(waiting):
                if value is _HOLE:
                    waiting[i] = index
                    self.replaced += 1


class QuarantineRefused(ValueError):
    """Quarantining the samples would pass the skip list's bound: nothing was added."""


def quarantine_samples(skip: SkipList, indices: Iterable[int],
                       meta: Optional[Mapping[str, Any]] = None) -> List[Change]:
    """The quarantine remedy: ``indices`` join ``skip`` (all or none) and the sampler never yields them again.

    Returns:
        ``[Change('quarantine.samples', count before, count after)]``.

    Raises:
        QuarantineRefused: the new indices would pass ``skip.capacity`` (none is added).
    """
    indices = list(indices)
    before = len(skip)
    if not skip.add(indices, meta):
        raise QuarantineRefused(f"quarantining {indices} would pass the bound of {skip.capacity} sample(s)")
    return [Change("quarantine.samples", before, len(skip))]



def short_samples(samples: List[Dict[str, Any]], limit: int = 4) -> str:
    """``(index=3, token=a), (index=9)`` and how many more: samples as one log line names them."""
    shown = ", ".join(", ".join(f"{k}={v}" for k, v in s.items()).join("()") for s in samples[:limit])
    return shown + (f" and {len(samples) - limit} more" if len(samples) > limit else "")


class Quarantine(Remedy):
    """Data: the broken batch's samples (by dataset index) are never served again, within
    ``quarantine_fraction``; a sample that made steps go wrong in two epochs too (``quarantine_recurring``). The
    skip list and the sightings ride in the checkpoint; ``quarantine`` pins indices from the start."""

    name = "quarantine"
    causes = (Cause.DATA,)
    when = When.BEFORE_RESTORE
    section = "policy"
    state_keys = ("skip", "sightings")
    fixes = (("quarantine", "quarantined"),)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.skip: Optional[SkipList] = None
        #: Dataset index -> the (at most two) epochs in which it made a step go wrong.
        self.sightings: Dict[int, List[int]] = {}

    def skip_list(self, io: Any) -> Any:
        """The quarantine the training loader's sampler honours, sized for its dataset (once the loader exists):
        a :class:`SkipList` carrying a resumed run's quarantine and the ``quarantine`` argument, or an empty set where
        the quarantine is off."""
        if not self.enabled:
            return set()
        pinned = list(self.config.quarantine)
        skip = SkipList(io.dataset_size(), max_fraction=self.config.quarantine_fraction, allowance=len(pinned))
        if self.skip is not None:
            skip.load_state_dict(self.skip.state_dict())
            if len(skip):
                io.log(f"NanGuard: resumed quarantine of {len(skip)} sample(s): dataset indices {list(skip)}")
        if pinned:
            skip.add(pinned, {"from": "quarantine"})
            io.log(f"NanGuard: {len(pinned)} sample(s) quarantined from the start (quarantine): dataset indices "
                   f"{pinned}")
        self.skip = skip
        return skip

    def apply(self, ctx: Context) -> List[Change]:
        c, ids = ctx.cls, ctx.ids
        indices = sorted(set(resolve_indices(ctx.io.dataset(), ids))) if ids else []
        if not self.enabled or self.skip is None or not indices:
            # Nothing to name: the batch goes by; hyperparameters were never the problem.
            c.evidence += f"; its samples cannot be named ({self._unnamed(ids)}): nothing quarantined"
            return []
        try:
            changes = quarantine_samples(self.skip, indices, {"iteration": c.signals.get("iteration")})
        except QuarantineRefused as exc:
            c.signals["refused"] = list(ids)
            if self.skip.full:  # earlier incidents took the whole bound: too much bad data to be data
                ctx.history.mark_spent(Cause.DATA, f"the skip list is full ({self.skip.capacity} samples)")
                c.signals["evidence_cause"] = Cause.DATA.value
                c.cause = Cause.STRUCTURAL
                c.evidence += f"; {exc}, and the list is full"
            else:  # the batch is larger than the room left: skipped, nothing quarantined (a second one: structural)
                c.evidence += f"; {exc}: nothing quarantined, the batch is skipped"
            return []
        c.signals["quarantined"] = list(ids)
        return changes

    def _unnamed(self, ids: Sequence[Dict[str, Any]]) -> str:
        if not self.enabled or self.skip is None:
            return "the quarantine is off"
        if ids:
            carried = sorted({k for i in ids for k in i if k != "rank"})
            return f"the ids it carries ({', '.join(carried)}) name no single dataset index"
        return "no dataset indices known and no sample ids in the batch"

    def sighted(self, indices: Sequence[int], epoch: int) -> List[int]:
        """Remembers that these samples made a step go wrong in ``epoch``; returns those now seen in two different
        epochs and not yet quarantined (``quarantine_recurring``)."""
        recurring = []
        for index in indices:
            epochs = self.sightings.setdefault(int(index), [])
            if epoch not in epochs:
                epochs.append(epoch)
                del epochs[:-2]  # two epochs decide
            quarantined = self.skip is not None and index in self.skip
            if len(epochs) >= 2 and not quarantined and self.config.quarantine_recurring:
                recurring.append(int(index))
        while len(self.sightings) > _MAX_SIGHTINGS:  # oldest first (dicts keep insertion order)
            self.sightings.pop(next(iter(self.sightings)))
        return recurring

    def recurring(self, ctx: Context, named: List[Dict[str, Any]], epoch: int) -> Optional[Tuple[List[Change],
                                                                                                List[Dict[str, Any]],
                                                                                                str]]:
        """Samples named by a step that went wrong: those seen in two epochs are quarantined (within the bound) and
        named in one log line. Returns (changes, samples, reason) for their record, or None when none recurred."""
        if not named:
            return None
        recurring = self.sighted(indices_of(named, ctx.io.dataset()), epoch)
        if not recurring:
            return None
        changes, why = self._take(recurring, ctx.iteration)
        samples = [s for s in named if s.get("index") in recurring] or [{"index": i} for i in recurring]
        epochs = sorted({e for i in recurring for e in self.sightings.get(i, [])})
        reason = f"made steps go wrong in epochs {epochs}" + ("" if changes else f"; not quarantined: {why}")
        ctx.io.log(f"NanGuard: sample(s) {short_samples(samples)} {reason}"
                   + ("; quarantined for the rest of the run" if changes else ""), "warning")
        return changes, samples, reason

    def _take(self, indices: List[int], iteration: int) -> Tuple[List[Change], str]:
        if not self.enabled:
            return [], "the quarantine remedy is off"
        if self.skip is None:
            return [], "no training loader to quarantine through"
        try:
            return quarantine_samples(self.skip, indices, {"iteration": iteration, "recurring": True}), ""
        except QuarantineRefused as exc:
            return [], str(exc)

    def state_dict(self) -> Dict[str, Any]:
        return {"skip": None if self.skip is None else self.skip.state_dict(),
                "sightings": {str(k): list(v) for k, v in self.sightings.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("skip"):
            # The bound is this run's, set once the loader (and its dataset's size) is known: skip_list.
            self.skip = SkipList(0, max_fraction=self.config.quarantine_fraction)
            self.skip.load_state_dict(state["skip"])
        self.sightings = {int(k): [int(e) for e in v] for k, v in dict(state.get("sightings", {})).items()}

    def summary(self, io: Any) -> Dict[str, Any]:
        return {"quarantined": [] if self.skip is None else list(self.skip)}
