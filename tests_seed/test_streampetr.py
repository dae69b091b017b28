"""The real StreamPETR, trained by MMCV 1.x's ``IterBasedRunner`` through StreamPETR's own entry point, guarded.

The model is the ResNet-50 config ``stream_petr_r50_flash_704_bs2_seq_428q_nui_60e.py`` at a CPU size (64 x 176
images, 6 cameras, 100 queries; the 6-layer decoder with dropout 0.1 and ``with_cp=True``, the config's dynamic
``Fp16OptimizerHook`` with ``max_norm=35``), the data three synthetic scenes of six key frames served by the
config's ``InfiniteGroupEachSampleInBatchSampler`` (``seq_split_num=2``: six sequences of three frames, batch 2:
each batch slot walks one sequence frame by frame). Each test is one run in its own process (seed_run.py); what
each asserts, and why it matters for a real run, is in its docstring.
"""
import os
from typing import Any, Dict

import pytest
from harness import SUMMARY, Expect, RunResult, after, diagnosis_costs, median, memory_ok_everywhere, position, run_seed

#: A decoder FFN weight: where the issue planted its NaN.
DECODER_FFN = "pts_bbox_head.transformer.decoder.layers.0.ffns.0.layers.0.0.weight"
#: Guard settings sized for runs of tens of iterations (docs/configuration.md); nothing else is changed.
GUARD = dict(snapshot_interval=4, confirm_steps=2, check_interval=1000)


def spec(root: str, ann: str, **kw: Any) -> Dict[str, Any]:
    """A StreamPETR run over the session's synthetic scenes."""
    out: Dict[str, Any] = dict(project="streampetr", root=root, data_root=os.path.dirname(ann), ann_file=ann,
                               num_query=100, image_scale=0.25, batch_size=2, seed=0, guard=dict(GUARD))
    out.update(kw)
    return out


# ------------------------------------------------------------------------------------------------ the cases
def test_healthy_run_has_no_incident_and_reads_nothing_on_healthy_steps(streampetr_root: str, streampetr_data: str,
                                                                       runs_dir: str) -> None:
    """Ten iterations of the real StreamPETR: the dynamic scale's first ordinary overflows (MMCV's GradScaler
    starts at 2**16) are harmless, nothing is an incident, the run ends where it should, and the guard reads no
    tensor value on a healthy step that is not a snapshot step (a device sync each on CUDA), as
    tests/mmcv1/test_hook_mmcv1.py checks on the stand-in. Also measures the iteration and the guard's share."""
    r = run_seed("healthy", spec(streampetr_root, streampetr_data, max_iters=10,
                                 watch_reads=dict(snapshot_interval=4, warmup=3)), runs_dir)
    expect = Expect(r)
    expect(r.error is None, f"the run raised {r.error}")
    expect(r.final.get("iter") == 10, f"ended at iter {r.final.get('iter')}, not 10")
    expect(r.incidents() == [], f"incident records in a healthy run: {[x.get('event') for x in r.incidents()]}")
    overflows = [it["iteration"] for it in r.iterations if it.get("grad_norm") in ("inf", "nan")]
    expect(overflows and max(overflows) <= 3, f"ordinary overflows expected in the first steps only: {overflows}")
    expect(r.final.get("params_finite"), "non-finite parameters at the end")
    expect(r.final.get("decoder_with_cp") == [True] * 6, f"decoder with_cp: {r.final.get('decoder_with_cp')}")
    memory_ok_everywhere(expect, r)
    # Host reads on the watched calls of healthy steps (grad_norm finite).
    healthy = {it["iteration"] for it in r.iterations if it.get("grad_norm") not in ("inf", "nan", None)}
    calls = list(zip(r.data["read_iterations"], r.data["reads"] or []))
    watched = [(i, reads) for i, reads in calls if i in healthy]
    expect(len(watched) >= 8, f"too few healthy calls watched ({len(watched)}): the check would prove nothing")
    reads = [(i, read) for i, rs in watched for read in rs]
    expect(reads == [], f"the guard read tensor values on healthy steps: {reads[:10]}")
    # The figures docs/seed-stack.md quotes: iteration time and the guard's share on healthy steps.
    plain = [it for it in r.iterations if it["iteration"] in healthy and it["iteration"] in
             dict(watched)]
    share = [r.guard_seconds(it) / it["seconds"] for it in plain]
    snap = [it for it in r.iterations if it["iteration"] in healthy and it["iteration"] not in dict(watched)
            and it["iteration"] > 3]
    cpu_share = [r.guard_seconds(it, cpu=True) / it["cpu_seconds"] for it in plain if it.get("cpu_seconds")]
    SUMMARY.append(f"healthy: median iteration {median([it['seconds'] for it in plain]):.2f} s wall, "
                   f"{median([it.get('cpu_seconds', float('nan')) for it in plain]):.2f} s CPU; guard "
                   f"{median([r.guard_seconds(it) for it in plain]) * 1e3:.2f} ms per healthy step "
                   f"({median(share):.1e} of it; CPU {median(cpu_share):.1e}); on snapshot steps "
                   f"{median([r.guard_seconds(it) for it in snap]):.2f} s (every snapshot_interval=4 here, 200 by "
                   f"default); first overflows {overflows}")
    expect.check()


def test_nan_planted_in_a_decoder_weight_recovers_with_memory_reset(streampetr_root: str, streampetr_data: str,
                                                                   runs_dir: str) -> None:
    """A NaN planted in a decoder FFN weight at iterations 4 and 5 (the fire drill, FaultInjectionHook). The first
    divergence is classed dynamics (the batch trains on the healthy weights) with the signal ``between_steps`` (the
    loss scaler dropped the failing step: no optimizer step put the NaN there; issue 43): a rollback alone, no
    setting changed, StreamPETR's memory reset after it (NaN * prev_exists stays NaN). The second, the run's next
    divergence, climbs the ladder: the known manual fix (max_norm 35 -> 1, every transformer dropout -> 0) and a
    rollback. The run finishes its iterations with finite weights and memory."""
    r = run_seed("nan_weight", spec(streampetr_root, streampetr_data, max_iters=6,
                                    faults=[dict(kind="weights", iters=[4, 5], param=DECODER_FFN)],
                                    guard=dict(GUARD, snapshot_interval=2, confirm_steps=1)), runs_dir)
    expect = Expect(r)
    expect(r.error is None, f"the run raised {r.error}")
    div = r.divergences()
    expect([d["iteration"] for d in div] == [4, 5], f"divergences: {[d['iteration'] for d in div]}")
    for d in div:
        expect((d.get("cause") or {}).get("cause") == "dynamics", f"cause {(d.get('cause') or {}).get('cause')}")
        restored = d.get("restored_from") or {}
        expect(restored.get("iteration") is not None and restored.get("iteration") < d["iteration"],
               f"restored {restored}")
        expect("pts_bbox_head" in (restored.get("temporal_reset") or []), f"temporal reset: {restored}")
    if len(div) == 2:
        first, second = div
        expect(((first.get("cause") or {}).get("signals") or {}).get("between_steps") is True
               and not first.get("actions"), f"first divergence: {first.get('cause')}, {first.get('actions')}")
        targets = {a["target"]: (a["old"], a["new"]) for a in second.get("actions") or []}
        expect(targets.get("optimizer_config.grad_clip.max_norm") == (35.0, 1.0),
               f"max_norm change: {targets.get('optimizer_config.grad_clip.max_norm')}")
        dropouts = [k for k, (old, new) in targets.items() if "dropout" in k or k.endswith(".p")]
        expect(len(dropouts) >= 18 and all(targets[k][1] == 0 for k in dropouts),
               f"transformer dropouts zeroed: {len(dropouts)}")
    at = position(r, lambda it: it.get("iter_after_guard") != it.get("iter_before_guard"))
    expect(at >= 0, "no iteration rolled the counter back")
    if at >= 0:
        expect(r.iterations[at].get("memory_after_guard") == "reset", "memory not reset by the rollback")
        nxt = after(r, at)
        expect(nxt and nxt[0].get("memory_at_start") == "reset", "the iteration after the rollback started with "
                                                                "the poisoned path's memory")
    memory_ok_everywhere(expect, r)
    expect(r.final.get("iter") == 6 and r.final.get("params_finite"), f"final: {r.final.get('iter')}, params "
                                                                        f"finite {r.final.get('params_finite')}")
    expect(set((r.final.get("head_dropouts") or {}).values()) == {0.0}, "a transformer dropout is not 0 at the end")
    SUMMARY.append("nan_weight diagnosis: " + "; ".join(diagnosis_costs(r)))
    expect.check()


def test_corrupt_frame_is_data_named_by_token_quarantined_and_its_scene_goes_on(
        streampetr_root: str, streampetr_data: str, runs_dir: str) -> None:
    """One camera of one mid-sequence frame is a raw 16-bit frame (every pixel 65535; fp16's largest value is
    65504, so MMCV's ``@auto_fp16`` cast makes it Inf). StreamPETR's infinite sampler serves that frame at
    iterations 5, 11 and 23 of this run. Wanted (issue 20): a record classes it **data** (a ``divergence`` with
    cause data, or the ``recurring_sample`` event when it breaks a step again), names it by its nuScenes token
    (StreamPETR's batches carry only ``scene_token`` in ``img_metas``: the token is in the dataset's
    ``data_infos``), quarantines it, and from then on the sampler never serves its index; no hyperparameter
    changes for bad data.

    What happens to the rest of its scene, under StreamPETR's streaming sampler: the slot goes on with the
    sequence's next frame (``prev_exists`` 1), the memory never holds NaN/Inf when an iteration starts (PETR's
    ``nan_to_num`` on the decoder output keeps the queue finite; a rollback would reset it, and then the next
    iteration must start from an empty queue), and a guard that does not roll back leaves the memory as training
    left it (its diagnosis replay must not push the replayed frames into the queue)."""
    # quarantine_fraction sized to the 18-sample dataset as the default (0.001) is to nuScenes' 28130: room for
    # one batch (2 samples), where the default's floor of one sample would refuse a batch of two.
    r = run_seed("corrupt_frame", spec(streampetr_root, streampetr_data, max_iters=24,
                                       guard=dict(GUARD, quarantine_fraction=0.12),
                                       corrupt=dict(tokens=[]), corrupt_at=dict(iteration=5, slot=0, camera=0)),
                 runs_dir)
    bad = r.data["corrupt"]
    served_at = [it["iteration"] for it in r.iterations if bad["index"] in it["indices"]]
    # The premises: served at 5 first, and planned twice more within the run (a quarantine has something to stop).
    assert served_at[:1] == [5] and len(bad["planned"]) >= 3, f"corrupt frame {bad}, served at {served_at}"
    expect = Expect(r)
    expect(r.error is None, f"the run raised {r.error}")
    records = r.incidents()
    named = [x for x in records if bad["token"] in repr(x)]
    expect(named, f"no incident record names the corrupt frame by its token {bad['token']} (records: "
                  f"{[(x.get('event'), x.get('iteration'), x.get('batch')) for x in records]})")
    data = [x for x in records if x.get("event") == "recurring_sample"
            or (x.get("cause") or {}).get("cause") == "data"]
    expect(data, f"nothing classed data: {[(x.get('event'), (x.get('cause') or {}).get('cause')) for x in records]}")
    changed = [a["target"] for x in records for a in x.get("actions") or [] if not a["target"].startswith("quar")]
    expect(not changed, f"settings changed for bad data: {changed[:6]}")
    skip = (r.remedy_state("quarantine").get("skip") or {}).get("indices") or {}
    expect(str(bad["index"]) in skip, f"dataset index {bad['index']} not in the quarantine: {sorted(skip)}")
    # A skipped step names the frame (a `skip` record of class data); the record that quarantines it is the one after
    # which the sampler must never serve it (the `recurring_sample` when it breaks a step again, or a divergence's).
    quarantining = [x for x in data if any(a["target"].startswith("quar") for a in x.get("actions") or [])]
    expect(quarantining, f"no record quarantined the frame: {[(x.get('event'), x.get('iteration')) for x in data]}")
    if quarantining:
        at = position(r, lambda it: it["iteration"] == quarantining[0]["iteration"] and bad["index"] in it["indices"])
        again = [it["iteration"] for it in after(r, at) if bad["index"] in it["indices"]]
        expect(not again, f"served again at iterations {again} after the record that quarantined it (iteration "
                          f"{quarantining[0]['iteration']}; the sampler had it planned at {bad['planned']})")
    first = position(r, lambda it: it["iteration"] == 5)
    # The rest of its sequence, in the same slot, in order.
    rest = [i for i in range(bad["index"] + 1, len(r.data["dataset"]))
            if r.data["dataset"][i]["flag"] == r.data["dataset"][bad["index"]]["flag"]]
    nxt = after(r, first)
    expect(nxt and rest and nxt[0]["indices"][bad["slot"]] == rest[0] and nxt[0]["prev_exists"][bad["slot"]] == 1.0,
           f"the sequence did not go on after the corrupt frame: next {nxt[:1]}, rest of the sequence {rest}")
    for it in r.iterations:
        if it.get("unfinished") or not any(x["iteration"] == it["iteration"] for x in records):
            continue
        if it.get("iter_after_guard") == it.get("iter_before_guard"):  # an incident without a rollback
            expect(it.get("memory_unchanged_by_guard") is True, f"iter {it['iteration']}: the guard changed "
                                                               "StreamPETR's memory without a rollback")
        else:
            expect(it.get("memory_after_guard") == "reset", f"iter {it['iteration']}: rollback without a reset")
    memory_ok_everywhere(expect, r)
    mates = sorted(set(skip) - {str(bad["index"])})
    SUMMARY.append(f"corrupt_frame: records {[(x.get('event'), x.get('iteration')) for x in records]}; quarantined "
                   f"{sorted(skip)} (the frame {bad['index']}; batch-mates {mates})")
    expect.check()


@pytest.fixture(scope="module")
def overflow_run(streampetr_root: str, streampetr_data: str, runs_dir: str) -> RunResult:
    """StreamPETR with its ``@force_fp32`` islands not honoured (every forward under fp16 autocast): the input of
    ``pts_bbox_head.position_encoder`` is non-finite on every batch, whatever the weights. Checkpoints every 10
    iterations for the resume test."""
    return run_seed("forward_overflow", spec(streampetr_root, streampetr_data, max_iters=20, islands=False,
                                             checkpoint_interval=10), runs_dir, timeout=2400)


def test_forward_overflow_on_every_batch_gets_an_fp32_island_never_data(overflow_run: RunResult) -> None:
    """The forward overflows on every batch from the first: the dynamic scale halves every step until it falls
    under 1, then the guard must class it **forward overflow** with ``pts_bbox_head`` (whose functional code makes
    the non-finite input of its ``position_encoder``) put in fp32, and recover (finish its 20 iterations; a later
    incident may only be another fp32 island); or stop with ``StructuralDivergence``. Never **data**: nothing is
    wrong with the batches, and with their samples named it would quarantine good samples. StreamPETR's memory:
    finite when every iteration starts, reset by a rollback, and untouched by the diagnosis replay (what the
    guard's temporal reset, or the next iteration when there is no rollback, finds in the queue is what training
    put there)."""
    r = overflow_run
    expect = Expect(r)
    records = [x for x in r.incidents() if x.get("event") in ("divergence", "gave_up")]
    causes = [(x["iteration"], (x.get("cause") or {}).get("cause")) for x in records]
    expect(records, "no divergence: the guard never acted on a forward that overflows on every batch")
    expect(all(c != "data" for _, c in causes), f"classed data: {causes}")
    structural = r.error is not None and r.error.get("type") == "StructuralDivergence"
    finished = r.error is None and r.final.get("iter") == 20
    expect(structural or finished, f"the run neither finished nor stopped as structural: {r.error}, iter "
                                   f"{r.final.get('iter')}")
    if records:
        first = records[0].get("cause") or {}
        expect((first.get("cause") == "forward_overflow" and first.get("modules") == ["pts_bbox_head"])
               or (first.get("cause") == "structural" and structural),
               f"first incident: {first.get('cause')} for {first.get('modules')} ({first.get('evidence')}), not an "
               "fp32 island for pts_bbox_head nor structural")
    # A later incident may put another module in fp32 (a GPU runs this whole forward's losses in fp32 too).
    others = [c for _, c in causes if c not in ("forward_overflow", "structural")]
    expect(not others, f"incidents neither forward overflow nor structural: {causes}")
    if finished:
        expect(r.final.get("params_finite"), "non-finite parameters at the end")
    for it in r.iterations:
        if it.get("unfinished") or it.get("memory_unchanged_by_guard") is None:
            continue
        rolled = it.get("iter_after_guard") != it.get("iter_before_guard")
        if rolled:
            expect(it.get("memory_after_guard") == "reset", f"iter {it['iteration']}: rollback without a reset")
            expect(it.get("memory_at_reset_unchanged") is not False,
                   f"iter {it['iteration']}: the diagnosis replay changed the memory before the reset")
        elif any(x["iteration"] == it["iteration"] for x in records):
            expect(it["memory_unchanged_by_guard"], f"iter {it['iteration']}: the guard changed StreamPETR's memory "
                                                    "without a rollback (the diagnosis replay ran the head)")
    memory_ok_everywhere(expect, r)
    SUMMARY.append("forward_overflow diagnosis: " + "; ".join(diagnosis_costs(r)))
    expect.check()


def test_resume_mid_scene_keeps_remedies_and_a_consistent_memory(overflow_run: RunResult, streampetr_root: str,
                                                                 streampetr_data: str, runs_dir: str) -> None:
    """``resume_from`` the forward-overflow run's newest checkpoint (written mid-sequence: each slot was inside a
    three-frame sequence), in that run's work dir, as a user restarts the job. StreamPETR keeps neither its
    sampler's position nor its memory queue in a checkpoint: the resumed run starts every slot at the start of a
    sequence (``prev_exists`` 0) with an empty queue, which is consistent. The guard's state comes back with it
    (its run id, its recoveries, an fp32 island stays in force, so the forward no longer overflows), the loss
    scale is the checkpoint's, nothing is classed data, and the memory stays finite."""
    latest = os.path.join(overflow_run.work_dir, "latest.pth")
    assert os.path.exists(latest), f"the forward-overflow run wrote no checkpoint: {overflow_run.describe()}"
    ckpt_iter = int(os.path.basename(os.path.realpath(latest))[len("iter_"):-len(".pth")])
    # The premise: when that file was written, every batch slot was inside a sequence (its next frame follows).
    flags = [d["flag"] for d in overflow_run.data["dataset"]]
    last = [it for it in overflow_run.iterations if it["iteration"] == ckpt_iter][-1]
    assert all(i + 1 < len(flags) and flags[i + 1] == flags[i] for i in last["indices"]), (
        f"iteration {ckpt_iter} served {last['indices']}: not mid-sequence in every slot")
    r = run_seed("resume", spec(streampetr_root, streampetr_data, max_iters=ckpt_iter + 3, islands=False,
                                resume_from=latest), runs_dir, work_dir=overflow_run.work_dir)
    expect = Expect(r)
    first = r.iterations[0] if r.iterations else {}
    # MMCV 1.x's IterBasedRunner saves iter_N.pth inside iteration N with meta iter N - 1 and resumes from that
    # counter: the resumed run runs iteration N again (RUNNER-INTERNALS.md).
    expect(first.get("iteration") == ckpt_iter, f"resumed at iteration {first.get('iteration')}, not {ckpt_iter}")
    expect(first.get("prev_exists") == [0.0, 0.0] and first.get("memory_at_start") == "reset",
           f"first resumed batch: prev_exists {first.get('prev_exists')}, memory {first.get('memory_at_start')}")
    # The guard's state in the file is the one stored before iteration ckpt_iter's guard ran (the probe read it).
    saved = (last.get("guard_run_id"), last.get("guard_recoveries"))
    resumed = (first.get("guard_run_id"), first.get("guard_recoveries"))
    expect(saved[0] is not None and resumed == saved,
           f"the guard's state did not come back: (run id, recoveries) in the file {saved}, resumed {resumed}")
    saved_scale = last.get("loss_scale")
    expect(isinstance(saved_scale, float) and isinstance(first.get("loss_scale"), float)
           and first["loss_scale"] <= saved_scale,
           f"loss scale {first.get('loss_scale')} after the first resumed step: not the checkpoint's {saved_scale}")
    before = overflow_run.remedy_state("fp32").get("fp32") or []
    now = r.remedy_state("fp32").get("fp32") or []
    expect(set(before) <= set(now), f"fp32 islands before {before}, after the resume {now}")
    causes = [(x["iteration"], (x.get("cause") or {}).get("cause")) for x in r.incidents()
              if x.get("event") in ("divergence", "gave_up")]
    expect(all(c != "data" for _, c in causes), f"classed data after the resume: {causes}")
    if "pts_bbox_head" in before:
        expect(not causes and r.error is None, f"the fp32 island did not hold after the resume: {causes}, "
                                               f"{r.error and r.error.get('type')}")
    memory_ok_everywhere(expect, r)
    expect.check()
