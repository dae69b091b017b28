"""Which sample a dataset index serves, through the dataset wrappers that serve one sample under many indices.

PETR's and PETRv2's trainval configs train through mmdet3d's ``CBGSDataset`` (each sample drawn under several
indices, in proportion to its classes); mmdet's ``RepeatDataset`` / ``ClassBalancedDataset`` / ``ConcatDataset``,
MMEngine's wrappers and torch's ``ConcatDataset`` / ``Subset`` map an index the same way. :func:`sample_of` follows
an index down the chain to the dataset that holds the sample (its *leaf*) and the sample's index there;
:func:`indices_serving` gives every index of the outer dataset that serves that same sample, so a quarantine keeps a
sample out under all of them. A wrapper this module does not know (a user's own) ends the walk: its samples are
then known by the ids the data carries (``token``, ``sample_idx``: :mod:`.samples`). Duck-typed, by the attributes
each wrapper has had since mmdet3d 0.17 / mmdet 2.x / MMEngine 0.x / torch 1.9; recovery path only.
"""
import bisect
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

__all__ = ["Sample", "ID_FIELDS", "sample_of", "indices_serving", "describe", "wraps", "infos_of", "identity",
           "resolve"]

#: The ids an identity carries beside the sample's place (the leaf dataset, its inner index): what the data and the
#: dataset's infos say the sample is (nuScenes ``token``, mmdet3d ``sample_idx``, StreamPETR ``scene_token``).
ID_FIELDS = ("token", "sample_idx", "scene_token")

#: A chain longer than this is a cycle (a wrapper whose ``dataset`` is itself), not a dataset.
_MAX_DEPTH = 16


class Sample(NamedTuple):
    """One sample, by where it lives: ``index`` in the dataset that holds it (the *leaf*), and ``part``, which of
    the chain's distinct leaves that is (0 where there is one; a ``ConcatDataset`` of two datasets has two, of one
    dataset twice has one). ``known`` is False when the walk stopped at a wrapper it does not know (then ``index`` is
    that wrapper's own index). ``leaf`` is the class name of the dataset the walk ended at."""

    part: int
    index: int
    known: bool
    leaf: str
    parts: int

    @property
    def key(self) -> str:
        """A stable name: ``'12'`` for index 12 of the only leaf, ``'1/12'`` for index 12 of the second of several;
        a ``'?'`` prefix where an unknown wrapper ended the walk."""
        name = f"{self.part}/{self.index}" if self.parts > 1 else str(self.index)
        return name if self.known else f"?{name}"


class _InfosByCall(Sequence[Any]):
    """A dataset's infos read one at a time through ``get_data_info(i)`` (MMEngine with ``serialize_data=True``, whose
    wrappers also map an index to their inner dataset's info)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset.get_data_info(index)

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))


def infos_of(dataset: Any) -> Sequence[Any]:
    """The dataset's own per-index infos: ``data_infos`` (MMCV 1.x: mmdet3d 0.17 / 1.0rc, PETR, StreamPETR),
    ``data_list`` (MMEngine, when not serialized), else ``get_data_info`` (:class:`_InfosByCall`); empty for a
    dataset without any."""
    infos = getattr(dataset, "data_infos", None)
    if infos is None:
        infos = getattr(dataset, "data_list", None) or None
    if infos is None and hasattr(dataset, "get_data_info") and hasattr(dataset, "__len__"):
        infos = _InfosByCall(dataset)
    return infos or []


def _dataset_like(value: Any) -> bool:
    return hasattr(value, "__getitem__") and hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict))


def _inner(dataset: Any) -> Tuple[Any, Any]:
    """The wrapped dataset and the concatenated ones, where ``dataset`` has them (a leaf's ``dataset = 'nuscenes'``
    is not one)."""
    inner = getattr(dataset, "dataset", None)
    parts = getattr(dataset, "datasets", None)
    return (inner if _dataset_like(inner) else None,
            parts if isinstance(parts, Sequence) and parts and all(_dataset_like(p) for p in parts) else None)


def _step(dataset: Any, index: int) -> Optional[Tuple[Any, int, Optional[int]]]:
    """One level down: (inner dataset, its index, the concat branch or None); None at a leaf or an unknown wrapper."""
    inner, parts = _inner(dataset)
    ori = getattr(dataset, "_get_ori_dataset_idx", None)  # every MMEngine wrapper (and mmdet3d 1.x's CBGSDataset)
    if callable(ori) and (inner is not None or parts is not None):
        found = ori(index)
        if isinstance(found, tuple):
            return parts[found[0]], int(found[1]), int(found[0])
        return inner, int(found), None
    if parts is not None and getattr(dataset, "cumulative_sizes", None) is not None:  # torch / mmdet ConcatDataset
        sizes = dataset.cumulative_sizes
        part = bisect.bisect_right(sizes, index)
        return parts[part], index - (sizes[part - 1] if part else 0), part
    if inner is None:
        return None
    for mapping in ("sample_indices", "repeat_indices", "indices"):  # CBGSDataset; ClassBalancedDataset; Subset
        table = getattr(dataset, mapping, None)
        if table is not None:
            return inner, int(table[index]), None
    times = getattr(dataset, "times", None)  # mmdet's RepeatDataset (_ori_len) and the like
    if isinstance(times, int) and not isinstance(times, bool):
        return inner, index % int(getattr(dataset, "_ori_len", None) or len(inner)), None
    return None


def wraps(dataset: Any) -> bool:
    """Whether ``dataset`` wraps others (known here or not): then its indices are not its samples'."""
    inner, parts = _inner(dataset)
    return inner is not None or parts is not None


def _leaves(dataset: Any, depth: int = 0) -> List[Any]:
    """The distinct datasets at the ends of the chain, depth first (each object once)."""
    if depth > _MAX_DEPTH:
        return [dataset]
    inner, parts = _inner(dataset)
    if parts is not None and (len(dataset) == 0 or _step(dataset, 0) is not None):
        below = [leaf for part in parts for leaf in _leaves(part, depth + 1)]
    elif inner is not None and len(dataset) and _step(dataset, 0) is not None:
        below = _leaves(inner, depth + 1)
    else:
        return [dataset]
    unique: List[Any] = []
    for leaf in below:
        if not any(leaf is u for u in unique):
            unique.append(leaf)
    return unique


def sample_of(dataset: Any, index: int) -> Sample:
    """The sample ``dataset[index]`` serves: the leaf dataset's index, through every wrapper known here.

    Raises:
        IndexError: ``index`` is outside a wrapper's mapping.
    """
    return _sample_of(dataset, index, _leaves(dataset))


def _sample_of(dataset: Any, index: int, leaves: List[Any]) -> Sample:
    current, at = dataset, int(index)
    for _ in range(_MAX_DEPTH):
        step = _step(current, at)
        if step is None:
            break
        current, at, _ = step
    part = next((i for i, leaf in enumerate(leaves) if leaf is current), 0)
    return Sample(part, at, not wraps(current), type(current).__name__, len(leaves))


# One table per dataset object (and length): a sample's outer indices, built once on the recovery path.
_TABLES: Dict[int, Tuple[Any, int, Dict[str, List[int]]]] = {}


def _table(dataset: Any) -> Dict[str, List[int]]:
    size = len(dataset)
    cached = _TABLES.get(id(dataset))
    if cached is not None and cached[0] is dataset and cached[1] == size:
        return cached[2]
    table: Dict[str, List[int]] = {}
    leaves = _leaves(dataset)  # once: the chain is the same for every index
    for i in range(size):
        table.setdefault(_sample_of(dataset, i, leaves).key, []).append(i)
    _TABLES.clear()  # one training set per process is the rule; keep no stale tables alive
    _TABLES[id(dataset)] = (dataset, size, table)
    return table


def indices_serving(dataset: Any, index: int) -> List[int]:
    """Every index of ``dataset`` that serves the same sample as ``index`` (``index`` included), sorted. Without a
    known wrapper that is ``[index]``: a plain dataset serves each sample under one index."""
    if dataset is None or _step(dataset, int(index)) is None:
        return [int(index)]  # a plain dataset, or an outermost wrapper not known here: nothing to map
    return list(_table(dataset).get(sample_of(dataset, index).key, [int(index)]))


def describe(dataset: Any, indices: Sequence[int]) -> Dict[str, Any]:
    """For the record: the sample behind the first of ``indices`` (``inner_index``, ``dataset``: the leaf's class,
    ``part`` where a concatenation was crossed) and the outer indices it is served under (``served_as``)."""
    if dataset is None or not indices:
        return {}
    sample = sample_of(dataset, int(indices[0]))
    out: Dict[str, Any] = {"inner_index": sample.index, "dataset": sample.leaf,
                           "served_as": sorted(int(i) for i in indices)}
    if sample.parts > 1:
        out["part"] = sample.part
    if not sample.known:
        out["wrapper_unknown"] = True
    return out


def identity(dataset: Any, index: int) -> Dict[str, Any]:
    """What the sample ``dataset[index]`` is, whatever wrappers serve it: the leaf dataset's class (``dataset``), its
    index there (``inner_index``), ``part`` where a concatenation holds several, and the ids the leaf's info for it
    holds (:data:`ID_FIELDS`). What a quarantine stores for the next run, which resolves it through its own chain
    (another seed, another CBGS table) with :func:`resolve`. An unknown wrapper ends the walk: ``index`` then."""
    sample = sample_of(dataset, int(index))
    if not sample.known:
        return {"index": int(index)}
    out: Dict[str, Any] = {"dataset": sample.leaf, "inner_index": sample.index}
    if sample.parts > 1:
        out["part"] = sample.part
    leaf = _leaves(dataset)[sample.part]
    try:
        infos = infos_of(leaf)
        info = infos[sample.index] if 0 <= sample.index < len(infos) else None
    except Exception:  # noqa: BLE001 (ids are a help to the next run; the place alone names the sample)
        info = None
    if isinstance(info, Mapping):
        out.update({k: info[k] for k in ID_FIELDS if isinstance(info.get(k), (str, int)) and not
                    isinstance(info.get(k), bool)})
    return out


def resolve(dataset: Any, who: Mapping[str, Any]) -> List[int]:
    """Every index of ``dataset`` serving the sample ``who`` names, sorted (empty where this dataset holds none).

    ``who`` is an :func:`identity` (its ids first: ``token`` / ``sample_idx`` looked up in the leaves' infos, as they
    name the sample even where an inner index moved; else the leaf's class, ``part`` and ``inner_index``), a bare id
    (``{'token': ...}``), or ``{'index': i}`` (an index of this very dataset, as quarantines named samples before
    identities: taken as is).
    """
    if who.get("index") is not None and who.get("inner_index") is None:
        return [int(who["index"])] if 0 <= int(who["index"]) < len(dataset) else []
    keys: List[str] = []
    for field in ("token", "sample_idx"):  # StreamPETR's sample_idx is the nuScenes token: either names either
        if who.get(field) is not None:
            keys = _ids(dataset).get(who[field], [])
            if keys:
                break
    if not keys and who.get("inner_index") is not None:
        leaves = _leaves(dataset)
        part = int(who.get("part", 0))
        if part < len(leaves) and who.get("dataset") in (None, type(leaves[part]).__name__):
            keys = [Sample(part, int(who["inner_index"]), True, "", len(leaves)).key]
    table = _table(dataset)
    return sorted({i for k in keys for i in table.get(k, [])})


# One ids table per dataset object: an id (a token or a sample_idx) -> the sample keys whose leaf info holds it.
_IDS: Dict[int, Tuple[Any, Dict[Any, List[str]]]] = {}


def _ids(dataset: Any) -> Dict[Any, List[str]]:
    cached = _IDS.get(id(dataset))
    if cached is not None and cached[0] is dataset:
        return cached[1]
    leaves = _leaves(dataset)
    found: Dict[Any, List[str]] = {}
    for part, leaf in enumerate(leaves):
        for index, info in enumerate(infos_of(leaf)):
            if not isinstance(info, Mapping):
                continue
            key = Sample(part, index, True, "", len(leaves)).key
            for field in ("token", "sample_idx"):
                value = info.get(field)
                if isinstance(value, (str, int)) and not isinstance(value, bool) and key not in found.get(value, ()):
                    found.setdefault(value, []).append(key)
    _IDS.clear()  # one training set per process is the rule
    _IDS[id(dataset)] = (dataset, found)
    return found
