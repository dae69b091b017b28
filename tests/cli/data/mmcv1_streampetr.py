# StreamPETR-shaped MMCV 1.x config (test fixture): flash cross-attention, a static fp16 loss scale, an absolute
# lr floor, and the guard in custom_hooks -- every place a ConfigFix writes to.
_base_ = './_base_/mmcv1_runtime.py'
num_gpus = 8
batch_size = 2
model = dict(
    type='Petr3D',
    img_backbone=dict(type='ResNet', depth=50, norm_eval=True, drop_path_rate=0.1),
    img_neck=dict(type='CPFPN', in_channels=[1024, 2048], out_channels=256, num_outs=2),
    pts_bbox_head=dict(
        type='StreamPETRHead',
        num_query=428,
        transformer=dict(
            type='PETRTemporalTransformer',
            decoder=dict(
                type='PETRTransformerDecoder',
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
                    operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm'))))))
data = dict(samples_per_gpu=batch_size, workers_per_gpu=4)
optimizer = dict(type='AdamW', lr=4e-4, paramwise_cfg=dict(custom_keys={'img_backbone': dict(lr_mult=0.1)}),
                 weight_decay=0.01)
optimizer_config = dict(type='Fp16OptimizerHook', loss_scale=512., grad_clip=dict(max_norm=35, norm_type=2))
lr_config = dict(policy='CosineAnnealing', warmup='linear', warmup_iters=500, warmup_ratio=1.0 / 3, min_lr=4e-7)
custom_hooks = [dict(type='NanGuardHook', snapshot_interval=200)]
