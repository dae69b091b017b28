"""What identifies a batch's samples: ids the data carries, mapped back to dataset indices.

:func:`sample_ids` pulls the ids out of a batch for the incident record; :func:`resolve_indices` maps those ids back
to dataset indices (what the quarantine sampler skips). Torch only: MMEngine's data samples and MMCV 1.x's
``DataContainer`` are duck-typed.
"""
from collections import defaultdict
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

__all__ = ["ID_KEYS", "key", "sample_ids", "resolve_indices"]

#: Keys that identify a sample, in the order the incident record lists them: the dataset index (``idx`` and
#: ``dataset_index`` are read as ``index``), mmdet3d's ``sample_idx`` (an int in mmdet3d 1.x, the nuScenes sample
#: token in megvii PETR and StreamPETR), the nuScenes ``token`` and StreamPETR's ``scene_token``.
ID_KEYS: Tuple[str, ...] = ("index", "sample_idx", "token", "scene_token")
_ALIASES = {"idx": "index", "dataset_index": "index"}



def key(index: Any) -> Any:
    """A dataset index as the int it is: samplers yield ints, numpy ints or 0-dim tensors."""
    try:
        return int(index)
    except (TypeError, ValueError):
        return index


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
