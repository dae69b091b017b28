# mmdet3d 1.4 projects/PETR (MMEngine), shaped like projects/PETR/configs/petrv2_vovnet_gridmask_p4_800x320.py:
# fp32 OptimWrapper (its AMP line is commented out upstream), where a NaN gradient is applied at once.
default_scope = 'mmdet3d'
custom_imports = dict(imports=['projects.PETR.petr', 'petr_stability'], allow_failed_imports=False)

model = dict(
    type='PETR',
    use_grid_mask=True,
    img_backbone=dict(type='VoVNetCP', spec_name='V-99-eSE', norm_eval=True, frozen_stages=-1, input_ch=3,
                      out_features=('stage4', 'stage5')),
    img_neck=dict(type='CPFPN', in_channels=[768, 1024], out_channels=256, num_outs=2),
    pts_bbox_head=dict(
        type='PETRHead',
        num_classes=10,
        in_channels=256,
        num_query=900,
        LID=True,
        with_position=True,
        with_multiview=True,
        with_fpe=True,
        with_time=True,
        with_multi=True,
        position_range=[-61.2, -61.2, -10.0, 61.2, 61.2, 10.0],
        transformer=dict(
            type='PETRTransformer',
            decoder=dict(
                type='PETRTransformerDecoder',
                return_intermediate=True,
                num_layers=6,
                transformerlayers=dict(
                    type='PETRTransformerDecoderLayer',
                    attn_cfgs=[
                        dict(type='MultiheadAttention', embed_dims=256, num_heads=8, attn_drop=0.1,
                             dropout_layer=dict(type='Dropout', drop_prob=0.1)),
                        dict(type='PETRMultiheadAttention', embed_dims=256, num_heads=8, attn_drop=0.1,
                             dropout_layer=dict(type='Dropout', drop_prob=0.1)),
                    ],
                    feedforward_channels=2048,
                    ffn_dropout=0.1,
                    with_cp=True,
                    operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm')),
            )),
        loss_cls=dict(type='mmdet.FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0),
        loss_bbox=dict(type='mmdet.L1Loss', loss_weight=0.25),
        loss_iou=dict(type='mmdet.GIoULoss', loss_weight=0.0)))

optim_wrapper = dict(
    # type='AmpOptimWrapper',
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-4, weight_decay=0.01),
    paramwise_cfg=dict(custom_keys={'img_backbone': dict(lr_mult=0.1)}),
    clip_grad=dict(max_norm=35, norm_type=2))

num_epochs = 24
param_scheduler = [
    dict(type='LinearLR', start_factor=1.0 / 3, by_epoch=False, begin=0, end=500),
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, end=num_epochs, T_max=num_epochs, eta_min_ratio=1e-3,
         convert_to_iter_based=True),
]
train_cfg = dict(by_epoch=True, max_epochs=num_epochs, val_interval=num_epochs)
default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=3))

custom_hooks = [
    dict(type='NanGuardHook'),
    # Fire drill, off: dict(type='FaultInjectionHook', faults=[dict(kind='grads', iters=[2000], value='nan')]),
]
