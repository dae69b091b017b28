# StreamPETR's stream_petr_r50_flash_704_bs2_seq_428q_nui_60e.py, shortened: an MMCV 1.x config whose `_base_`
# paths reach an mmdet3d 1.x checkout, so it also inherits train_dataloader.batch_size=4 it never trains with.
_base_ = ['./_base_/mmengine_nus_3d.py', './_base_/mmengine_runtime.py']
num_gpus = 8
batch_size = 2
num_iters_per_epoch = 28130 // (num_gpus * batch_size)
num_epochs = 60
model = dict(
    type='Petr3D',
    img_backbone=dict(type='ResNet', depth=50, norm_cfg=dict(type='BN2d', requires_grad=False), norm_eval=True),
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
                        dict(type='MultiheadAttention', embed_dims=256, num_heads=8, dropout=0.0),
                        dict(type='PETRMultiheadFlashAttention', embed_dims=256, num_heads=8, dropout=0.0),
                    ],
                    feedforward_channels=2048,
                    ffn_dropout=0.0,
                    operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm'))))))
data = dict(samples_per_gpu=batch_size, workers_per_gpu=4)
optimizer = dict(
    type='AdamW',
    lr=4e-4,  # bs 8: 2e-4 || bs 16: 4e-4
    paramwise_cfg=dict(custom_keys={'img_backbone': dict(lr_mult=0.1)}),
    weight_decay=0.01)
optimizer_config = dict(type='Fp16OptimizerHook', loss_scale='dynamic', grad_clip=dict(max_norm=35, norm_type=2))
lr_config = dict(policy='CosineAnnealing', warmup='linear', warmup_iters=500, warmup_ratio=1.0 / 3,
                 min_lr_ratio=1e-3)
checkpoint_config = dict(interval=num_iters_per_epoch, max_keep_ckpts=3)
runner = dict(type='IterBasedRunner', max_iters=num_epochs * num_iters_per_epoch)
