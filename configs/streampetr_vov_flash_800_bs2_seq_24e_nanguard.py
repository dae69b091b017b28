# StreamPETR (MMCV 1.x), shaped like projects/configs/StreamPETR/stream_petr_vov_flash_800_bs2_seq_24e.py:
# dynamic loss scale, flash attention in the temporal decoder, iteration-based runner; NanGuardHook added.
plugin = True
plugin_dir = 'projects/mmdet3d_plugin/'
custom_imports = dict(imports=['petr_stability'], allow_failed_imports=False)

num_gpus = 8
batch_size = 2
num_iters_per_epoch = 28130 // (num_gpus * batch_size)
num_epochs = 24

model = dict(
    type='Petr3D',
    num_frame_head_grads=1,
    num_frame_backbone_grads=1,
    num_frame_losses=1,
    use_grid_mask=True,
    img_backbone=dict(type='VoVNet', spec_name='V-99-eSE', norm_eval=True, frozen_stages=-1, input_ch=3,
                      out_features=('stage4', 'stage5')),
    img_neck=dict(type='CPFPN', in_channels=[768, 1024], out_channels=256, num_outs=2),
    pts_bbox_head=dict(
        type='StreamPETRHead',
        num_classes=10,
        in_channels=256,
        num_query=644,
        memory_len=1024,
        topk_proposals=256,
        num_propagated=256,
        with_ego_pos=True,
        match_with_velo=False,
        scalar=10,
        noise_scale=1.0,
        dn_weight=1.0,
        split=0.75,
        LID=True,
        with_position=True,
        position_range=[-61.2, -61.2, -10.0, 61.2, 61.2, 10.0],
        transformer=dict(
            type='PETRTemporalTransformer',
            decoder=dict(
                type='PETRTransformerDecoder',
                return_intermediate=True,
                num_layers=6,
                transformerlayers=dict(
                    type='PETRTemporalDecoderLayer',
                    attn_cfgs=[
                        dict(type='MultiheadAttention', embed_dims=256, num_heads=8, dropout=0.1),
                        dict(type='PETRMultiheadFlashAttention', embed_dims=256, num_heads=8, dropout=0.1),
                    ],
                    feedforward_channels=2048,
                    ffn_dropout=0.1,
                    with_cp=True,
                    operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm')),
            )),
        loss_cls=dict(type='FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0),
        loss_bbox=dict(type='L1Loss', loss_weight=0.25),
        loss_iou=dict(type='GIoULoss', loss_weight=0.0)))

optimizer = dict(type='AdamW', lr=4e-4, paramwise_cfg=dict(custom_keys={'img_backbone': dict(lr_mult=0.25)}),
                 weight_decay=0.01)
optimizer_config = dict(type='Fp16OptimizerHook', loss_scale='dynamic', grad_clip=dict(max_norm=35, norm_type=2))
lr_config = dict(policy='CosineAnnealing', warmup='linear', warmup_iters=500, warmup_ratio=1.0 / 3,
                 min_lr_ratio=1e-3)
runner = dict(type='IterBasedRunner', max_iters=num_epochs * num_iters_per_epoch)
checkpoint_config = dict(interval=num_iters_per_epoch, max_keep_ckpts=3)
log_config = dict(interval=50, hooks=[dict(type='TextLoggerHook'), dict(type='TensorboardLoggerHook')])
find_unused_parameters = False

custom_hooks = [
    dict(type='NanGuardHook'),
    # Fire drill, off (the first NaN is rolled back alone, the second gets the known manual fix):
    # dict(type='FaultInjectionHook', faults=[dict(kind='weights', iters=[3000, 3002], value='nan')]),
]
