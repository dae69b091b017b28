"""Data quarantine, the remedy: which samples bad data (:data:`~..causes.Cause.DATA`) puts out of the run, within its
bound, by evidence about each sample. Its bookkeeping (the skip list, the sampler that honours it) is
:mod:`~..skiplist`'s: what the loader serves, apart from who decides it.
"""
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..causes import Cause, SampleVerdict
from ..samples import resolve_indices
from ..skiplist import SkipList, short_samples
from ..validate import Setting, check_indices, check_list, check_number, is_bool
from ..wrappers import describe, identity, indices_serving, resolve, sample_of, wraps
from .base import Change, ConfigEntry, Incident, Outcome, Remedy, Run

__all__ = ["Quarantine"]

#: Samples remembered for the recurrence rule (the newest kept): far more than any run's bad samples.
_MAX_SIGHTINGS = 100000


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
    order = 70
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
        return Outcome(samples=SampleVerdict(bad_data=tuple(self.spent(run.io.dataset(), incident.samples))))

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
                                    "problem, not a bug",
                           samples=SampleVerdict(bad_data=tuple(self.bad_samples(found))))
        before = self.skip_list.samples
        taken, refused = self._take_all(found, {"iteration": incident.iteration})
        evidence = ""
        if refused:
            evidence = (f"; quarantining {short_samples(refused)} would pass the bound of {self.skip_list.capacity} "
                        "sample(s) (quarantine_fraction): refused, not quarantined; the batch is skipped")
        changes = (Change("quarantine.samples", before, self.skip_list.samples),) if taken else ()
        return Outcome(changes, evidence, samples=SampleVerdict(tuple(taken), tuple(refused),
                                                                stored=tuple(self._stored(found, taken))))

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
            return Outcome(samples=SampleVerdict(recurring=tuple(found[k][1] for k in recurring),
                                                 reason=f"made steps go wrong in epochs {epochs}; not quarantined: "
                                                        "no training loader to quarantine through"))
        back = [found[k][1] for k in recurring if k in self.refused_samples]
        if back:
            return Outcome(evidence=f"; {short_samples(back, 8)}, refused by the quarantine's bound of "
                                    f"{self.skip_list.capacity} sample(s) (quarantine_fraction="
                                    f"{self.config.quarantine_fraction}), broke the run again",
                           samples=SampleVerdict(bad_data=tuple(self.bad_samples(chosen))))
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
        verdict = SampleVerdict(tuple(taken), tuple(refused), tuple(taken + refused),
                                tuple(self._stored(chosen, taken)), reason=reason)
        return Outcome(changes, f"; {short_samples(taken + refused)} {reason}", samples=verdict)

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
