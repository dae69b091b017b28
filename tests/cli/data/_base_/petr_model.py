# mmdet3d 1.x projects/PETR style model (MMCV 2 spellings).
_dim_ = 256
model = dict(
    type='PETR',
    img_backbone=dict(type='VoVNetCP', spec_name='V-99-eSE', drop_path_rate=0.1, out_features=('stage4', 'stage5')),
    img_neck=dict(type='CPFPN', in_channels=[768, 1024], out_channels=_dim_, num_outs=2, dropout=0.2),
    pts_bbox_head=dict(
        type='PETRHead',
        num_query=900,
        transformer=dict(
            type='PETRTransformer',
            decoder=dict(
                type='PETRTransformerDecoder',
                return_intermediate=True,
                num_layers=6,
                transformerlayers=dict(
                    type='PETRTransformerDecoderLayer',
                    attn_cfgs=[
                        dict(type='MultiheadAttention', embed_dims=_dim_, num_heads=8, attn_drop=0.1,
                             dropout_layer=dict(type='Dropout', drop_prob=0.1)),
                        dict(type='PETRMultiheadAttention', embed_dims=_dim_, num_heads=8, attn_drop=0.1,
                             proj_drop=0.1, dropout_layer=dict(type='Dropout', drop_prob=0.1)),
                    ],
                    ffn_cfgs=dict(embed_dims=_dim_, feedforward_channels=2048, ffn_drop=0.1),
                    feedforward_channels=2048,
                    ffn_dropout=0.1,
                    with_cp=True,
                    operation_order=('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm')),
            )),
        loss_cls=dict(type='mmdet.FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0),
    ),
)
