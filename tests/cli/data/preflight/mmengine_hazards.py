# An MMEngine config with every config-level fp16 hazard `petr-stability check` knows (test fixture).
default_scope = 'mmdet3d'
model = dict(
    type='PETR',
    img_backbone=dict(type='VoVNetCP', spec_name='V-99-eSE', norm_eval=True, drop_path_rate=0.1),
    img_neck=dict(type='CPFPN', in_channels=[768, 1024], out_channels=256, num_outs=2,
                  norm_cfg=dict(type='BN2d', requires_grad=True)),
    pts_bbox_head=dict(
        type='PETRHead',
        transformer=dict(
            type='PETRTransformer',
            decoder=dict(
                type='PETRTransformerDecoder',
                num_layers=6,
                transformerlayers=dict(
                    type='PETRTransformerDecoderLayer',
                    attn_cfgs=[
                        dict(type='MultiheadAttention', embed_dims=256, num_heads=8, attn_drop=0.1),
                        dict(type='PETRMultiheadFlashAttention', embed_dims=256, num_heads=8, attn_drop=0.1),
                    ],
                    feedforward_channels=2048,
                    ffn_dropout=0.1,
                    operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm')),
            )),
    ),
)
optim_wrapper = dict(
    type='AmpOptimWrapper',
    loss_scale=512.,
    optimizer=dict(type='AdamW', lr=2e-4, weight_decay=0.01))
auto_scale_lr = dict(enable=False, base_batch_size=16)
train_dataloader = dict(batch_size=1, num_workers=4)
train_cfg = dict(by_epoch=True, max_epochs=24, val_interval=24)
default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=2, max_keep_ckpts=1))
custom_hooks = [dict(type='mmdet.CheckInvalidLossHook', interval=50), dict(type='NanGuardHook')]
