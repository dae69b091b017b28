"""Data quarantine: the skip list, the sampler wrapper that honours it, and sample ids pulled from batches."""
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from petr_stability.core.samples import named_samples, resolve_indices, sample_ids
from petr_stability.core.skiplist import QuarantineSampler, SkipList
from petr_stability.core.tracking import SampleTracker
from petr_stability.testing.data import ListDataset


# ---------------------------------------------------------------------- SkipList
def test_skip_list_bound_is_a_fraction_of_the_dataset_and_at_least_one():
    assert SkipList(100).capacity == 1 and SkipList(28130).capacity == 28
    assert SkipList(1000, max_fraction=0.01).capacity == 10
    skips = SkipList(2000)  # 0.1% of 2000 = 2
    assert skips.add([5], {"iteration": 10, "ids": [{"token": "a"}]})
    assert skips.add([5])  # already there: nothing new, still within the bound
    assert not skips.add([6, 7])  # would make 3 of 2: refused, nothing added (the run is structural)
    assert list(skips) == [5] and 6 not in skips
    assert skips.add([6]) and len(skips) == 2 and skips.full
    assert skips.meta(5) == {"iteration": 10, "ids": [{"token": "a"}]}


def test_skip_list_round_trip_and_validation():
    skips = SkipList(5000)
    skips.add([3, 9], {"iteration": 4})
    again = SkipList(5000)
    again.load_state_dict(pickle.loads(pickle.dumps(skips.state_dict())))
    assert list(again) == [3, 9] and again.meta(9) == {"iteration": 4} and again.state_dict() == skips.state_dict()
    old = SkipList(5000)
    old.load_state_dict({})  # a checkpoint from before quarantine existed
    assert len(old) == 0
    with pytest.raises(ValueError, match="dataset_size must be an integer >= 0, got -1"):
        SkipList(-1)
    with pytest.raises(ValueError, match="max_fraction must be a number in .0, 1., got 2"):
        SkipList(10, max_fraction=2)
    with pytest.raises(ValueError, match="dataset index must be an integer in .0, 10., got 12"):
        SkipList(10).add([12])


# ---------------------------------------------------------------------- QuarantineSampler
def test_same_length_and_substitutes_the_previous_healthy_index():
    sampler = QuarantineSampler(SequentialSampler(range(8)), {2, 3, 7})
    assert len(sampler) == 8
    assert list(sampler) == [0, 1, 1, 1, 4, 5, 6, 6]
    assert sampler.replaced == 3


def test_leading_quarantined_indices_take_the_next_healthy_one_and_all_quarantined_raises():
    assert list(QuarantineSampler(SequentialSampler(range(5)), {0, 1})) == [2, 2, 2, 3, 4]
    with pytest.raises(RuntimeError, match="all 3 indices this sampler yielded are quarantined"):
        list(QuarantineSampler(SequentialSampler(range(3)), {0, 1, 2}))


def test_wrapping_a_shuffled_sampler_changes_only_the_quarantined_positions():
    base = RandomSampler(range(50), generator=torch.Generator().manual_seed(3))
    plain = list(base)
    base.generator.manual_seed(3)
    skips = SkipList(50, max_fraction=0.1)
    skips.add([plain[10], plain[20]])
    wrapped = list(QuarantineSampler(base, skips))
    assert len(wrapped) == 50 and plain[10] not in wrapped and plain[20] not in wrapped
    assert [i for i, (a, b) in enumerate(zip(plain, wrapped)) if a != b] == [10, 20]
    assert wrapped[10] == plain[9] and wrapped[20] == plain[19]


def test_distributed_ranks_stay_in_lockstep_and_set_epoch_is_forwarded():
    ranks = [QuarantineSampler(DistributedSampler(range(10), num_replicas=2, rank=r, shuffle=True, seed=1), {0, 1, 2})
             for r in range(2)]
    for q in ranks:
        q.set_epoch(4)  # forwarded to DistributedSampler: the epoch's permutation
        assert q.epoch == 4 and q.num_replicas == 2  # other attributes too
    out = [list(q) for q in ranks]
    assert [len(o) for o in out] == [5, 5] and not {0, 1, 2} & set(out[0] + out[1])
    assert not hasattr(QuarantineSampler(SequentialSampler(range(2)), set()), "set_epoch")
    with pytest.raises(AttributeError, match="nothing_here"):
        _ = ranks[0].nothing_here


class EachSlotWalksAScene:
    """StreamPETR's InfiniteGroupEachSampleInBatchSampler shape (finite here): slot j walks scene j frame by frame."""

    def __init__(self, scenes, steps):
        self.scenes, self.steps = scenes, steps

    def __iter__(self):
        for t in range(self.steps):
            yield [scene[t] for scene in self.scenes]

    def __len__(self):
        return self.steps


def test_batch_samplers_replace_a_frame_by_the_same_slots_previous_frame():
    scenes = [[0, 1, 2, 3], [10, 11, 12, 13]]
    wrapped = QuarantineSampler(EachSlotWalksAScene(scenes, 4), {2, 10})
    assert list(wrapped) == [[0, 11], [1, 11], [1, 12], [3, 13]]  # slot 1's first frame: the batch's healthy one
    assert len(wrapped) == 4 and wrapped.replaced == 2


def test_pickles_with_its_sampler_and_skip_list():
    skips = SkipList(1000)
    skips.add([1])
    q = pickle.loads(pickle.dumps(QuarantineSampler(SequentialSampler(range(4)), skips)))
    assert list(q) == [0, 0, 2, 3]


def test_install_wraps_the_loaders_index_source_and_later_additions_take_effect():
    data = ListDataset([{"x": torch.tensor(float(i)), "sample_idx": i} for i in range(6)])
    loader = DataLoader(data, batch_size=2, shuffle=False)
    skips = SkipList(6, max_fraction=0.5)
    tracker = SampleTracker(skips)
    assert tracker.install(loader) and tracker.install(loader)  # idempotent
    assert isinstance(loader.batch_sampler, QuarantineSampler)
    assert not isinstance(loader.batch_sampler.wrapped, QuarantineSampler)
    assert [b["sample_idx"].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    skips.add([3])  # quarantined later: the next pass over the loader honours it (the same slot of the last batch)
    assert [b["sample_idx"].tolist() for b in loader] == [[0, 1], [2, 1], [4, 5]]
    # A loader built around a batch sampler with no inner sampler: the batch sampler itself is wrapped.
    custom = DataLoader(data, batch_sampler=EachSlotWalksAScene([[0, 1, 2], [3, 4, 5]], 3))
    SampleTracker(skips).install(custom)
    assert [b["sample_idx"].tolist() for b in custom] == [[0, 4], [1, 4], [2, 5]]
    # A batch sampler built by hand around a sampler; its inner sampler stays reachable (DistSamplerSeedHook).
    manual = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 3, drop_last=False))
    SampleTracker(skips).install(manual)
    assert isinstance(manual.batch_sampler.sampler, SequentialSampler)
    assert [b["sample_idx"].tolist() for b in manual] == [[0, 1, 2], [0, 4, 5]]


# ---------------------------------------------------------------------- sample ids
class DataContainer:
    """MMCV 1.x's DataContainer layout: ``data`` (a list per GPU) and ``cpu_only``."""

    def __init__(self, data):
        self.data, self.cpu_only = data, True


def test_sample_ids_from_mmcv1_mmengine_and_plain_batches():
    mmcv1 = {"img": torch.zeros(2, 3), "img_metas": DataContainer([[
        {"sample_idx": "tok-a", "scene_token": "scene-1", "filename": "x.jpg"},
        {"sample_idx": "tok-b", "scene_token": "scene-2", "prev_exists": True}]])}
    assert sample_ids(mmcv1) == [{"sample_idx": "tok-a", "scene_token": "scene-1"},
                                 {"sample_idx": "tok-b", "scene_token": "scene-2"}]
    mmengine = {"inputs": [torch.zeros(1)], "data_samples": [
        SimpleNamespace(metainfo={"sample_idx": 7, "token": "t7", "lidar_path": "p"})]}
    assert sample_ids(mmengine) == [{"sample_idx": 7, "token": "t7"}]
    collated = {"inputs": torch.zeros(2, 3), "sample_idx": torch.tensor([3, 5]), "index": [30, 50]}
    assert sample_ids(collated) == [{"index": 30, "sample_idx": 3}, {"index": 50, "sample_idx": 5}]
    raw = [{"inputs": torch.zeros(1), "idx": 4}, {"inputs": torch.zeros(1), "idx": 9}]
    assert sample_ids(raw) == [{"index": 4}, {"index": 9}]
    assert sample_ids({"inputs": torch.zeros(2)}) == [] and sample_ids(torch.zeros(2)) == []


class Infos:
    """An MMCV 1.x dataset (``data_infos``) wrapped by mmdet3d's CBGSDataset (``sample_indices``)."""

    def __init__(self):
        self.data_infos = [{"token": f"t{i}", "scene_token": f"s{i // 2}"} for i in range(4)]

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.data_infos[i]


class CBGS:
    def __init__(self, dataset):
        self.dataset = dataset
        self.sample_indices = [0, 1, 1, 2, 3, 1]

    def __len__(self):
        return len(self.sample_indices)

    def __getitem__(self, i):
        return self.dataset[self.sample_indices[i]]


class Serialized:
    """An MMEngine BaseDataset with serialize_data=True: infos only through get_data_info."""

    def __len__(self):
        return 3

    def get_data_info(self, i):
        return {"sample_idx": 100 + i, "token": f"m{i}"}


def test_resolve_indices_maps_ids_to_every_dataset_index_that_serves_them():
    assert resolve_indices(Infos(), [{"sample_idx": "t2"}, {"token": "t3"}]) == [2, 3]  # StreamPETR's sample_idx
    assert resolve_indices(CBGS(Infos()), [{"sample_idx": "t1"}]) == [1, 2, 5]  # every repeat of the sample
    assert resolve_indices(Serialized(), [{"sample_idx": 101}, {"token": "m2"}, {"token": "gone"}]) == [1, 2]
    assert resolve_indices(None, [{"index": 4}, {"index": 4}]) == [4]


def test_a_sample_named_by_index_takes_its_token_from_the_datasets_own_info():
    # StreamPETR's img_metas carry scene_token only; its nuScenes token is in data_infos at the sample's index.
    batch = {"img": torch.zeros(2, 3), "img_metas": DataContainer([[{"scene_token": "s1"}, {"scene_token": "s0"}]])}
    assert named_samples([3, 1], batch, Infos()) == [{"scene_token": "s1", "index": 3, "token": "t3"},
                                                      {"scene_token": "s0", "index": 1, "token": "t1"}]
    assert named_samples([3, 1], batch) == [{"scene_token": "s1", "index": 3}, {"scene_token": "s0", "index": 1}]
    # An MMEngine dataset (get_data_info); ids the batch carries are kept as they are, not looked up again.
    carried = {"inputs": torch.zeros(1), "data_samples": [SimpleNamespace(metainfo={"sample_idx": 7})]}
    assert named_samples([2], carried, Serialized()) == [{"sample_idx": 7, "index": 2}]
    assert named_samples([2], {"inputs": torch.zeros(1)}, Serialized()) == [{"index": 2, "sample_idx": 102,
                                                                              "token": "m2"}]
    # A wrapper without infos of its own, an index past the infos, a plain Dataset: the index alone.
    assert named_samples([5], None, CBGS(Infos())) == [{"index": 5}]
    assert named_samples([9], None, Infos()) == [{"index": 9}]
    assert named_samples([0], None, ListDataset([torch.zeros(1)])) == [{"index": 0}]


def test_mmengine_default_and_infinite_samplers():
    samplers = pytest.importorskip("mmengine.dataset.sampler")
    data = list(range(12))
    default = QuarantineSampler(samplers.DefaultSampler(data, shuffle=True, seed=5), {4, 7})
    default.set_epoch(2)  # what MMEngine's loops call: reaches the wrapped sampler
    plain = samplers.DefaultSampler(data, shuffle=True, seed=5)
    plain.set_epoch(2)
    assert default.epoch == 2 and len(default) == len(plain) == 12
    got, want = list(default), list(plain)
    assert not {4, 7} & set(got)
    assert [i for i, (g, w) in enumerate(zip(got, want)) if g != w] == sorted([want.index(4), want.index(7)])
    infinite = QuarantineSampler(samplers.InfiniteSampler(data, shuffle=False), {0, 5})
    it = iter(infinite)
    assert [next(it) for _ in range(14)] == [1, 1, 2, 3, 4, 4, 6, 7, 8, 9, 10, 11, 11, 1]


# ---------------------------------------------------------------------- the batch in hand, by dataset index
class Plain(torch.utils.data.Dataset):
    """The PyTorch default: a map-style dataset with nothing but tensors (no ids, no infos)."""

    def __init__(self, n=10):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((2,), float(i))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_tracker_names_each_batch_by_dataset_index_with_prefetching_workers(workers):
    loader = DataLoader(Plain(), batch_size=3, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(3))
    tracker = SampleTracker(set())
    assert tracker.install(loader)
    for _ in range(2):  # two epochs: a new iterator (and new workers) each time
        for batch in loader:
            assert tracker.current() == [int(v) for v in batch[:, 0]]


def test_persistent_workers_and_an_infinite_sampler_keep_their_indices_aligned():
    class Infinite(torch.utils.data.Sampler):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            while True:
                yield from torch.randperm(10, generator=g).tolist()

    loader = DataLoader(Plain(), batch_size=4, sampler=Infinite(), num_workers=2, persistent_workers=True)
    tracker = SampleTracker(set())
    tracker.install(loader)
    it = iter(loader)
    for _ in range(7):  # past a pass over the data: the indices keep naming the batch in hand
        batch = next(it)
        assert tracker.current() == [int(v) for v in batch[:, 0]]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterator_made_before_the_tracker_is_adopted_where_it_stands(workers):
    # MMEngine's IterBasedTrainLoop and MMCV 1.x's IterBasedRunner make (and draw from) their iterator first.
    loader = DataLoader(Plain(20), batch_size=2, shuffle=False, num_workers=workers)
    it = iter(loader)
    first = next(it)
    tracker = SampleTracker({17})
    tracker.install(loader)
    tracker.adopt(it)
    assert tracker.current() is None and first[:, 0].tolist() == [0, 1]  # drawn before: unknown, never wrong
    seen = []
    for batch in it:
        names = tracker.current()
        assert names is None or names == [int(v) for v in batch[:, 0]]
        seen.append(names)
    assert seen[-1] == [18, 19] and [16, 15] in seen  # quarantined 17 replaced by its slot's previous index
    assert all(names is not None for names in seen[2 * workers:])  # only the prefetched batches are unknown
    assert tracker.install(loader) and [tracker.current() for _ in iter(loader)][:1] == [[0, 1]]


def test_an_iterable_dataset_is_said_to_have_no_indices():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([torch.zeros(1)] * 4)

    tracker = SampleTracker(set())
    assert not tracker.install(DataLoader(Stream(), batch_size=2))
    assert "IterableDataset" in tracker.unknowable and tracker.current() is None

