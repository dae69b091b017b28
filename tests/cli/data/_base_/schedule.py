optim_wrapper = dict(
    type='AmpOptimWrapper',
    loss_scale='dynamic',
    optimizer=dict(type='AdamW', lr=2e-4, weight_decay=0.01),
    paramwise_cfg=dict(custom_keys={'img_backbone': dict(lr_mult=0.1)}),
    clip_grad=dict(max_norm=35, norm_type=2))
param_scheduler = [dict(type='LinearLR', start_factor=1.0 / 3, by_epoch=False, begin=0, end=500)]
train_cfg = dict(by_epoch=True, max_epochs=24, val_interval=24)
