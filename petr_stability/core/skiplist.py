"""The quarantine's bookkeeping, apart from its policy (:class:`~.remedies.quarantine.Quarantine`): a bounded skip list
of dataset indices, the sampler wrapper that never yields them again, the ledger of the run's bad samples by what each
is (:class:`SampleLedger`), and how a log line names samples.

A sample the quarantine takes goes into a :class:`SkipList` (kept in the guard's checkpoint state, and in the patched
config); the :class:`QuarantineSampler` around the loader's index source (:class:`~.tracking.SampleTracker` puts it
there) replaces its indices by healthy ones from then on, also after a resume. Torch only: MMEngine's and MMCV 1.x's
samplers are duck-typed.
"""
import math
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from .samples import key as _key
from .samples import resolve_indices
from .wrappers import describe, identity, indices_serving, sample_of, wraps

__all__ = ["SkipList", "QuarantineSampler", "SampleLedger", "short_samples", "bad_data_advice"]


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


#: Samples remembered for the recurrence rule (the newest kept): far more than any run's bad samples.
_MAX_SIGHTINGS = 100000

#: One sample as the ledger finds it: (its key, every dataset index serving it, how the record names it).
Found = Tuple[str, List[int], Dict[str, Any]]


class SampleLedger:
    """The bad samples of a run, by what each is: the skip list the sampler honours (:attr:`skip_list`, from the
    moment the loader exists), the samples the bound refused, each bad sample's identity (what the next run resolves
    through its own wrappers) and the skipped steps at which evidence named a sample. The quarantine remedy decides
    what goes in; this keeps the books.

    Args:
        holder: where the books' three dicts live (the remedy, whose checkpoint state they are, loaded in place):
            ``sightings`` (sample -> the at most two [epoch, dataset index] at which evidence named it at a skipped
            step), ``refused_samples`` (sample -> how its record named it, for the samples the bound refused) and
            ``identities`` (bad sample -> what it is, :func:`~.wrappers.identity`: what a resume, and the next run
            from the patched config, resolve through their own dataset wrappers). None: the ledger's own.
    """

    def __init__(self, holder: Any = None) -> None:
        #: The live skip list (None until the loader exists).
        self.skip_list: Optional[SkipList] = None
        if holder is None:
            holder = SimpleNamespace(sightings={}, refused_samples={}, identities={})
        self.holder = holder

    @property
    def sightings(self) -> Dict[str, List[List[int]]]:
        return self.holder.sightings

    @property
    def refused_samples(self) -> Dict[str, Dict[str, Any]]:
        return self.holder.refused_samples

    @property
    def identities(self) -> Dict[str, Dict[str, Any]]:
        return self.holder.identities

    # ------------------------------------------------------------------ naming samples by what they are
    def identify(self, dataset: Any, named: Sequence[Mapping[str, Any]]) -> List[Found]:
        """(sample, every dataset index serving it, how the record names it) for each distinct sample of ``named``.

        A sample is known by where it lives (through the dataset wrappers, :func:`~.wrappers.sample_of`), else, past
        a wrapper not known here, by the ids the data carries (``token``, ``sample_idx``), else by its index alone.
        """
        out: List[Found] = []
        seen = set()
        for sample in named:
            found = self.identify_one(dataset, dict(sample))
            if found is not None and found[0] not in seen:
                seen.add(found[0])
                out.append(found)
        return out

    def identify_one(self, dataset: Any, sample: Dict[str, Any]) -> Optional[Found]:
        """:meth:`identify` for one sample (None where nothing names it); its identity is kept."""
        found = _name_sample(dataset, sample, self._indices_of)
        if found is not None and dataset is not None and found[0] not in self.identities:
            # What the next run resolves through its own wrappers (another seed, another table): kept for the samples
            # named bad, quarantined or refused.
            self.identities[found[0]] = identity(dataset, found[2]["index"])
        return found

    def _indices_of(self, key: str) -> List[int]:
        known = self.refused_samples.get(key, {}).get("served_as", [])
        return list(known) + (self.skip_list.indices_of(key) if self.skip_list is not None else [])

    def quarantined(self, key: str) -> bool:
        """Whether the sample ``key`` is in the skip list."""
        return self.skip_list is not None and self.skip_list.has_sample(key)

    # ------------------------------------------------------------------ taking, refusing, remembering
    def take_all(self, found: Sequence[Found],
                 meta: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
        """Puts ``found`` in the skip list, all of them or, past its bound, none (refused and remembered). Returns
        (taken, refused), as records name them."""
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
        return taken, refused

    def refuse(self, found: Sequence[Found]) -> None:
        """Remembers the samples of ``found`` not quarantined as refused (the patched config names them too)."""
        for key, indices, named in found:
            if not self.quarantined(key):
                self.refused_samples[key] = _served(named, indices)

    def stored(self, found: Sequence[Found], taken: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """For each sample of ``taken`` (in order), the identity stored for the next run (:attr:`identities`)."""
        by_named = [(named, key) for key, _, named in found]
        return [dict(self.identities.get(next((k for n, k in by_named if n is s), ""), {"index": s.get("index")}))
                for s in taken]

    def bad(self, found: Sequence[Found] = ()) -> Dict[str, Dict[str, Any]]:
        """Every bad sample this run found, by key, as records name them: quarantined, refused, and ``found``."""
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

    def sighted(self, found: Mapping[str, Tuple[List[int], Dict[str, Any]]], epoch: int) -> List[str]:
        """Remembers that evidence named these samples at a skipped step in ``epoch``; returns those now named twice,
        in two different epochs or under two different indices (a resampling wrapper serves it again in the same
        pass), and not yet quarantined."""
        twice = []
        for key, (_, named) in found.items():
            seen = self.sightings.setdefault(key, [])
            mark = [int(epoch), int(named.get("index", -1))]
            if mark not in seen:
                seen.append(mark)
                del seen[:-2]  # two sightings decide
            if len(seen) >= 2 and not self.quarantined(key):
                twice.append(key)
        while len(self.sightings) > _MAX_SIGHTINGS:  # oldest first (dicts keep insertion order)
            self.sightings.pop(next(iter(self.sightings)))
        return twice


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
