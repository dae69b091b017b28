"""Data quarantine, the remedy: which samples bad data (:data:`~..causes.Cause.DATA`) puts out of the run, within its
bound, by evidence about each sample. Its bookkeeping (the skip list, the sampler that honours it) is
:mod:`~..skiplist`'s: what the loader serves, apart from who decides it.
"""
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..causes import Cause, SampleVerdict
from ..skiplist import SampleLedger, SkipList, short_samples
from ..validate import Setting, check_indices, check_list, check_number, is_bool
from ..wrappers import resolve
from .base import Change, ConfigEntry, Incident, Outcome, Remedy, Run

__all__ = ["Quarantine"]


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
        #: Bad sample -> what it is: what a resume, and the next run from the patched config, resolve.
        self.identities: Dict[str, Dict[str, Any]] = {}
        #: The books over this state (:class:`~..skiplist.SampleLedger`): the live skip list, naming, taking, refusing.
        self.book = SampleLedger(self)

    @property
    def skip_list(self) -> Optional[SkipList]:
        """The live skip list the training loader's sampler honours (from :attr:`When.ATTACH` on)."""
        return self.book.skip_list

    def on_attach(self, run: Run) -> Outcome:
        return Outcome(exclude=self._attach(run.io))

    def on_skipped(self, run: Run, incident: Incident) -> Outcome:
        return self._recurring(run.io, incident)

    def before_restore(self, run: Run, incident: Incident) -> Outcome:
        if self.skip_list is None:
            return Outcome(evidence="; no training loader to quarantine through: nothing quarantined")
        return self._incident(run.io, incident)

    def on_spent(self, run: Run, incident: Incident) -> Outcome:
        found = self.book.identify(run.io.dataset(), incident.samples)
        self.book.refuse(found)  # past the budget: the patched config names them too
        return Outcome(samples=SampleVerdict(bad_data=tuple(self.book.bad(found).values())))

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
        self.book.skip_list = skip
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
        key, serving, _ = self.book.identify_one(dataset, dict(ids, index=indices[0]))
        skip.add(serving, {"from": "quarantine"}, sample=key)
        self.identities[key] = dict(who)

    def _sync(self) -> None:
        self.skip = self.skip_list.state_dict() if self.skip_list is not None and len(self.skip_list) else None

    # ------------------------------------------------------------------ a data incident
    def _incident(self, io: Any, incident: Incident) -> Outcome:
        found = self.book.identify(io.dataset(), incident.samples) if incident.samples else []
        if not found:
            # Nothing to name: the batch goes by; hyperparameters were never the problem.
            return Outcome(evidence=f"; no sample is named by evidence of its own ({self._unnamed(incident.samples)}): "
                                    "nothing quarantined")
        back = [named for key, _, named in found if key in self.refused_samples]
        if back:
            return Outcome(evidence=f"; {short_samples(back)}, refused by the quarantine's bound of "
                                    f"{self.skip_list.capacity} sample(s) before, broke the run again: a data "
                                    "problem, not a bug",
                           samples=SampleVerdict(bad_data=tuple(self.book.bad(found).values())))
        before = self.skip_list.samples
        taken, refused = self._take_all(found, {"iteration": incident.iteration})
        evidence = ""
        if refused:
            evidence = (f"; quarantining {short_samples(refused)} would pass the bound of {self.skip_list.capacity} "
                        "sample(s) (quarantine_fraction): refused, not quarantined; the batch is skipped")
        changes = (Change("quarantine.samples", before, self.skip_list.samples),) if taken else ()
        return Outcome(changes, evidence, samples=SampleVerdict(tuple(taken), tuple(refused),
                                                                stored=tuple(self.book.stored(found, taken))))

    def _take_all(self, found: Sequence[Tuple[str, List[int], Dict[str, Any]]],
                  meta: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
        taken, refused = self.book.take_all(found, meta)
        self._sync()
        return taken, refused

    def _unnamed(self, ids: Sequence[Mapping[str, Any]]) -> str:
        if ids:
            carried = sorted({k for i in ids for k in i if k != "rank"})
            return f"the ids it carries ({', '.join(carried)}) name no single dataset index"
        return "no sample of the batch was isolated by its own values or a replay, or none can be named"

    # ------------------------------------------------------------------ samples named at two skipped steps
    def _recurring(self, io: Any, incident: Incident) -> Outcome:
        """Samples evidence named at a skipped step: those named twice are quarantined (within the bound); a sample
        the bound refused before among them stops the run (``bad_data``)."""
        found = {key: (indices, sample) for key, indices, sample in self.book.identify(io.dataset(), incident.samples)}
        twice = self.book.sighted(found, incident.epoch)  # remembered whether or not they are taken
        recurring = twice if self.config.quarantine_recurring else []
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
                           samples=SampleVerdict(bad_data=tuple(self.book.bad(chosen).values())))
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
                                tuple(self.book.stored(chosen, taken)), reason=reason)
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
        for key, sample in self.book.bad().items():
            who = self.identities.get(key) or ({"index": sample["index"]} if "index" in sample else None)
            if who is None:
                continue
            entry = int(who["index"]) if set(who) == {"index"} else dict(who)
            if entry not in entries:
                entries.append(entry)
        return ConfigEntry(fix={"quarantine": entries} if entries else {})
