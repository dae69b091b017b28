"""A dataset index is followed through the wrappers to the sample it serves (petr_stability.core.wrappers).

Real wrappers wherever this environment has them (torch's always, MMEngine's where installed, mmdet3d 1.x's
CBGSDataset from its own file); mmdet 2.x's, not installed here, by their attributes (the seed-stack suite trains
through the real ones).
"""
import importlib.util
import os
from collections import Counter

import pytest
from torch.utils.data import ConcatDataset, Dataset, Subset

from petr_stability.core.wrappers import describe, indices_serving, sample_of
from petr_stability.testing.stacks import has_mmengine
from petr_stability.testing.wrappers import CBGSLike, ClassBalancedLike, RepeatLike


class Leaf(Dataset):
    def __init__(self, n: int, tag: str = "t") -> None:
        self.n, self.tag = n, tag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        return f"{self.tag}{i}"


def _served(dataset) -> dict:
    """What each outer index really serves, read through the wrappers' own __getitem__."""
    return {i: dataset[i] for i in range(len(dataset))}


def _check_against_getitem(dataset) -> None:
    served = _served(dataset)
    for i, item in served.items():
        same = indices_serving(dataset, i)
        assert i in same and all(served[j] == item for j in same), (i, same)
        assert sorted(j for j, v in served.items() if v == item) == same  # and no index serving it is missed


def test_a_plain_dataset_serves_each_sample_under_its_own_index():
    leaf = Leaf(5)
    assert sample_of(leaf, 3).key == "3" and sample_of(leaf, 3).known
    assert indices_serving(leaf, 3) == [3]
    assert describe(leaf, [3]) == {"inner_index": 3, "dataset": "Leaf", "served_as": [3]}


def test_torch_concat_and_subset_nested():
    a, b = Leaf(4, "a"), Leaf(3, "b")
    cat = ConcatDataset([a, b, a])  # the same dataset twice: two leaves, one of them served under two parts
    sub = Subset(cat, [6, 0, 4, 6, 9, 4, 0])
    assert sample_of(sub, 0).key == "1/2" and sample_of(sub, 4).key == "0/2" and sample_of(sub, 2).key == "1/0"
    assert indices_serving(sub, 0) == [0, 3] and indices_serving(sub, 1) == [1, 6]
    _check_against_getitem(Subset(ConcatDataset([Leaf(3, "a"), Leaf(3, "b")]), [5, 1, 5, 0, 1]))
    assert describe(sub, [0, 3])["part"] == 1


@pytest.mark.parametrize("wrap", [
    lambda d: CBGSLike(d), lambda d: RepeatLike(d, 3), lambda d: ClassBalancedLike(d),
    lambda d: CBGSLike(RepeatLike(ClassBalancedLike(d), 2)),
    lambda d: ConcatDataset([Subset(CBGSLike(d), list(range(0, 12, 2))), RepeatLike(Leaf(2, "x"), 2)]),
], ids=["cbgs", "repeat", "class_balanced", "nested", "concat_of_wrappers"])
def test_mmdet_2x_shaped_wrappers_map_every_index_to_its_sample(wrap):
    _check_against_getitem(wrap(Leaf(6)))


def test_a_users_own_wrapper_ends_the_walk_and_is_said_to():
    class Mine:  # a wrapper with none of the known mappings
        def __init__(self, dataset):
            self.dataset = dataset

        def __len__(self):
            return 2 * len(self.dataset)

        def __getitem__(self, i):
            return self.dataset[i // 2]

    mine = Mine(Leaf(3))
    assert not sample_of(mine, 4).known and sample_of(mine, 4).key == "?4"
    assert indices_serving(mine, 4) == [4]  # unknown: only the index seen (the ids the data carries do the rest)
    assert describe(mine, [4])["wrapper_unknown"] is True
    # Below a known wrapper the unknown one still ends the walk, and the known level above it is still mapped.
    rep = RepeatLike(mine, 2)
    assert indices_serving(rep, 1) == [1, 7]


def test_a_leaf_whose_dataset_attribute_is_a_name_is_no_wrapper():
    leaf = Leaf(3)
    leaf.dataset = "nuscenes"
    assert sample_of(leaf, 2).known and indices_serving(leaf, 2) == [2]


pytestmark_mmengine = pytest.mark.skipif(not has_mmengine(), reason="MMEngine is not installed")


def _mmengine_leaf(n: int, tag: str = "tok"):
    from mmengine.dataset import BaseDataset

    class Tokens(BaseDataset):
        METAINFO = {"classes": ("car", "ped", "cone")}

        def load_data_list(self):
            return [{"token": f"{tag}{i}", "sample_idx": i, "cats": [i % 3] + ([0] if i % 2 else [])}
                    for i in range(n)]

        def get_cat_ids(self, idx):
            return self.get_data_info(idx)["cats"]

        def prepare_data(self, idx):
            return self.get_data_info(idx)["token"]

    return Tokens(ann_file="", serialize_data=False)


@pytestmark_mmengine
def test_mmengine_wrappers_nested():
    from mmengine.dataset import ClassBalancedDataset, RepeatDataset
    from mmengine.dataset import ConcatDataset as EngineConcat

    leaf = _mmengine_leaf(6)
    for dataset in (RepeatDataset(leaf, 3), ClassBalancedDataset(leaf, oversample_thr=0.6),
                    EngineConcat([leaf, _mmengine_leaf(4, "other")]),
                    ConcatDataset([Subset(ClassBalancedDataset(leaf, 0.6), [3, 0, 3, 7]), RepeatDataset(leaf, 2)])):
        _check_against_getitem(dataset)


def _mmdet3d_cbgs():
    """mmdet3d 1.x's CBGSDataset, loaded from its own file (its package imports optional dependencies)."""
    try:
        import mmdet3d
        import mmdet3d.registry  # noqa: F401
    except Exception:  # noqa: BLE001 (not installed, or a stack without its registry)
        return None
    path = os.path.join(os.path.dirname(mmdet3d.__file__), "datasets", "dataset_wrappers.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("_petr_stability_cbgs", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001
        return None
    return getattr(module, "CBGSDataset", None)


def test_mmdet3d_1x_cbgs_dataset_serves_each_sample_under_many_indices():
    cbgs_class = _mmdet3d_cbgs()
    if cbgs_class is None or not has_mmengine():
        pytest.skip("mmdet3d 1.x is not installed (the seed-stack suite trains through 1.0rc's)")
    cbgs = cbgs_class(_mmengine_leaf(9))
    _check_against_getitem(cbgs)
    counts = Counter(sample_of(cbgs, i).key for i in range(len(cbgs)))
    assert max(counts.values()) > 1  # the point: one sample, several indices
