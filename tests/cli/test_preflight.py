"""petr-stability check: each pre-flight check fires on its hazard and stays quiet without it; real configs; CLI."""
import copy
import os

import pytest

from petr_stability.cli import main
from petr_stability.configfix import (
    CHECKS,
    Finding,
    check_config,
    check_file,
    check_runner_config,
    format_findings,
    load_config,
    log_findings,
)

HERE = os.path.dirname(__file__)
DATA = os.path.join(HERE, "data", "preflight")
CONFIGS = os.path.join(HERE, "..", "..", "configs")
PETR = os.path.join(CONFIGS, "petr_vovnet_gridmask_p4_800x320_nanguard.py")
STREAMPETR = os.path.join(CONFIGS, "streampetr_vov_flash_800_bs2_seq_24e_nanguard.py")
MMDET3D14 = os.path.join(CONFIGS, "mmdet3d14_petr_vovnet_fp32_nanguard.py")
FP16_CHECKS = {"static-loss-scale", "fp16-flash-attention"}


def _ids(findings):
    return sorted(f.check for f in findings)


def _one(findings, check):
    hits = [f for f in findings if f.check == check]
    assert len(hits) == 1, findings
    return hits[0]


def _head(attn="PETRMultiheadAttention", dropout=0.0):
    layer = dict(type="PETRTransformerDecoderLayer",
                 attn_cfgs=[dict(type="MultiheadAttention", embed_dims=256, num_heads=8, dropout=dropout),
                            dict(type=attn, embed_dims=256, num_heads=8, dropout=dropout)],
                 feedforward_channels=2048, ffn_dropout=dropout,
                 operation_order=("self_attn", "norm", "cross_attn", "norm", "ffn", "norm"))
    return dict(type="PETRHead", transformer=dict(
        type="PETRTransformer", decoder=dict(type="PETRTransformerDecoder", num_layers=6, transformerlayers=layer)))


def _model(**head_kwargs):
    return dict(type="Petr3D",
                img_backbone=dict(type="VoVNetCP", norm_eval=True, drop_path_rate=0.2),
                img_neck=dict(type="CPFPN", in_channels=[768, 1024], out_channels=256, num_outs=2),
                pts_bbox_head=_head(**head_kwargs))


def mmcv1_cfg():
    """A megvii PETR-shaped MMCV 1.x config without any hazard (dynamic fp16, clip, dropout 0)."""
    return dict(
        model=_model(),
        data=dict(samples_per_gpu=1, workers_per_gpu=4),
        optimizer=dict(type="AdamW", lr=2e-4, weight_decay=0.01),
        optimizer_config=dict(type="Fp16OptimizerHook", loss_scale="dynamic", grad_clip=dict(max_norm=35, norm_type=2)),
        runner=dict(type="EpochBasedRunner", max_epochs=24),
        checkpoint_config=dict(interval=1),
        custom_hooks=[dict(type="NanGuardHook")],
    )


def mmengine_cfg():
    """An mmdet3d 1.x PETR-shaped MMEngine config without any hazard."""
    return dict(
        model=_model(),
        train_dataloader=dict(batch_size=2, num_workers=4),
        optim_wrapper=dict(type="AmpOptimWrapper", loss_scale="dynamic",
                           optimizer=dict(type="AdamW", lr=2e-4, weight_decay=0.01),
                           clip_grad=dict(max_norm=35, norm_type=2)),
        train_cfg=dict(by_epoch=True, max_epochs=24),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1, max_keep_ckpts=3)),
        custom_hooks=[dict(type="NanGuardHook")],
    )


@pytest.mark.parametrize("make, world_size", [(mmcv1_cfg, None), (mmcv1_cfg, 8), (mmengine_cfg, None),
                                               (mmengine_cfg, 1), (mmengine_cfg, 8)])
def test_clean_configs_have_no_finding(make, world_size):
    cfg = make()
    before = copy.deepcopy(cfg)
    assert check_config(cfg, world_size=world_size) == []
    assert cfg == before  # read only


def test_every_finding_is_well_formed_and_ids_are_known():
    findings = check_config(load_config(os.path.join(DATA, "mmengine_hazards.py")), world_size=2)
    assert findings
    for f in findings:
        assert isinstance(f, Finding)
        assert f.check in CHECKS
        assert f.severity in ("warning", "info")
        assert f.key and f.why and f.fix
        assert "\n" not in f.why
    assert _ids(findings) == sorted([
        "auto-scale-lr-off", "static-loss-scale", "fp16-flash-attention", "bn-batch-one", "no-grad-clip",
        "transformer-dropout", "check-invalid-loss-hook", "rare-checkpoints", "single-checkpoint-kept"])
    assert check_config(load_config(os.path.join(DATA, "mmengine_clean.py")), world_size=2) == []


# ------------------------------------------------------------------------------------------- static loss scale
def test_static_loss_scale_mmcv1():
    cfg = mmcv1_cfg()
    cfg["optimizer_config"]["loss_scale"] = 512.0
    f = _one(check_config(cfg), "static-loss-scale")
    assert (f.severity, f.key, f.value) == ("warning", "optimizer_config.loss_scale", 512.0)
    assert "megvii-research/PETR#105" in f.why
    assert "dynamic" in f.fix


def test_static_loss_scale_default_and_fp16_dict():
    cfg = mmcv1_cfg()
    del cfg["optimizer_config"]["loss_scale"]  # Fp16OptimizerHook's own default is a static 512.
    f = _one(check_config(cfg), "static-loss-scale")
    assert (f.key, f.value) == ("optimizer_config.loss_scale", 512.0)
    assert "default" in f.why
    cfg = mmcv1_cfg()
    cfg["optimizer_config"] = dict(grad_clip=dict(max_norm=35, norm_type=2))
    cfg["fp16"] = dict(loss_scale=32.0)
    f = _one(check_config(cfg), "static-loss-scale")
    assert (f.key, f.value) == ("fp16.loss_scale", 32.0)
    cfg["fp16"] = dict(loss_scale=dict(init_scale=512.0, mode="dynamic"))
    assert check_config(cfg) == []


def test_static_loss_scale_mmengine():
    cfg = mmengine_cfg()
    cfg["optim_wrapper"]["loss_scale"] = 1024.0
    f = _one(check_config(cfg), "static-loss-scale")
    assert (f.key, f.value) == ("optim_wrapper.loss_scale", 1024.0)
    cfg["optim_wrapper"]["loss_scale"] = dict(init_scale=1024.0)
    assert check_config(cfg) == []
    cfg["optim_wrapper"].pop("loss_scale")  # AmpOptimWrapper's default is 'dynamic'
    assert check_config(cfg) == []


@pytest.mark.parametrize("wrapper", [dict(type="OptimWrapper"), dict(type="AmpOptimWrapper", dtype="bfloat16")])
def test_fp16_checks_never_fire_without_fp16(wrapper):
    cfg = mmengine_cfg()
    cfg["optim_wrapper"].update(wrapper, loss_scale=512.0)
    cfg["model"]["pts_bbox_head"] = _head(attn="PETRMultiheadFlashAttention")
    assert not FP16_CHECKS & set(_ids(check_config(cfg)))
    cfg = mmcv1_cfg()
    cfg["optimizer_config"] = dict(grad_clip=dict(max_norm=35, norm_type=2))  # plain OptimizerHook: fp32
    cfg["model"]["pts_bbox_head"] = _head(attn="PETRMultiheadFlashAttention")
    assert check_config(cfg) == []


# ------------------------------------------------------------------------------------------- flash attention
@pytest.mark.parametrize("attn", ["PETRMultiheadFlashAttention", "FlashMHA"])
def test_flash_attention_in_fp16(attn):
    cfg = mmcv1_cfg()
    cfg["model"]["pts_bbox_head"] = _head(attn=attn)
    f = _one(check_config(cfg), "fp16-flash-attention")
    assert f.severity == "warning"
    assert f.key == "model.pts_bbox_head.transformer.decoder.transformerlayers.attn_cfgs[1].type"
    assert f.value == attn
    assert "PETRMultiheadAttention" in f.fix


# ------------------------------------------------------------------------------------------- learning rate
def test_lr_written_for_declared_gpus():
    cfg = mmcv1_cfg()
    cfg.update(num_gpus=8, batch_size=2)
    cfg["data"]["samples_per_gpu"] = 2
    cfg["optimizer"]["lr"] = 4e-4
    f = _one(check_config(cfg, world_size=2), "lr-not-scaled")
    assert (f.severity, f.key, f.value) == ("warning", "optimizer.lr", 4e-4)
    assert "16" in f.why and "4" in f.why and "num_gpus=8" in f.why
    assert "0.0001" in f.fix
    assert check_config(cfg, world_size=8) == []
    assert check_config(cfg) == []  # world size unknown: no guess
    # --batch-per-gpu 8 on 2 GPUs is the total of 16 the lr was written for.
    assert check_config(cfg, world_size=2, batch_per_gpu=8) == []


def test_lr_bigger_batch_is_only_info():
    cfg = mmcv1_cfg()
    cfg.update(num_gpus=2, batch_size=1)
    f = _one(check_config(cfg, world_size=8), "lr-not-scaled")
    assert f.severity == "info"


def test_lr_petr_without_declaration_assumes_8_gpus():
    cfg = mmcv1_cfg()
    f = _one(check_config(cfg, world_size=4), "lr-not-scaled")
    assert f.severity == "warning"
    assert "8 GPUs" in f.why and "assum" in f.why
    assert "0.0001" in f.fix
    assert check_config(cfg, world_size=8) == []
    # Not a PETR-family model: nothing is assumed.
    cfg["model"]["type"] = "FasterRCNN"
    cfg["model"]["pts_bbox_head"]["type"] = "RPNHead"
    assert "lr-not-scaled" not in _ids(check_config(cfg, world_size=4))
    # No batch size anywhere: nothing to compare.
    cfg = mmcv1_cfg()
    del cfg["data"]
    assert check_config(cfg, world_size=4) == []


def test_total_batch_size_declaration():
    cfg = mmcv1_cfg()
    cfg.update(total_batch_size=2, num_gpus=1, batch_size=2)
    assert check_config(cfg, world_size=1, batch_per_gpu=2) == []
    f = _one(check_config(cfg, world_size=1, batch_per_gpu=1), "lr-not-scaled")
    assert "total_batch_size=2" in f.why


def test_auto_scale_lr():
    cfg = mmengine_cfg()
    cfg["auto_scale_lr"] = dict(enable=False, base_batch_size=16)
    f = _one(check_config(cfg, world_size=2), "auto-scale-lr-off")
    assert (f.severity, f.key, f.value) == ("warning", "auto_scale_lr.enable", False)
    assert "16" in f.why and "2 x 2 = 4" in f.why
    assert "lr-not-scaled" not in _ids(check_config(cfg, world_size=2))  # one finding per cause
    assert check_config(cfg, world_size=8) == []
    assert check_config(cfg) == []
    cfg["auto_scale_lr"]["enable"] = True
    assert check_config(cfg, world_size=2) == []
    cfg = mmengine_cfg()  # no auto_scale_lr, no declaration: MMEngine configs get no 8-GPU assumption
    assert check_config(cfg, world_size=2) == []


# ------------------------------------------------------------------------------------------- BatchNorm
@pytest.mark.parametrize("where", ["img_neck", "pts_bbox_head"])
@pytest.mark.parametrize("kind", ["BN", "BN2d", "BN1d"])
def test_bn_with_batch_one(where, kind):
    cfg = mmcv1_cfg()
    cfg["model"][where]["norm_cfg"] = dict(type=kind, requires_grad=True)
    f = _one(check_config(cfg), "bn-batch-one")
    assert (f.key, f.value) == (f"model.{where}.norm_cfg.type", kind)
    assert "SyncBN" in f.fix


def test_bn_quiet_cases():
    cfg = mmcv1_cfg()
    cfg["model"]["img_backbone"]["norm_cfg"] = dict(type="BN")  # backbone: not this check's business
    assert check_config(cfg) == []
    cfg["model"]["img_neck"]["norm_cfg"] = dict(type="BN2d")
    assert check_config(cfg, batch_per_gpu=2) == []
    for other in ("SyncBN", "GN", "LN", "naiveSyncBN2d"):
        cfg["model"]["img_neck"]["norm_cfg"] = dict(type=other)
        assert check_config(cfg) == [], other
    cfg = mmengine_cfg()
    cfg["train_dataloader"]["batch_size"] = 1
    cfg["model"]["img_neck"]["norm_cfg"] = dict(type="BN2d")
    assert _ids(check_config(cfg)) == ["bn-batch-one"]
    cfg["sync_bn"] = "torch"  # MMEngine's runner converts every BN
    assert check_config(cfg) == []
    cfg = mmcv1_cfg()
    del cfg["data"]  # batch unknown: no guess
    cfg["model"]["img_neck"]["norm_cfg"] = dict(type="BN2d")
    assert check_config(cfg) == []


# ------------------------------------------------------------------------------------------- gradient clipping
def test_no_grad_clip():
    cfg = mmcv1_cfg()
    cfg["optimizer_config"]["grad_clip"] = None
    f = _one(check_config(cfg), "no-grad-clip")
    assert (f.severity, f.key, f.value) == ("warning", "optimizer_config.grad_clip", None)
    assert "max_norm" in f.fix
    cfg = mmengine_cfg()
    del cfg["optim_wrapper"]["clip_grad"]
    assert _one(check_config(cfg), "no-grad-clip").key == "optim_wrapper.clip_grad"
    cfg["optim_wrapper"]["clip_grad"] = dict(type="value", clip_value=1.0)
    assert check_config(cfg) == []


# ------------------------------------------------------------------------------------------- dropout
def test_transformer_dropout_is_info():
    cfg = mmcv1_cfg()
    cfg["model"]["pts_bbox_head"] = _head(dropout=0.1)
    f = _one(check_config(cfg), "transformer-dropout")
    assert f.severity == "info"
    assert f.key.startswith("model.pts_bbox_head.transformer.")
    assert f.value == 0.1
    assert "3" in f.why  # three drop probabilities
    assert "known manual fix" in f.why
    cfg = mmcv1_cfg()
    cfg["model"]["img_backbone"]["drop_path_rate"] = 0.4  # a backbone regularizer, left alone
    assert check_config(cfg) == []


# ------------------------------------------------------------------------------------------- CheckInvalidLossHook
@pytest.mark.parametrize("name", ["CheckInvalidLossHook", "mmdet.CheckInvalidLossHook"])
def test_check_invalid_loss_hook(name):
    cfg = mmengine_cfg()
    cfg["custom_hooks"] = [dict(type="NanGuardHook"), dict(type=name, interval=50)]
    f = _one(check_config(cfg), "check-invalid-loss-hook")
    assert (f.key, f.value) == ("custom_hooks[1].type", name)
    assert "AssertionError: None" in f.why and "nan_to_num" in f.why


# ------------------------------------------------------------------------------------------- checkpoints
def test_checkpoints_mmcv1_epochs():
    cfg = mmcv1_cfg()
    cfg["checkpoint_config"] = dict(interval=2)
    f = _one(check_config(cfg), "rare-checkpoints")
    assert (f.key, f.value) == ("checkpoint_config.interval", 2)
    cfg["checkpoint_config"] = dict(interval=1, max_keep_ckpts=1)
    f = _one(check_config(cfg), "single-checkpoint-kept")
    assert (f.key, f.value) == ("checkpoint_config.max_keep_ckpts", 1)
    cfg["checkpoint_config"] = dict(interval=1, max_keep_ckpts=2)
    assert check_config(cfg) == []
    cfg["checkpoint_config"] = None
    assert _one(check_config(cfg), "rare-checkpoints").value is None


def test_checkpoints_mmcv1_iterations():
    cfg = mmcv1_cfg()
    cfg["runner"] = dict(type="IterBasedRunner", max_iters=24000)
    cfg["num_iters_per_epoch"] = 1000
    cfg["checkpoint_config"] = dict(interval=1000)
    assert check_config(cfg) == []
    cfg["checkpoint_config"] = dict(interval=5000)
    f = _one(check_config(cfg), "rare-checkpoints")
    assert "1000" in f.why
    del cfg["num_iters_per_epoch"]  # an epoch's length unknown: no guess
    assert check_config(cfg) == []


def test_checkpoints_mmengine():
    cfg = mmengine_cfg()
    del cfg["default_hooks"]  # the runner's default CheckpointHook(interval=1)
    assert check_config(cfg) == []
    cfg["default_hooks"] = dict(checkpoint=dict(type="CheckpointHook"))  # interval -1: the last one only
    assert _one(check_config(cfg), "rare-checkpoints").value == -1
    cfg["default_hooks"] = dict(checkpoint=None)
    assert _one(check_config(cfg), "rare-checkpoints").value is None
    cfg["default_hooks"] = dict(checkpoint=dict(type="CheckpointHook", interval=1, max_keep_ckpts=1))
    assert _ids(check_config(cfg)) == ["single-checkpoint-kept"]


# ------------------------------------------------------------------------------------------- the real configs
def test_real_petr_config_reports_static_loss_scale():
    findings = check_config(load_config(PETR), world_size=8)
    f = _one(findings, "static-loss-scale")
    assert (f.key, f.value) == ("optimizer_config.loss_scale", 512.0)
    assert _ids(findings) == ["static-loss-scale", "transformer-dropout"]


def test_real_streampetr_config_with_2_gpus_reports_lr():
    findings = check_config(load_config(STREAMPETR), world_size=2)
    f = _one(findings, "lr-not-scaled")
    assert (f.severity, f.key, f.value) == ("warning", "optimizer.lr", 4e-4)
    assert "num_gpus=8" in f.why
    assert _ids(findings) == ["fp16-flash-attention", "lr-not-scaled", "transformer-dropout"]
    assert "lr-not-scaled" not in _ids(check_config(load_config(STREAMPETR), world_size=8))


def test_real_mmdet3d14_fp32_config_has_no_fp16_hazard():
    for world_size in (None, 1, 2, 8):
        findings = check_config(load_config(MMDET3D14), world_size=world_size)
        assert _ids(findings) == ["transformer-dropout"]


# ------------------------------------------------------------------------------------------- output
def test_format_and_log():
    findings = check_config(load_config(STREAMPETR), world_size=2)
    text = format_findings(findings)
    assert "WARNING" in text and "INFO" in text
    assert "optimizer.lr=0.0004" in text
    for f in findings:
        assert f.why in text and f.fix in text and f.check in text
    assert "no known" in format_findings([])
    lines = []
    log_findings(findings, lambda msg, level: lines.append((level, msg)))
    assert [lv for lv, _ in lines] == [f.severity for f in findings]
    assert all(msg.startswith("NanGuard: pre-flight") and "\n" not in msg for _, msg in lines)
    assert "optimizer.lr=0.0004" in lines[[f.check for f in findings].index("lr-not-scaled")][1]


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        check_config(mmcv1_cfg(), world_size=0)
    with pytest.raises(ValueError, match="batch_per_gpu must be an integer >= 1, got -1"):
        check_config(mmcv1_cfg(), batch_per_gpu=-1)
    with pytest.raises(TypeError, match="cfg must be a dict"):
        check_config(["not", "a", "dict"])


# ------------------------------------------------------------------------------------------- runner entry
class _MMCVLikeConfig:
    """The shape of an mmcv 1.x Config: the merged dict lives in ``_cfg_dict``."""

    def __init__(self, d):
        self._cfg_dict = d


class _ToDictConfig:
    def __init__(self, d):
        self._d = d

    def to_dict(self):
        return self._d


@pytest.mark.parametrize("wrap", [lambda d: d, _MMCVLikeConfig, _ToDictConfig])
def test_check_runner_config_accepts_config_objects(wrap):
    cfg = load_config(STREAMPETR)
    assert _ids(check_runner_config(wrap(cfg), 2)) == ["fp16-flash-attention", "lr-not-scaled", "transformer-dropout"]


def test_check_runner_config_never_raises():
    logged = []
    assert check_runner_config(object(), 2) == []
    assert check_runner_config(mmcv1_cfg(), 0, log=lambda m, lv: logged.append((lv, m))) == []
    assert logged and "world_size" in logged[0][1]
    bad = mmcv1_cfg()
    bad.update(model="not a dict", optimizer_config=7, runner="IterBasedRunner", fp16="yes", data=[1],
               custom_hooks=dict(type="CheckInvalidLossHook"), checkpoint_config=[1], num_gpus="8")
    assert check_config(bad, world_size=2) == []
    odd = mmengine_cfg()
    odd.update(optim_wrapper=dict(optimizer="AdamW", clip_grad=1.0), auto_scale_lr="on", default_hooks=[1],
               train_dataloader=dict(batch_size="2"), sync_bn=None)
    assert check_config(odd, world_size=2) == []
    assert check_runner_config(bad, 2) == []


def test_check_runner_config_with_mmengine_config():
    mmengine_config = pytest.importorskip("mmengine.config")
    cfg = mmengine_config.Config.fromfile(STREAMPETR, import_custom_modules=False)
    assert "lr-not-scaled" in _ids(check_runner_config(cfg, 2))


def test_check_runner_config_with_mmcv1_config():
    mmcv = pytest.importorskip("mmcv")
    if not hasattr(mmcv, "Config"):
        pytest.skip("mmcv 2.x has no Config (MMEngine's is tested above)")
    cfg = mmcv.Config.fromfile(PETR)
    assert _ids(check_runner_config(cfg, 8)) == ["static-loss-scale", "transformer-dropout"]


# ------------------------------------------------------------------------------------------- CLI
def test_cli_exit_codes(capsys):
    assert main(["check", STREAMPETR, "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "lr-not-scaled" in out and "optimizer.lr=0.0004" in out
    assert main(["check", STREAMPETR, "--gpus", "2", "--strict"]) == 1
    capsys.readouterr()
    assert main(["check", MMDET3D14, "--strict"]) == 0  # an info finding only
    assert "transformer-dropout" in capsys.readouterr().out
    assert main(["check", PETR, "--strict"]) == 1
    assert "static-loss-scale" in capsys.readouterr().out
    assert main(["check", os.path.join(DATA, "mmengine_hazards.py"), "--gpus", "2", "--batch-per-gpu", "1"]) == 0
    assert "auto-scale-lr-off" in capsys.readouterr().out


def test_cli_a_config_that_cannot_be_read_exits_1_naming_the_file(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope.py")]) == 1
    assert "nope.py" in capsys.readouterr().err
    broken = tmp_path / "broken.py"
    broken.write_text("model = dict(type=undefined_name)\n")  # fails while it is executed
    assert main(["check", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "broken.py" in err and "undefined_name" in err
    syntax = tmp_path / "syntax.py"
    syntax.write_text("model = dict(\n")
    assert main(["check", str(syntax)]) == 1
    assert "syntax.py" in capsys.readouterr().err


def test_cli_usage_errors_exit_2_naming_the_flag(tmp_path, capsys):
    for flag, value in (("--gpus", "-1"), ("--gpus", "0"), ("--gpus", "two"), ("--batch-per-gpu", "0")):
        with pytest.raises(SystemExit) as exc:
            main(["check", PETR, flag, value])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: must be an integer >= 1, got " in err and value in err, err
    (tmp_path / "c.json").write_text("{}")
    assert main(["check", str(tmp_path / "c.json")]) == 2
    assert "c.json" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- whose batch (issue 22)
STREAMPETR_ON_MMENGINE_BASE = os.path.join(DATA, "streampetr_on_mmengine_base.py")
PETR14 = os.path.join(DATA, "petr14_on_unrelated_schedule.py")


def _cli_check(capsys, path, gpus):
    assert main(["check", path, "--gpus", str(gpus)]) == 0
    return capsys.readouterr().out


def test_mmcv1_config_on_an_mmengine_base_trains_with_samples_per_gpu(capsys):
    """StreamPETR (MMCV 1.x) on an mmdet3d 1.x checkout also inherits train_dataloader.batch_size=4."""
    cfg = load_config(STREAMPETR_ON_MMENGINE_BASE)
    assert (cfg["train_dataloader"]["batch_size"], cfg["data"]["samples_per_gpu"]) == (4, 2)  # both keys
    out = _cli_check(capsys, STREAMPETR_ON_MMENGINE_BASE, 8)  # 8 x 2 = 16: the batch its lr is written for
    assert "lr-not-scaled" not in out and "8 x 4" not in out
    out = _cli_check(capsys, STREAMPETR_ON_MMENGINE_BASE, 2)
    assert "this run has 2 x 2 = 4 (data.samples_per_gpu=2 per GPU)" in out
    assert "num_gpus=8 x batch_size=2" in out and "lr=0.0001" in out


@pytest.mark.parametrize("family", ["mmcv1", "mmengine"])
def test_the_batch_key_is_the_familys_own(family):
    cfg = mmcv1_cfg() if family == "mmcv1" else mmengine_cfg()
    cfg["train_dataloader"] = dict(batch_size=1 if family == "mmengine" else 4)
    cfg["data"] = dict(samples_per_gpu=1 if family == "mmcv1" else 4, workers_per_gpu=4)
    cfg["model"]["img_neck"]["norm_cfg"] = dict(type="BN2d")
    key = "data.samples_per_gpu" if family == "mmcv1" else "train_dataloader.batch_size"
    f = _one(check_config(cfg), "bn-batch-one")
    assert f"({key}=1)" in f.why
    cfg.update(num_gpus=8, batch_size=1)
    f = _one(check_config(cfg, world_size=2), "lr-not-scaled")
    assert f"this run has 2 x 1 = 2 ({key}=1 per GPU)" in f.why
    # A caller that knows the runner (the hook) says so: the other family's key holds 4, so no BN-at-batch-1.
    other = "mmengine" if family == "mmcv1" else "mmcv1"
    assert "bn-batch-one" in _ids(check_config(cfg, family=family))
    assert "bn-batch-one" not in _ids(check_config(cfg, family=other))
    with pytest.raises(ValueError, match="family must be one of .*, got 'mmcv2'"):
        check_config(cfg, family="mmcv2")


def test_auto_scale_lr_of_an_unrelated_schedule_file_is_not_the_lrs_batch(capsys):
    """mmdet3d 1.4 PETR sets lr 2e-4 itself; auto_scale_lr (base 32) comes from a schedule file written for 1e-4."""
    cfg = load_config(PETR14)
    assert cfg["auto_scale_lr"] == dict(enable=False, base_batch_size=32)
    assert cfg["optim_wrapper"]["optimizer"]["lr"] == 2e-4
    for gpus in (8, 2):
        out = _cli_check(capsys, PETR14, gpus)
        assert "auto-scale-lr-off" not in out and "lr-not-scaled" not in out and "base_batch_size=32" not in out


def test_auto_scale_lr_written_with_or_after_the_lr_counts():
    own = os.path.join(DATA, "petr14_own_auto_scale_lr.py")  # a child of PETR14 declaring base_batch_size=8
    assert check_file(own, world_size=8) == []
    f = _one(check_file(own, world_size=2), "auto-scale-lr-off")
    assert "base_batch_size=8" in f.why and "2 x 1 = 2 (train_dataloader.batch_size=1 per GPU)" in f.why
    schedule_lr = os.path.join(DATA, "mmengine_schedule_lr.py")  # trains at the schedule file's own lr
    assert check_file(schedule_lr, world_size=8) == []  # 8 x 4 = 32, the schedule's base
    f = _one(check_file(schedule_lr, world_size=2), "auto-scale-lr-off")
    assert "base_batch_size=32" in f.why and "2 x 4 = 8" in f.why
    # Without the file tree (a bare dict), every declaration counts: the finding a dict cannot tell from.
    assert "auto-scale-lr-off" in _ids(check_config(load_config(PETR14), world_size=8))


def test_the_hook_entry_reads_the_tree_of_the_run_s_file():
    cfg = load_config(PETR14)
    assert check_runner_config(cfg, 8, filename=PETR14) == []
    mmengine_config = pytest.importorskip("mmengine.config")
    runner_cfg = mmengine_config.Config.fromfile(PETR14, import_custom_modules=False)  # .filename is the file
    assert check_runner_config(runner_cfg, 8) == []
    # An lr set at launch (--cfg-options) is the run's own: the file's declarations are not for it.
    cfg["optim_wrapper"]["optimizer"]["lr"] = 1e-3
    own = load_config(os.path.join(DATA, "petr14_own_auto_scale_lr.py"))
    own["optim_wrapper"]["optimizer"]["lr"] = 1e-3
    assert check_runner_config(own, 2, filename=os.path.join(DATA, "petr14_own_auto_scale_lr.py")) == []
    assert _ids(check_runner_config(own, 2)) == ["auto-scale-lr-off"]  # no file: the declaration counts


@pytest.mark.parametrize("loader", ["mmengine", "mmcv"])
def test_check_file_with_either_loader(loader):
    from petr_stability.configfix import available_loaders

    if loader not in available_loaders():
        pytest.skip(f"{loader} Config is not installed here")
    assert "lr-not-scaled" not in _ids(check_file(STREAMPETR_ON_MMENGINE_BASE, world_size=8, loader=loader))
    assert check_file(PETR14, world_size=8, loader=loader) == []


STREAMPETR_CLONE = os.path.join(os.environ.get("STREAMPETR_ROOT", "/work/clones/StreamPETR"), "projects", "configs",
                                "StreamPETR", "stream_petr_r50_flash_704_bs2_seq_428q_nui_60e.py")


@pytest.mark.skipif(not os.path.isfile(STREAMPETR_CLONE), reason="no StreamPETR clone on this machine")
def test_real_streampetr_60e_config_at_its_8_gpus():
    findings = check_file(STREAMPETR_CLONE, world_size=8)
    assert "lr-not-scaled" not in _ids(findings)
    f = _one(check_file(STREAMPETR_CLONE, world_size=2), "lr-not-scaled")
    assert "num_gpus=8 x batch_size=2" in f.why and "2 x 2 = 4 (data.samples_per_gpu=2 per GPU)" in f.why


def test_a_patched_configs_carried_state_is_listed():
    # Issue 33: `petr-stability check` on a patched config lists what the hook re-applies before the first iteration.
    cfg = {"model": {"type": "M"}, "optim_wrapper": {"clip_grad": {"max_norm": 1}},
           "custom_hooks": [{"type": "NanGuardHook", "carry": {"dropout": {"zeroed": ["head.a.p", "head.b.p"]}},
                             "quarantine": [{"dataset": "NuScenesDataset", "inner_index": 7, "token": "t7"}]}]}
    found = [f for f in check_config(cfg) if f.check == "carried"]
    assert [(f.key, f.severity) for f in found] == [("custom_hooks[0].carry.dropout", "info"),
                                                    ("custom_hooks[0].quarantine", "info")]
    assert "zeroed=['head.a.p', 'head.b.p']" in found[0].why and "1 entry" in found[1].why
    plain = check_config({"model": {}, "custom_hooks": [{"type": "NanGuardHook"}]})
    assert [f for f in plain if f.check == "carried"] == []
