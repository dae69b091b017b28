# megvii-research/PETR style (MMCV 1.x): one `dropout` per attention, transformerlayers as a list.
plugin = True
plugin_dir = 'projects/mmdet3d_plugin/'
model = dict(
    type='Petr3D',
    img_backbone=dict(type='VoVNetCP', spec_name='V-99-eSE', norm_eval=True, drop_path_rate=0.2),
    pts_bbox_head=dict(
        type='PETRHead',
        transformer=dict(
            type='PETRTransformer',
            decoder=dict(
                type='PETRTransformerDecoder',
                num_layers=6,
                transformerlayers=[
                    dict(
                        type='PETRTransformerDecoderLayer',
                        attn_cfgs=[
                            dict(type='MultiheadAttention', embed_dims=256, num_heads=8, dropout=0.1),
                            dict(type='PETRMultiheadAttention', embed_dims=256, num_heads=8, dropout=0.1),
                        ],
                        feedforward_channels=2048,
                        ffn_dropout=0.1,
                        with_cp=True,
                        operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm')),
                ],
            )),
    ),
)
optimizer = dict(type='AdamW', lr=2e-4, weight_decay=0.01)
optimizer_config = dict(type='Fp16OptimizerHook', loss_scale=512., grad_clip=dict(max_norm=35, norm_type=2))
