# The same model and schedule without any of the hazards (test fixture): every check stays quiet.
default_scope = 'mmdet3d'
model = dict(
    type='PETR',
    img_backbone=dict(type='VoVNetCP', spec_name='V-99-eSE', norm_eval=True, drop_path_rate=0.1,
                      norm_cfg=dict(type='BN', requires_grad=True)),
    img_neck=dict(type='CPFPN', in_channels=[768, 1024], out_channels=256, num_outs=2,
                  norm_cfg=dict(type='SyncBN', requires_grad=True)),
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
                        dict(type='MultiheadAttention', embed_dims=256, num_heads=8, attn_drop=0.0),
                        dict(type='PETRMultiheadAttention', embed_dims=256, num_heads=8, attn_drop=0.0),
                    ],
                    feedforward_channels=2048,
                    ffn_dropout=0.0,
                    operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm')),
            )),
    ),
)
optim_wrapper = dict(
    type='AmpOptimWrapper',
    loss_scale='dynamic',
    optimizer=dict(type='AdamW', lr=2e-4, weight_decay=0.01),
    clip_grad=dict(max_norm=35, norm_type=2))
auto_scale_lr = dict(enable=True, base_batch_size=16)
train_dataloader = dict(batch_size=1, num_workers=4)
train_cfg = dict(by_epoch=True, max_epochs=24, val_interval=24)
default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=3))
custom_hooks = [dict(type='NanGuardHook')]
