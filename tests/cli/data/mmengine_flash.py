# mmdet3d 1.x PETR-shaped MMEngine config (test fixture) with fp16 (a static scale), flash cross-attention, an
# absolute lr floor, a momentum schedule (never scaled) and the guard in custom_hooks.
_base_ = ['./_base_/petr_model.py']
model = dict(
    pts_bbox_head=dict(
        transformer=dict(
            decoder=dict(
                transformerlayers=dict(
                    attn_cfgs=[
                        dict(type='MultiheadAttention', embed_dims=256, num_heads=8, attn_drop=0.1,
                             dropout_layer=dict(type='Dropout', drop_prob=0.1)),
                        dict(type='PETRMultiheadFlashAttention', embed_dims=256, num_heads=8, attn_drop=0.1,
                             dropout_layer=dict(type='Dropout', drop_prob=0.1)),
                    ])))))
train_dataloader = dict(batch_size=1, num_workers=4)
optim_wrapper = dict(
    type='AmpOptimWrapper',
    loss_scale=512.,
    optimizer=dict(type='AdamW', lr=2e-4, weight_decay=0.01),
    paramwise_cfg=dict(custom_keys={'img_backbone': dict(lr_mult=0.1)}),
    clip_grad=dict(max_norm=35, norm_type=2))
param_scheduler = [
    dict(type='LinearLR', start_factor=1.0 / 3, begin=0, end=500, by_epoch=False),
    dict(type='CosineAnnealingLR', T_max=24, eta_min=2e-7, by_epoch=True),
    dict(type='CosineAnnealingMomentum', T_max=24, eta_min=0.85 / 0.95, by_epoch=True),
]
train_cfg = dict(by_epoch=True, max_epochs=24, val_interval=24)
custom_hooks = [dict(type='NanGuardHook', snapshot_interval=200)]
