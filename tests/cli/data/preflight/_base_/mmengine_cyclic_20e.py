# mmdet3d 1.x configs/_base_/schedules/cyclic-20e.py, shortened: a schedule written for another model's lr
# (1e-4 at 8 GPUs x 4 samples), with its own auto_scale_lr.
lr = 1e-4
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=lr, weight_decay=0.01),
    clip_grad=dict(max_norm=35, norm_type=2))
param_scheduler = [
    dict(type='CosineAnnealingLR', T_max=8, eta_min=lr * 10, begin=0, end=8, by_epoch=True),
    dict(type='CosineAnnealingLR', T_max=12, eta_min=lr * 1e-4, begin=8, end=20, by_epoch=True),
    dict(type='CosineAnnealingMomentum', T_max=8, eta_min=0.85 / 0.95, begin=0, end=8, by_epoch=True),
]
train_cfg = dict(by_epoch=True, max_epochs=20, val_interval=20)
# `base_batch_size` = (8 GPUs) x (4 samples per GPU).
auto_scale_lr = dict(enable=False, base_batch_size=32)
