"""Data quarantine: a bounded skip list of dataset indices and a sampler wrapper that never yields them again.

Bad data (:data:`~..causes.Cause.DATA`) would come back every epoch; its samples go into a :class:`SkipList` (kept in
the guard's checkpoint state, and in the patched config) and the :class:`QuarantineSampler` around the loader's index
source (:class:`~..tracking.SampleTracker` puts it there) replaces them by healthy indices from then on, also after a
resume. :class:`Quarantine` is the remedy. Torch only: MMEngine's and MMCV 1.x's samplers are duck-typed.
"""
import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..causes import Cause
from ..samples import key as _key
from ..samples import resolve_indices
from ..validate import Setting, check_indices, check_list, check_number, is_bool
from ..wrappers import describe, identity, indices_serving, resolve, sample_of, wraps
from .base import Change, ConfigEntry, Incident, Outcome, Remedy, Run

__all__ = ["SkipList", "QuarantineSampler", "Quarantine", "short_samples", "bad_data_advice"]

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
        #: Sample -> the indices it is served under (a resampling wrapper serves one sample under many): the bound
        #: counts samples. An index added alone is its own sample.
        self._samples: Dict[str, List[int]] = {}

    @property
    def capacity(self) -> int:
        """How many indices the list may hold: ``allowance + max(min_count, floor(max_fraction * dataset_size))``."""
        return self.allowance + max(self.min_count, int(math.floor(self.max_fraction * self.dataset_size)))

    @property
    def full(self) -> bool:
        """True when no further sample can be added."""
        return len(self._samples) >= self.capacity

    @property
    def samples(self) -> int:
        """How many samples are quarantined (each under one index or more)."""
        return len(self._samples)

    def has_sample(self, sample: str) -> bool:
        """Whether the sample named ``sample`` (:func:`~..wrappers.sample_of`'s key, or its ids) is quarantined."""
        return sample in self._samples

    def indices_of(self, sample: str) -> List[int]:
        """The indices ``sample`` is quarantined under (none when it is not)."""
        return list(self._samples.get(sample, []))

    def by_sample(self) -> Dict[str, List[int]]:
        """Every quarantined sample and the indices it is quarantined under."""
        return {k: list(v) for k, v in self._samples.items()}

    def add(self, indices: Iterable[Any], meta: Optional[Mapping[str, Any]] = None,
            sample: Optional[str] = None) -> bool:
        """Quarantines ``indices``, all or none.

        Args:
            indices: dataset indices (what the sampler yields).
            meta: what to remember with each new index (iteration, sample ids, incident). Defaults to None.
            sample: the one sample all of ``indices`` serve (a resampling wrapper's copies of it); None: each index
                is a sample of its own. Defaults to None.

        Returns:
            True when every index is now quarantined (already-quarantined samples cost nothing, and neither do new
            indices of one); False, adding none, when the new samples would pass :attr:`capacity`.

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
        groups = {sample: new} if sample is not None else {f"index:{k}": [k] for k in new}
        fresh = [name for name in groups if name not in self._samples]
        if len(self._samples) + len(fresh) > self.capacity:
            return False
        for name, keys in groups.items():
            self._samples.setdefault(name, []).extend(keys)
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
        return {"version": 2, "indices": {str(k): dict(v) for k, v in sorted(self._meta.items())},
                "samples": self.by_sample()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # The bound is this run's (the config may have changed); what was quarantined stays quarantined.
        self._meta = {int(k): dict(v) for k, v in dict(state.get("indices", {})).items()}
        samples = state.get("samples")  # version 1 (before samples): each index its own sample
        self._samples = ({str(k): [int(i) for i in v] for k, v in dict(samples).items()} if samples is not None
                         else {f"index:{k}": [k] for k in self._meta})


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
                else:
                    substitute = self._healthy_substitute(last, slot)
                    out.append(_HOLE if substitute is None else substitute)
                    self.replaced += substitute is not None
            queue.append((is_batch, out))
            anyone = self._healthy_substitute(last, -1) if len(queue) > self._MAX_WAIT else None
            if anyone is not None:
                self._fill(queue, anyone)
            while queue and not any(x is _HOLE for x in queue[0][1]):
                batch, done = queue.pop(0)
                yield done if batch else done[0]
        if queue:
            anyone = self._healthy_substitute(last, -1)
            if anyone is None:
                raise RuntimeError(f"all {seen} indices this sampler yielded are quarantined: nothing healthy to "
                                   "train on (the skip list should have stopped the run as structural first)")
            self._fill(queue, anyone)
            for batch, done in queue:
                yield done if batch else done[0]

    def _healthy_substitute(self, last: Dict[int, Any], slot: int) -> Any:
        """The slot's previous index, unless it was quarantined since it was yielded (then another slot's, still
        healthy); None when none is."""
        if slot in last and not self._bad(last[slot]):
            return last[slot]
        if slot >= 0 and slot not in last:
            return None  # the slot's own first healthy index fills it (a frame of its own scene)
        for index in reversed(list(last.values())):
            if not self._bad(index):
                return index
        return None

    def _fill(self, queue: List[Tuple[bool, List[Any]]], index: Any) -> None:
        for _, waiting in queue:
            for i, value in enumerate(waiting):
                if value is _HOLE:
                    waiting[i] = index
                    self.replaced += 1


def short_samples(samples: List[Dict[str, Any]], limit: int = 4) -> str:
    """``(index=3, token=a), (index=9)`` and how many more: samples as one log line names them."""
    hidden = ("dataset", "served_as", "evidence")
    shown = ", ".join(", ".join(f"{k}={v}" for k, v in s.items() if k not in hidden).join("()")
                      for s in samples[:limit])
    return shown + (f" and {len(samples) - limit} more" if len(samples) > limit else "")


def bad_data_advice(every: List[Dict[str, Any]]) -> str:
    """What a :class:`~..errors.BadDataError` says after its evidence: every bad sample found and what to do."""
    return (f"Every bad sample found ({len(every)}): {short_samples(every, 32)}. Start the next run from the patched "
            "config (nan_guard_patched_config.py: its quarantine=[...] keeps them all out), fix or drop these "
            "samples, or raise quarantine_fraction")


def _pinned(name: str, value: Any) -> Tuple[Any, ...]:
    """Dataset indices (ints: this run's own, as patched configs wrote them before identities) and identities (what a
    sample is: ``inner_index`` with its leaf ``dataset`` / ``part``, and ids: ``token``, ``sample_idx``)."""
    entries = check_list(name, value)
    ints = check_indices(name, [e for e in entries if not isinstance(e, Mapping)])
    whos: List[Dict[str, Any]] = []
    for entry in entries:
        if not isinstance(entry, Mapping):
            continue
        if not any(entry.get(k) is not None for k in ("inner_index", "token", "sample_idx", "index")):
            raise ValueError(f"{name}: an identity needs inner_index, token, sample_idx or index, got {dict(entry)!r}")
        if dict(entry) not in whos:
            whos.append(dict(entry))
    return tuple(ints) + tuple(whos)


def _fraction(name: str, value: Any) -> float:
    number = check_number(name, value, above=0.0)
    if number > 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return number


class Quarantine(Remedy):
    """Data: the samples evidence names (their own non-finite values, a replay on the healthy state that isolates
    them, the window trace) are never served again, under any index that serves them (a resampling wrapper's copies
    included), within ``quarantine_fraction`` of the dataset's samples; a sample evidence names at two skipped steps
    too (two epochs, or two indices: ``quarantine_recurring``). A sample the bound refuses is named in the record as
    refused and its batch skipped; when a refused sample breaks the run again, the run stops with
    :class:`~..errors.BadDataError`, naming every bad sample found (the patched config quarantines them all). The
    skip list, the sightings and the refused samples ride in the checkpoint; ``quarantine`` pins indices from the
    start."""

    name = "quarantine"
    label = "quarantine"
    causes = (Cause.DATA,)
    settings = (
        Setting("quarantine_fraction", 0.001, _fraction, "at most this fraction of the dataset's "
                "samples is quarantined as bad data (at least one); a batch past it is refused and skipped, and "
                "refused samples that break the run again stop it with ``BadDataError``."),
        Setting("quarantine", (), _pinned, "samples never served, from the start: what an earlier run quarantined, as "
                "its patched config carries it, each by what it is (``dict(dataset=..., inner_index=..., token=...)``: "
                "resolved through this run's own dataset wrappers, whatever its seed, CBGS table or batch size) or, as "
                "older patched configs wrote, by dataset index; they do not use up this run's "
                "``quarantine_fraction``.", start=True),
        Setting("quarantine_recurring", True, is_bool, "a sample evidence names at skipped steps (an fp32 step "
                "skipped, an fp16 step whose forward is non-finite) in two different epochs, or under two indices, "
                "is quarantined within ``quarantine_fraction``."),
    )
    state = ("skip", "sightings", "refused_samples", "identities")
    section = "policy"
    idle = {"quarantined": [], "refused": [], "bad_samples": []}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        #: The skip list as the checkpoint holds it (:meth:`SkipList.state_dict`; None while empty).
        self.skip: Optional[Dict[str, Any]] = None
        #: Sample -> the (at most two) [epoch, dataset index] at which evidence named it at a skipped step.
        self.sightings: Dict[str, List[List[int]]] = {}
        #: Sample -> how its record named it, for the samples the bound refused.
        self.refused_samples: Dict[str, Dict[str, Any]] = {}
        #: Quarantined sample -> what it is (:func:`~..wrappers.identity`): what a resume, and the next run from the
        #: patched config, resolve through their own dataset wrappers.
        self.identities: Dict[str, Dict[str, Any]] = {}
        #: The live skip list the training loader's sampler honours (from :attr:`When.ATTACH` on).
        self.skip_list: Optional[SkipList] = None

    def on_attach(self, run: Run) -> Outcome:
        return Outcome(exclude=self._attach(run.io))

    def on_skipped(self, run: Run, incident: Incident) -> Outcome:
        return self._recurring(run.io, incident)

    def before_restore(self, run: Run, incident: Incident) -> Outcome:
        if self.skip_list is None:
            return Outcome(evidence="; no training loader to quarantine through: nothing quarantined")
        return self._incident(run.io, incident)

    def on_spent(self, run: Run, incident: Incident) -> Outcome:
        return Outcome(signals={"bad_data": self.spent(run.io.dataset(), incident.samples)})

    def _attach(self, io: Any) -> SkipList:
        """The quarantine the training loader's sampler honours, sized for its dataset: a resumed run's quarantine and
        the ``quarantine`` argument, each sample resolved through this run's dataset wrappers by what it is (its
        identity: another seed draws another CBGS table), before the first batch."""
        dataset, pinned = io.dataset(), list(self.config.quarantine)
        skip = SkipList(io.dataset_size(), max_fraction=self.config.quarantine_fraction, allowance=len(pinned))
        if self.skip:
            old = SkipList(0)
            old.load_state_dict(self.skip)
            for key, indices in old.by_sample().items():
                who = self.identities.get(key)
                now = resolve(dataset, who) if who and dataset is not None else indices
                if now:
                    skip.add(now, old.meta(indices[0]) if indices else {}, sample=key)
            io.log(f"NanGuard: resumed quarantine of {skip.samples} sample(s): dataset indices {list(skip)}")
        for who in pinned:
            self._pin(io, dataset, skip, who)
        if pinned:
            io.log(f"NanGuard: {len(pinned)} sample(s) quarantined from the start (quarantine): dataset indices "
                   f"{list(skip)}")
        self.skip_list = skip
        self._sync()
        return skip

    def _pin(self, io: Any, dataset: Any, skip: SkipList, who: Any) -> None:
        """One entry of ``quarantine``: an index of this dataset, or an identity resolved through its wrappers."""
        if not isinstance(who, Mapping):
            skip.add([who], {"from": "quarantine"})
            return
        indices = resolve(dataset, who) if dataset is not None else []
        if not indices:
            io.log(f"NanGuard: quarantine: {short_samples([dict(who)])} is no sample of this run's dataset; nothing "
                   "kept out for it", "warning")
            return
        ids = {k: who[k] for k in ("token", "sample_idx") if who.get(k) is not None}
        key, serving, _ = self._identify(dataset, dict(ids, index=indices[0]))
        skip.add(serving, {"from": "quarantine"}, sample=key)
        self.identities[key] = dict(who)

    def _sync(self) -> None:
        self.skip = self.skip_list.state_dict() if self.skip_list is not None and len(self.skip_list) else None

    # ------------------------------------------------------------------ naming samples by what they are
    def identify(self, dataset: Any, named: Sequence[Mapping[str, Any]]
                 ) -> List[Tuple[str, List[int], Dict[str, Any]]]:
        """(sample, every dataset index serving it, how the record names it) for each distinct sample of ``named``.

        A sample is known by where it lives (through the dataset wrappers, :func:`~..wrappers.sample_of`), else, past
        a wrapper not known here, by the ids the data carries (``token``, ``sample_idx``), else by its index alone.
        """
        out: List[Tuple[str, List[int], Dict[str, Any]]] = []
        seen = set()
        for sample in named:
            found = self._identify(dataset, dict(sample))
            if found is not None and found[0] not in seen:
                seen.add(found[0])
                out.append(found)
        return out

    def _identify(self, dataset: Any, sample: Dict[str, Any]) -> Optional[Tuple[str, List[int], Dict[str, Any]]]:
        found = _name_sample(dataset, sample, self._indices_of)
        if found is not None and dataset is not None and found[0] not in self.identities:
            # What the next run resolves through its own wrappers (another seed, another table): kept for the samples
            # named bad, quarantined or refused.
            self.identities[found[0]] = identity(dataset, found[2]["index"])
        return found

    def _indices_of(self, key: str) -> List[int]:
        known = self.refused_samples.get(key, {}).get("served_as", [])
        return list(known) + (self.skip_list.indices_of(key) if self.skip_list is not None else [])

    # ------------------------------------------------------------------ a data incident
    def _incident(self, io: Any, incident: Incident) -> Outcome:
        found = self.identify(io.dataset(), incident.samples) if incident.samples else []
        if not found:
            # Nothing to name: the batch goes by; hyperparameters were never the problem.
            return Outcome(evidence=f"; no sample is named by evidence of its own ({self._unnamed(incident.samples)}): "
                                    "nothing quarantined")
        back = [named for key, _, named in found if key in self.refused_samples]
        if back:
            return Outcome(evidence=f"; {short_samples(back)}, refused by the quarantine's bound of "
                                    f"{self.skip_list.capacity} sample(s) before, broke the run again: a data "
                                    "problem, not a bug", signals={"bad_data": self.bad_samples(found)})
        before = self.skip_list.samples
        taken, refused = self._take_all(found, {"iteration": incident.iteration})
        signals: Dict[str, Any] = {"quarantined": taken, "stored": self._stored(found, taken)} if taken else {}
        evidence = ""
        if refused:
            signals["refused"] = refused
            evidence = (f"; quarantining {short_samples(refused)} would pass the bound of {self.skip_list.capacity} "
                        "sample(s) (quarantine_fraction): refused, not quarantined; the batch is skipped")
        changes = (Change("quarantine.samples", before, self.skip_list.samples),) if taken else ()
        return Outcome(changes, evidence, signals)

    def _take_all(self, found: List[Tuple[str, List[int], Dict[str, Any]]],
                  meta: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
        taken, refused = [], []
        skip = self.skip_list
        fresh = [key for key, _, _ in found if not skip.has_sample(key)]
        fits = skip.samples + len(fresh) <= skip.capacity  # all of a batch's samples, or none of them
        for key, indices, named in found:
            if fits and skip.add(indices, dict(meta, sample=key), sample=key):
                taken.append(named)
                self.refused_samples.pop(key, None)
            else:
                refused.append(named)
                self.refused_samples[key] = _served(named, indices)
        self._sync()
        return taken, refused

    def _stored(self, found: Sequence[Tuple[str, List[int], Dict[str, Any]]],
                taken: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """For each sample of ``taken`` (in order), the identity stored for the next run (:attr:`identities`)."""
        by_named = [(named, key) for key, _, named in found]
        return [dict(self.identities.get(next((k for n, k in by_named if n is s), ""), {"index": s.get("index")}))
                for s in taken]

    def spent(self, dataset: Any, ids: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        """The recovery budget is spent on bad data: the samples of ``ids`` not quarantined are remembered as refused
        (the patched config names them too); returns every bad sample found."""
        found = self.identify(dataset, ids)
        for key, indices, named in found:
            if self.skip_list is None or not self.skip_list.has_sample(key):
                self.refused_samples[key] = _served(named, indices)
        return self.bad_samples(found)

    def bad_samples(self, found: Sequence[Tuple[str, List[int], Dict[str, Any]]] = ()) -> List[Dict[str, Any]]:
        """Every bad sample this run found, as records name them: quarantined, refused, and ``found``."""
        return list(self._bad(found).values())

    def _bad(self, found: Sequence[Tuple[str, List[int], Dict[str, Any]]] = ()) -> Dict[str, Dict[str, Any]]:
        out: Dict[str, Dict[str, Any]] = {}
        if self.skip_list is not None:
            for key, indices in self.skip_list.by_sample().items():
                first = self.skip_list.meta(indices[0]) if indices else {}
                out[key] = {"index": indices[0], "served_as": sorted(indices)} if len(indices) > 1 else \
                    {"index": indices[0]}
                if first.get("from"):
                    out[key]["from"] = first["from"]
        out.update({k: dict(v) for k, v in self.refused_samples.items()})
        out.update({k: _served(named, indices) for k, indices, named in found})
        return out

    def _unnamed(self, ids: Sequence[Mapping[str, Any]]) -> str:
        if ids:
            carried = sorted({k for i in ids for k in i if k != "rank"})
            return f"the ids it carries ({', '.join(carried)}) name no single dataset index"
        return "no sample of the batch was isolated by its own values or a replay, or none can be named"

    # ------------------------------------------------------------------ samples named at two skipped steps
    def sighted(self, found: Mapping[str, Tuple[List[int], Dict[str, Any]]], epoch: int) -> List[str]:
        """Remembers that evidence named these samples at a skipped step in ``epoch``; returns those now named twice,
        in two different epochs or under two different indices (a resampling wrapper serves it again in the same
        pass), and not yet quarantined (``quarantine_recurring``)."""
        recurring = []
        for key, (_, named) in found.items():
            seen = self.sightings.setdefault(key, [])
            mark = [int(epoch), int(named.get("index", -1))]
            if mark not in seen:
                seen.append(mark)
                del seen[:-2]  # two sightings decide
            quarantined = self.skip_list is not None and self.skip_list.has_sample(key)
            if len(seen) >= 2 and not quarantined and self.config.quarantine_recurring:
                recurring.append(key)
        while len(self.sightings) > _MAX_SIGHTINGS:  # oldest first (dicts keep insertion order)
            self.sightings.pop(next(iter(self.sightings)))
        return recurring

    def _recurring(self, io: Any, incident: Incident) -> Outcome:
        """Samples evidence named at a skipped step: those named twice are quarantined (within the bound); a sample
        the bound refused before among them stops the run (``bad_data``)."""
        found = {key: (indices, sample) for key, indices, sample in self.identify(io.dataset(), incident.samples)}
        recurring = self.sighted(found, incident.epoch)
        if not recurring:
            return Outcome()
        epochs = sorted({e for k in recurring for e, _ in self.sightings.get(k, [])})
        chosen = [(k, found[k][0], found[k][1]) for k in recurring]
        if self.skip_list is None:
            return Outcome(signals={"recurring": [found[k][1] for k in recurring], "quarantined": [],
                                    "reason": f"made steps go wrong in epochs {epochs}; not quarantined: no training "
                                              "loader to quarantine through"})
        back = [found[k][1] for k in recurring if k in self.refused_samples]
        if back:
            return Outcome(evidence=f"; {short_samples(back, 8)}, refused by the quarantine's bound of "
                                    f"{self.skip_list.capacity} sample(s) (quarantine_fraction="
                                    f"{self.config.quarantine_fraction}), broke the run again",
                           signals={"bad_data": self.bad_samples(chosen)})
        before = self.skip_list.samples
        taken, refused = self._take_all(chosen, {"iteration": incident.iteration, "recurring": True})
        reason = (f"made steps go wrong in epochs {epochs}" if len(epochs) > 1 else
                  f"made steps go wrong twice in epoch {epochs[0]}, under dataset indices "
                  f"{sorted({i for k in recurring for _, i in self.sightings.get(k, [])})}")
        if refused:
            reason += (f"; {short_samples(refused)} refused by the quarantine's bound of {self.skip_list.capacity} "
                       "sample(s) (quarantine_fraction): not quarantined")
        io.log(f"NanGuard: sample(s) {short_samples(taken + refused)} {reason}"
                   + ("; quarantined for the rest of the run" if taken else ""), "warning")
        changes = (Change("quarantine.samples", before, self.skip_list.samples),) if taken else ()
        signals: Dict[str, Any] = {"recurring": taken + refused, "reason": reason, "quarantined": taken,
                                   "stored": self._stored(chosen, taken)}
        if refused:
            signals["refused"] = refused
        return Outcome(changes, f"; {short_samples(taken + refused)} {reason}", signals)

    # ------------------------------------------------------------------ state and what it put in force
    def load_value(self, key: str, value: Any) -> Any:
        if key == "skip":
            return dict(value) if value else None
        if key == "sightings":
            sightings = {}
            for k, v in dict(value or {}).items():
                if str(k).isdigit():  # before samples were named by what they are: dataset index -> epochs
                    sightings[f"index:{k}"] = [[int(e), int(k)] for e in v]
                else:
                    sightings[str(k)] = [[int(e), int(i)] for e, i in v]
            return sightings
        return {str(k): dict(v) for k, v in dict(value or {}).items()}  # refused_samples, identities

    def summary(self, io: Any) -> Dict[str, Any]:
        quarantined = [] if self.skip_list is None else list(self.skip_list)
        if self.skip_list is None and self.skip:
            quarantined = sorted(int(i) for i in self.skip.get("indices", {}))
        refused = sorted({int(i) for v in self.refused_samples.values()
                          for i in v.get("served_as", [v.get("index")]) if i is not None})
        return {"quarantined": quarantined, "refused": refused,
                "bad_samples": sorted(set(quarantined) | set(refused))}

    def config_entry(self, io: Any) -> ConfigEntry:
        """Every bad sample, quarantined or refused, by what it is (its identity, resolved by the next run through its
        own wrappers), or by its index where nothing more is known of it."""
        entries: List[Any] = []
        for key, sample in self._bad().items():
            who = self.identities.get(key) or ({"index": sample["index"]} if "index" in sample else None)
            if who is None:
                continue
            entry = int(who["index"]) if set(who) == {"index"} else dict(who)
            if entry not in entries:
                entries.append(entry)
        return ConfigEntry(fix={"quarantine": entries} if entries else {})


def _name_sample(dataset: Any, sample: Dict[str, Any], known: Callable[[str], List[int]]
                 ) -> Optional[Tuple[str, List[int], Dict[str, Any]]]:
    """(sample key, every dataset index serving it, how the record names it) for one sample a record names; ``known``
    gives the indices already seen serving a key (a sample known by its ids alone)."""
    index = sample.get("index")
    ids = {k: sample[k] for k in ("token", "sample_idx") if sample.get(k) is not None}
    if index is None:
        indices = resolve_indices(dataset, [sample]) if ids else []
        if not indices:
            return None
        index = indices[0]
    index = int(index)
    try:
        where = sample_of(dataset, index) if dataset is not None else None
    except Exception:  # noqa: BLE001 (naming is evidence only: an index a wrapper cannot map names itself)
        where = None
    if where is not None and where.known and wraps(dataset):
        key, indices = f"sample:{where.key}", indices_serving(dataset, index)
    elif ids:  # past a wrapper of the user's own: the ids the data carries say which sample it is
        key = "ids:" + ",".join(f"{k}={v}" for k, v in sorted(ids.items()))
        indices = sorted({index} | set(resolve_indices(dataset, [ids])) | set(known(key)))
    else:
        key, indices = f"index:{index}", [index]
    named = dict(sample, index=index)
    if wraps(dataset):
        named.update(describe(dataset, indices))
    return key, indices, named


def _served(named: Dict[str, Any], indices: Sequence[int]) -> Dict[str, Any]:
    """How a record names a bad sample with every index it is served under."""
    return dict(named, served_as=sorted(set(indices)))
