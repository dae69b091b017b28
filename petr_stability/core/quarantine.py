"""Data quarantine: a bounded skip list of dataset indices and a sampler wrapper that never yields them again.

A batch that breaks the healthy weights too (:data:`~.causes.Cause.DATA`) would come back every epoch; its samples
go into a :class:`SkipList` (kept in the guard's checkpoint state) and a :class:`QuarantineSampler` around the run's
sampler replaces them by healthy indices from then on, also after a resume. :func:`sample_ids` pulls what identifies
the samples out of a batch for the incident record; :func:`resolve_indices` maps those ids back to dataset indices.
Torch only: MMEngine's and MMCV 1.x's samplers, data samples and ``DataContainer`` are duck-typed.
"""
import math
from collections import defaultdict
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

__all__ = ["SkipList", "QuarantineSampler", "install_quarantine", "sample_ids", "resolve_indices", "ID_KEYS"]

#: Keys that identify a sample, in the order the incident record lists them: the dataset index (``idx`` and
#: ``dataset_index`` are read as ``index``), mmdet3d's ``sample_idx`` (an int in mmdet3d 1.x, the nuScenes sample
#: token in megvii PETR and StreamPETR), the nuScenes ``token`` and StreamPETR's ``scene_token``.
ID_KEYS: Tuple[str, ...] = ("index", "sample_idx", "token", "scene_token")
_ALIASES = {"idx": "index", "dataset_index": "index"}


def _key(index: Any) -> Any:
    # Samplers yield ints, numpy ints or 0-dim tensors: all compare as the same int in the skip list.
    try:
        return int(index)
    except (TypeError, ValueError):
        return index


class SkipList:
    """Dataset indices quarantined for the rest of the run, bounded so that a bug cannot hide behind it.

    Args:
        dataset_size: ``len(dataset)`` of the training set (the indices the sampler yields). 0 means unknown:
            the bound is then ``min_count`` and indices are not range-checked.
        max_fraction: at most this fraction of the dataset can be quarantined. Defaults to 0.001 (28 of
            nuScenes' 28130 training samples).
        min_count: the bound is at least this many samples, however small the dataset. Defaults to 1.
    """

    def __init__(self, dataset_size: int, max_fraction: float = 0.001, min_count: int = 1) -> None:
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
        self._meta: Dict[int, Dict[str, Any]] = {}

    @property
    def capacity(self) -> int:
        """How many indices the list may hold: ``max(min_count, floor(max_fraction * dataset_size))``."""
        return max(self.min_count, int(math.floor(self.max_fraction * self.dataset_size)))

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
        sampler: the wrapped sampler or batch sampler (an iterable of indices, or of lists of indices).
        skip: the quarantined indices (:class:`SkipList` or any container of ints).
    """

    _MAX_WAIT = 16

    def __init__(self, sampler: Any, skip: Any) -> None:
        self.sampler = sampler
        self.skip = skip
        self.replaced = 0

    def __getattr__(self, name: str) -> Any:
        if name in ("sampler", "skip", "replaced") or name.startswith("__"):
            raise AttributeError(name)  # not set yet (unpickling): never recurse into the wrapped sampler
        return getattr(self.sampler, name)

    def __len__(self) -> int:
        return len(self.sampler)

    def _bad(self, index: Any) -> bool:
        return _key(index) in self.skip

    def __iter__(self) -> Iterator[Any]:
        last: Dict[int, Any] = {}
        queue: List[Tuple[bool, List[Any]]] = []
        seen = 0
        for item in self.sampler:
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


def install_quarantine(loader: Any, skip: Any) -> QuarantineSampler:
    """Puts a :class:`QuarantineSampler` into a torch ``DataLoader`` (MMEngine's and MMCV 1.x's are torch's).

    Wraps the batch sampler's inner ``sampler`` where it has one (torch's ``BatchSampler``, mmdet's aspect-ratio
    batch samplers), else the batch sampler itself (StreamPETR's group-each-sample batch sampler), else the
    loader's sampler. Idempotent. Call it before the loader's first iterator is made (``before_train``): an
    infinite sampler's iterator, made once, keeps the sampler it started with.

    Returns:
        The wrapper (an existing one when already installed).
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and getattr(batch_sampler, "sampler", None) is not None:
        owner, attr = batch_sampler, "sampler"
    elif batch_sampler is not None:
        owner, attr = loader, "batch_sampler"
    else:
        owner, attr = loader, "sampler"
    current = getattr(owner, attr)
    if isinstance(current, QuarantineSampler):
        return current
    wrapper = QuarantineSampler(current, skip)
    # DataLoader refuses to set sampler/batch_sampler after construction (a guard against user mistakes); the
    # wrapper yields the same number of indices, which is what that guard protects.
    object.__setattr__(owner, attr, wrapper)
    return wrapper


# ---------------------------------------------------------------------------------------------- sample ids
def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars
        try:
            return value.item()
        except (TypeError, ValueError):
            return value
    return value


def _ids(meta: Mapping[str, Any]) -> List[Dict[str, Any]]:
    found: Dict[str, Any] = {}
    for key, value in meta.items():
        name = _ALIASES.get(key, key)
        if name in ID_KEYS and value is not None and name not in found:
            found[name] = value
    if not found:
        return []
    columns = {k: v for k, v in found.items()
               if isinstance(v, (list, tuple)) or (isinstance(v, torch.Tensor) and v.dim() == 1)}
    ordered = [k for k in ID_KEYS if k in found]
    if not columns:
        return [{k: _plain(found[k]) for k in ordered}]
    # A collated batch: one column per key, one row per sample.
    rows = max(len(v) for v in columns.values())
    return [{k: _plain(found[k][r] if k in columns else found[k]) for k in ordered} for r in range(rows)]


def _metas(obj: Any, depth: int = 0) -> Iterator[Mapping[str, Any]]:
    if depth > 8:
        return
    if hasattr(obj, "cpu_only") and hasattr(obj, "data"):  # MMCV 1.x DataContainer
        yield from _metas(obj.data, depth + 1)
        return
    metainfo = getattr(obj, "metainfo", None)  # MMEngine data samples
    if isinstance(metainfo, Mapping):
        yield metainfo
        return
    if isinstance(obj, Mapping):
        if any(_ALIASES.get(k, k) in ID_KEYS for k in obj):
            yield obj
            return
        for key in ("data_samples", "img_metas", "img_meta", "metainfo", "metas"):
            if key in obj:
                yield from _metas(obj[key], depth + 1)
        return
    if isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _metas(value, depth + 1)


def sample_ids(batch: Any) -> List[Dict[str, Any]]:
    """What identifies each sample of a batch, for the incident record: a dict of :data:`ID_KEYS` per sample.

    Reads lists of sample dicts, collated dicts (one column per key), MMEngine batches (``data_samples[i].metainfo``)
    and MMCV 1.x batches (``img_metas`` as a ``DataContainer`` or lists of dicts), duck-typed. Samples that carry
    no id give nothing (an empty list when none does).
    """
    out: List[Dict[str, Any]] = []
    for meta in _metas(batch):
        out.extend(_ids(meta))
    return out


def _infos(dataset: Any) -> Iterable[Any]:
    infos = getattr(dataset, "data_infos", None)  # MMCV 1.x (mmdet3d 0.17 / 1.0rc, PETR, StreamPETR)
    if infos is None:
        infos = getattr(dataset, "data_list", None) or None  # MMEngine, when not serialized
    if infos is None and hasattr(dataset, "get_data_info") and hasattr(dataset, "__len__"):
        infos = (dataset.get_data_info(i) for i in range(len(dataset)))  # MMEngine with serialize_data=True
    return infos or []


def _table(dataset: Any) -> Dict[Any, List[int]]:
    inner = getattr(dataset, "dataset", None)
    mapping = getattr(dataset, "sample_indices", None)  # mmdet3d CBGSDataset
    if mapping is None:
        mapping = getattr(dataset, "repeat_indices", None)  # MMEngine ClassBalancedDataset
    if inner is not None and mapping is not None:
        outer: Dict[int, List[int]] = defaultdict(list)
        for position, index in enumerate(mapping):
            outer[int(index)].append(position)
        return {v: [p for i in idxs for p in outer[i]] for v, idxs in _table(inner).items()}
    if inner is not None and isinstance(getattr(dataset, "times", None), int):  # RepeatDataset
        size = len(inner)
        return {v: [i + k * size for k in range(dataset.times) for i in idxs] for v, idxs in _table(inner).items()}
    table: Dict[Any, List[int]] = defaultdict(list)
    for i, info in enumerate(_infos(dataset)):
        if not isinstance(info, Mapping):
            continue
        for key in ("token", "sample_idx"):
            value = info.get(key)
            try:
                if value is not None and i not in table[value]:
                    table[value].append(i)
            except TypeError:  # unhashable
                continue
    return table


def resolve_indices(dataset: Any, ids: Iterable[Mapping[str, Any]]) -> List[int]:
    """Every dataset index that serves the samples in ``ids`` (from :func:`sample_ids`), sorted, unique.

    An ``index`` is taken as is; otherwise ``token`` / ``sample_idx`` are looked up among the dataset's infos
    (``data_infos``, ``data_list`` or ``get_data_info``; one pass, on the recovery path only), through mmdet3d's
    ``CBGSDataset`` and MMEngine's ``ClassBalancedDataset`` / ``RepeatDataset`` (every repeat of a sample is
    served by several indices: all are returned). Ids found nowhere give nothing.
    """
    ids = list(ids)
    found = set()
    table: Optional[Dict[Any, List[int]]] = None
    for entry in ids:
        if entry.get("index") is not None:
            found.add(int(entry["index"]))
            continue
        if dataset is None:
            continue
        if table is None:
            table = _table(dataset)
        for key in ("token", "sample_idx"):
            value = entry.get(key)
            if value is not None:
                try:
                    found.update(table.get(value, ()))
                except TypeError:
                    continue
    return sorted(found)
