"""What identifies a batch's samples: the dataset indices it was drawn with, and the ids the data carries.

:func:`named_samples` joins the indices :class:`~.tracking.SampleTracker` recorded with what :func:`sample_ids` pulls
out of the batch; :func:`resolve_indices` maps ids back to dataset indices where only ids are known;
:func:`suspect_rows` names the samples of a batch that hold non-finite (or, under fp16, out-of-range) values
themselves. Torch only: MMEngine's data samples and MMCV 1.x's ``DataContainer`` are duck-typed.
"""
import re
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from .fp16 import FP16_MAX, reaches_fp16
from .wrappers import infos_of, resolve

__all__ = ["MASK_NAME", "is_mask_name", "ID_KEYS", "key", "sample_ids", "info_ids", "named_samples", "suspect_rows",
           "indices_of", "resolve_indices"]

#: Keys that identify a sample, in the order the incident record lists them: the dataset index (``idx`` and
#: ``dataset_index`` are read as ``index``), mmdet3d's ``sample_idx`` (an int in mmdet3d 1.x, the nuScenes sample
#: token in megvii PETR and StreamPETR), the nuScenes ``token`` and StreamPETR's ``scene_token``.
ID_KEYS: Tuple[str, ...] = ("index", "sample_idx", "token", "scene_token")
_ALIASES = {"idx": "index", "dataset_index": "index"}


#: Argument and batch-key names that carry an attention mask or an additive attention bias: ``attn_mask``,
#: ``src_mask``, ``memory_key_padding_mask``, ``key_padding_mask``, ``mask``, ``attn_bias``, ``attention_bias``.
MASK_NAME = re.compile(r"(^|_)mask($|_)|(^|_)masks($|_)|(^|_)attn_bias$|(^|_)attention_bias$")


def is_mask_name(name: Any) -> bool:
    """Whether an argument or batch key called ``name`` carries an attention mask (or an additive attention bias)."""
    return isinstance(name, str) and bool(MASK_NAME.search(name.lower()))


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


def resolve_indices(dataset: Any, ids: Iterable[Mapping[str, Any]]) -> List[int]:
    """Every dataset index that serves the samples in ``ids`` (from :func:`sample_ids`), sorted, unique.

    An ``index`` is taken as is; otherwise ``token`` / ``sample_idx`` are looked up among the infos of the datasets
    that hold the samples, through every wrapper :mod:`.wrappers` knows (one resolver: :func:`~.wrappers.resolve`),
    so every index serving a sample is returned. Ids found nowhere give nothing.
    """
    found = set()
    for entry in ids:
        if entry.get("index") is not None:
            found.add(int(entry["index"]))
        elif dataset is not None:
            found.update(resolve(dataset, {k: entry[k] for k in ("token", "sample_idx") if entry.get(k) is not None}))
    return sorted(found)


def info_ids(dataset: Any, index: int) -> Dict[str, Any]:
    """The ids (``token``, ``sample_idx``) the dataset's own info for ``index`` holds: ``data_infos[index]`` (MMCV
    1.x datasets: StreamPETR's carry the nuScenes token there and only ``scene_token`` in ``img_metas``),
    ``data_list[index]``, else ``get_data_info(index)`` (MMEngine's, wrappers included, which map the index to their
    inner dataset). Nothing for a dataset without infos or an index it does not hold. Recovery path only."""
    try:
        infos = infos_of(dataset)
        info = infos[index] if 0 <= index < len(infos) else None
    except Exception:  # naming is evidence only: a dataset whose info cannot be read names nothing more
        return {}
    if not isinstance(info, Mapping):
        return {}
    return {k: _plain(info[k]) for k in ("sample_idx", "token")
            if isinstance(info.get(k), (str, int)) and not isinstance(info.get(k), bool)}


def named_samples(indices: Optional[List[int]], batch: Any, dataset: Any = None) -> List[Dict[str, Any]]:
    """One dict per sample of the batch in hand: its dataset ``index`` (where the tracker knows it) and the ids the
    data carries (``sample_idx``, ``token``, ``scene_token``), row by row where both are known for every sample.
    With ``dataset``, a sample whose batch carries neither ``token`` nor ``sample_idx`` gets them from the dataset's
    info at its index (:func:`info_ids`)."""
    ids = sample_ids(batch) if batch is not None else []
    if indices is None:
        return ids
    if len(ids) == len(indices):
        rows = [dict(row, index=int(i)) if "index" not in row else dict(row) for i, row in zip(indices, ids)]
    else:
        rows = [{"index": int(i)} for i in indices]
    if dataset is None:
        return rows
    return [dict(row, **info_ids(dataset, int(row["index"]))) if "token" not in row and "sample_idx" not in row
            else row for row in rows]


def indices_of(samples: Iterable[Mapping[str, Any]], dataset: Any = None) -> List[int]:
    """The dataset indices of ``samples`` (their ``index``, else their ids looked up in ``dataset``)."""
    samples = list(samples)
    known = [int(s["index"]) for s in samples if s.get("index") is not None]
    rest = [s for s in samples if s.get("index") is None]
    return sorted(set(known) | set(resolve_indices(dataset, rest) if rest else []))


def _row_tensors(obj: Any, count: int, depth: int = 0) -> Iterator[Tuple[int, torch.Tensor]]:
    """(row, tensor) for every floating tensor of the batch that belongs to one sample: a row of a tensor whose first
    dimension is ``count``, the i-th item of a list of ``count`` items, or any tensor of a batch of one sample."""
    if depth > 8:
        return
    if hasattr(obj, "cpu_only") and hasattr(obj, "data"):  # MMCV 1.x DataContainer: data is per GPU
        data = obj.data
        if isinstance(data, (list, tuple)) and len(data) == 1:
            data = data[0]
        yield from _row_tensors(data, count, depth + 1)
        return
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and count == 1:
            yield 0, obj  # a batch of one sample: every tensor in it is that sample's, whatever its layout
        elif obj.is_floating_point() and obj.dim() >= 1 and obj.shape[0] == count:
            yield from enumerate(obj.unbind(0))
        return
    if isinstance(obj, Mapping):
        for name, value in obj.items():
            if not is_mask_name(name):  # a mask's -inf is by design (watch/health.py); its NaN is checked by the replay
                yield from _row_tensors(value, count, depth + 1)
    elif isinstance(obj, (list, tuple)):
        # One tensor per sample (MMEngine's pseudo_collate), unless every item is itself batched along its first
        # dimension (default_collate of (x, y) tuples gives [x, y]): then each item is read row by row.
        batched = all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == count for v in obj)
        if len(obj) == count and count > 1 and not batched and all(isinstance(v, torch.Tensor) for v in obj):
            for row, value in enumerate(obj):
                if value.is_floating_point():
                    yield row, value
            return
        for value in obj:
            yield from _row_tensors(value, count, depth + 1)


def suspect_rows(batch: Any, count: int, fp16: bool) -> List[int]:
    """The rows (sample positions) of a batch of ``count`` samples whose own values are non-finite, or beyond fp16's
    range when the step ran in fp16 (a raw 16-bit pixel becomes Inf under autocast; float64 values, timestamps in
    seconds, never reach fp16 code: :func:`~.fp16.reaches_fp16`); an attention mask the batch carries is not its
    values (:mod:`~.watch.health`). Every row where every row is bad (a batch of one
    sample included: its own values are the evidence); empty where none is. Reads the batch where it lives (on the
    host, as loaders give it); called on steps that already went wrong, never on healthy ones."""
    if count < 1 or batch is None:
        return []
    bad = set()
    for row, t in _row_tensors(batch, count):
        if row in bad:
            continue
        t = t.detach()
        if not bool(torch.isfinite(t).all()) or (fp16 and t.numel() and reaches_fp16(t)
                                                 and float(t.abs().amax()) > FP16_MAX):
            bad.add(row)
    return sorted(bad)
