# mmdet3d 1.4 projects/PETR/configs/petr_vovnet_gridmask_p4_800x320.py, shortened: it inherits a schedule file
# written for another model (lr 1e-4, auto_scale_lr base 32 = 8 x 4) and sets its own lr (2e-4) and batch (1).
_base_ = ['./_base_/mmengine_nus_3d.py', './_base_/mmengine_runtime.py', './_base_/mmengine_cyclic_20e.py']
model = dict(
    type='PETR',
    img_backbone=dict(type='VoVNetCP', spec_name='V-99-eSE', norm_eval=True, drop_path_rate=0.1),
    img_neck=dict(type='CPFPN', in_channels=[768, 1024], out_channels=256, num_outs=2),
    pts_bbox_head=dict(type='PETRHead', num_query=900))
train_dataloader = dict(batch_size=1, num_workers=4)
optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=2e-4, weight_decay=0.01),
    paramwise_cfg=dict(custom_keys={'img_backbone': dict(lr_mult=0.1)}),
    clip_grad=dict(max_norm=35, norm_type=2))
num_epochs = 24
param_scheduler = [
    dict(type='LinearLR', start_factor=1.0 / 3, begin=0, end=500, by_epoch=False),
    dict(type='CosineAnnealingLR', T_max=num_epochs, by_epoch=True)]
train_cfg = dict(max_epochs=num_epochs, val_interval=num_epochs)
default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=3))
