# mmdet3d 1.x configs/_base_/datasets/nus-3d.py, shortened: an MMEngine-style dataset base (4 samples per GPU).
dataset_type = 'NuScenesDataset'
data_root = 'data/nuscenes/'
train_dataloader = dict(
    batch_size=4,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type='DefaultSampler', shuffle=True),
    dataset=dict(type=dataset_type, data_root=data_root, ann_file='nuscenes_infos_train.pkl'))
val_dataloader = dict(batch_size=1, num_workers=1, dataset=dict(type=dataset_type, data_root=data_root))
test_dataloader = val_dataloader
