"""megvii PETRv2 from the seed's own config, trained by MMCV 1.x's ``EpochBasedRunner`` through mmdet3d's
``train_model`` (what PETR's ``tools/train.py`` calls), guarded.

``projects/configs/petrv2/petrv2_vovnet_gridmask_p4_800x320.py`` at a CPU size (64 x 160 images, 6 cameras plus
one previous key frame each, 100 queries): VoVNetCP-99, the 6-layer decoder of ``PETRTransformerDecoderLayer``
with ``PETRMultiheadAttention``, ``dropout=0.1`` and ``with_cp=True``, the config's static loss scale 512 and
``max_norm=35``. The data: two synthetic scenes of two key frames in PETR's 30f info format (camera sweeps),
through its own dataset and train pipeline.
"""
import json
import os
from typing import Any, Dict, List

import pytest
from harness import SUMMARY, Expect, RunResult, check_all, diagnosis_costs, run_seed

DECODER_FFN = "pts_bbox_head.transformer.decoder.layers.0.ffns.0.layers.0.0.weight"


def spec(root: str, ann: str, **kw: Any) -> Dict[str, Any]:
    """A PETRv2 run over the session's synthetic scenes."""
    out: Dict[str, Any] = dict(project="petrv2", root=root, data_root=os.path.dirname(ann), ann_file=ann,
                               num_query=100, image_scale=0.2, batch_size=1, seed=0,
                               guard=dict(snapshot_interval=2, confirm_steps=1, check_interval=1000))
    out.update(kw)
    return out


@pytest.mark.parametrize("scale", ["static", "dynamic"])
def test_petrv2_divergence_takes_the_known_manual_fix(petr_root: str, petr_data: str, runs_dir: str,
                                                      scale: str) -> None:
    """Two epochs of four iterations; a NaN planted in a decoder FFN weight at iterations 3 and 5 (the fire drill).
    The seed's own path: two divergences, both classed dynamics. The first shows ``between_steps`` (the loss scaler
    dropped the failing step: no optimizer step put the NaN there; issue 43): a rollback alone, no setting changed.
    The second, the run's next divergence, takes exactly the known manual fix (max_norm 35 -> 1, every transformer
    dropout -> 0) with ``with_cp=True``, under the config's static loss scale 512 and under MMCV's dynamic
    GradScaler (started at 512, so that its calibration does not take the whole short run); each rolls back to a
    state of this run; both epochs finish with finite weights, the dropouts stay 0 (``model.train()`` every epoch
    does not undo them) and the patched config for the next run is written."""
    extra: Dict[str, Any] = dict(loss_scale=dict(init_scale=512.0)) if scale == "dynamic" else {}
    name = "petrv2_known_fix" if scale == "static" else "petrv2_known_fix_dynamic"
    r = run_seed(name, spec(petr_root, petr_data, max_epochs=2,
                            faults=[dict(kind="weights", iters=[3, 5], param=DECODER_FFN)], **extra), runs_dir)
    expect = Expect(r)
    expect(r.error is None, f"the run raised {r.error}")
    expect(r.final.get("decoder_with_cp") == [True] * 6, f"decoder with_cp: {r.final.get('decoder_with_cp')}")
    div = r.divergences()
    expect([d["iteration"] for d in div] == [3, 5], f"divergences: {[d['iteration'] for d in div]}")
    for d in div:
        expect((d.get("signals") or {}).get("scale_mode") == scale, f"scale mode {d.get('signals')}")
        expect((d.get("cause") or {}).get("cause") == "dynamics", f"cause {(d.get('cause') or {}).get('cause')}: "
                                                                  f"{(d.get('cause') or {}).get('evidence')}")
        restored = d.get("restored_from") or {}
        expect(restored.get("iteration") is not None and restored["iteration"] < d["iteration"],
               f"restored {restored}")
    if len(div) == 2:
        first, d = div
        expect(((first.get("cause") or {}).get("signals") or {}).get("between_steps") is True
               and not first.get("actions"), f"first divergence: {first.get('cause')}, {first.get('actions')}")
        targets = {a["target"]: (a["old"], a["new"]) for a in d.get("actions") or []}
        expect(targets.get("optimizer_config.grad_clip.max_norm") == (35.0, 1.0),
               f"max_norm change: {targets.get('optimizer_config.grad_clip.max_norm')}")
        dropouts = [k for k in targets if k != "optimizer_config.grad_clip.max_norm"]
        expect(len(dropouts) >= 18 and all(targets[k] == (0.1, 0.0) for k in dropouts),
               f"transformer dropouts changed: {[(k, targets[k]) for k in dropouts][:6]} ({len(dropouts)})")
        expect(not any("backbone" in k for k in targets), "a backbone setting was changed")
    expect(r.final.get("epoch") == 2 and r.final.get("params_finite"),
           f"final epoch {r.final.get('epoch')}, params finite {r.final.get('params_finite')}")
    expect(set((r.final.get("head_dropouts") or {}).values()) == {0.0}, "a transformer dropout is not 0 at the end")
    expect(r.final.get("max_norm") == 1.0, f"max_norm at the end {r.final.get('max_norm')}")
    # The iterations trained after the last rollback (an epoch runner ends its epoch when its data is read: two
    # rollbacks in two epochs of four leave the counter at 3, each epoch's batches all trained).
    backs = [i for i in range(1, len(r.iterations)) if r.iterations[i]["iteration"] <= r.iterations[i - 1]["iteration"]]
    losses = [it.get("loss") for it in r.iterations[backs[-1] if backs else 0:]]
    expect(losses and all(isinstance(x, float) for x in losses), f"losses after the recovery: {losses}")
    patched = os.path.join(r.work_dir, "nan_guard_patched_config.py")
    expect(os.path.exists(patched), "no nan_guard_patched_config.py")
    SUMMARY.append(f"petrv2 ({scale}) diagnosis: " + "; ".join(diagnosis_costs(r)))
    expect.check()


def test_petrv2_through_cbgs_a_corrupt_sample_is_quarantined_under_every_index(petr_root: str, petr_cbgs_data: str,
                                                                              runs_dir: str) -> None:
    """PETRv2 trained through mmdet3d's real ``CBGSDataset`` (1.0rc6), as PETR's trainval configs do: one sample,
    the one CBGS serves under the most indices, has camera 0 NaN. Wanted (issue 27): it is classed data (a
    divergence or a recurring sample), quarantined under every index CBGS serves it under (its inner index and
    token named), served at most twice (once to break a step; once more only where a skipped step names it
    again), the epoch finishes and no hyperparameter changes."""
    # One epoch is 40 iterations: 854 s alone on 2 quiet cores (15.8 s each), 48-53 s each beside two other CPU jobs
    # (measured 2026-12-04, AMD EPYC 2 vCPU: killed at iteration 28 by the default 1500 s); a timeout is no verdict.
    r = run_seed("petrv2_cbgs_corrupt", spec(petr_root, petr_cbgs_data, max_epochs=1, cbgs=True,
                                             corrupt=dict(tokens=[], value="nan"), corrupt_cbgs=True), runs_dir,
                 timeout=3600.0)
    bad = r.data["corrupt"]
    assert len(bad["outer"]) >= 2, f"the premise: CBGS serves the sample under several indices ({bad})"
    expect = Expect(r)
    expect(r.error is None, f"the run raised {r.error}")
    records = r.incidents()
    data = [x for x in records if x.get("event") == "recurring_sample" or (x.get("cause") or {}).get("cause") == "data"]
    expect(data, f"nothing classed data: {[(x.get('event'), (x.get('cause') or {}).get('cause')) for x in records]}")
    named = [s for x in data for s in ((x.get("cause") or {}).get("signals") or {}).get("quarantined", [])
             + (x.get("batch") or [])]
    # PETR's batches carry the nuScenes token as sample_idx (its dataset's get_data_info: sample_idx=info['token']).
    expect(any(s.get("inner_index") == bad["index"] and bad["token"] in (s.get("token"), s.get("sample_idx"))
               for s in named),
           f"no record names inner index {bad['index']} and token {bad['token']}: {named}")
    skip = (r.remedy_state("quarantine").get("skip") or {}).get("indices") or {}
    expect(sorted(int(i) for i in skip) == sorted(bad["outer"]),
           f"quarantined {sorted(skip)}, CBGS serves the sample under {bad['outer']}")
    served = sum(1 for it in r.iterations for i in it.get("indices") or [] if i == bad["index"])
    expect(served <= 2, f"the sample was served {served} times (CBGS has it under {len(bad['outer'])} indices)")
    changed = [a["target"] for x in records for a in x.get("actions") or [] if not a["target"].startswith("quar")]
    expect(not changed, f"settings changed for bad data: {changed[:6]}")
    expect(r.final.get("epoch") == 1 and r.final.get("params_finite"),
           f"final epoch {r.final.get('epoch')}, params finite {r.final.get('params_finite')}")
    SUMMARY.append(f"petrv2_cbgs_corrupt: sample {bad['index']} under {bad['outer']} of {bad['outer_size']}; "
                   f"records {[(x.get('event'), x.get('iteration')) for x in records]}; served {served}")
    expect.check()


def _fetches(r: RunResult, size: int) -> List[int]:
    """How often the run's loader fetched each inner sample for training (the guard's replays are kept apart)."""
    counts = [0] * size
    for it in r.iterations:
        for i in it.get("indices") or []:
            counts[i] += 1
    return counts


def _quarantined(r: RunResult) -> List[int]:
    """The outer indices the run's guard holds quarantined at its end."""
    return sorted(int(i) for i in ((r.remedy_state("quarantine").get("skip") or {}).get("indices") or {}))


def test_petrv2_through_cbgs_the_next_run_keeps_the_quarantined_sample_out(petr_root: str, petr_cbgs_table_data: str,
                                                                           runs_dir: str) -> None:
    """Issue 33 on the real stack: PETRv2 through mmdet3d's real ``CBGSDataset`` over four frames whose classes make
    it draw a table of ten indices (``nusc_synth.CBGS_TABLE_CLASSES``: one frame per class, seven of them at random),
    the frame the table serves most with camera 0 NaN. Run 1 (seed 3, batch 1, one epoch) quarantines it under every
    index its table serves it under and writes the patched config. Run 2 takes the ``NanGuardHook`` entry of that
    patched config (``nan_guard_patched_config.py``, read with ``mmcv.Config``, as a user's ``tools/train.py`` reads
    it) with another seed (1: CBGS draws another table, in which the frame sits under indices run 1 never saw) and
    batch size 2: the frame is fetched 0 times, no incident is recorded, and every good frame is fetched at least as
    often as in run 2 without any quarantine and nothing corrupt (the baseline, same seed and batch size); the only
    extra fetches are the substitutes of the bad frame's slots, as many as the baseline fetches the bad frame.
    (Before identities, the patched config carried run 1's outer indices: in run 2 they serve good frames, and the
    corrupt one came back under its new indices.)"""
    data, cbgs = petr_cbgs_table_data, dict(max_epochs=1, cbgs=True)
    run1 = run_seed("petrv2_cbgs_run1", spec(petr_root, data, seed=3, corrupt=dict(tokens=[], value="nan"),
                                             corrupt_cbgs=True, **cbgs), runs_dir)
    bad = run1.data["corrupt"]
    size = len(run1.data["dataset"])
    assert len(bad["outer"]) >= 2, f"the premise: CBGS serves the frame under several indices ({bad})"
    e1 = Expect(run1)
    e1(run1.error is None, f"the run raised {run1.error}")
    e1(_quarantined(run1) == bad["outer"], f"quarantined {_quarantined(run1)}, CBGS serves it under {bad['outer']}")
    records1 = run1.incidents()
    # cause.signals.stored: for each quarantined sample, the identity kept for the next run (the patched config's).
    identities = [i for x in records1 for i in ((x.get("cause") or {}).get("signals") or {}).get("stored", [])]
    e1(any(isinstance(i, dict) and i.get("inner_index") == bad["index"] and i.get("token") == bad["token"]
           for i in identities), f"no record names inner index {bad['index']} and token {bad['token']}: {identities}")
    fetched1 = _fetches(run1, size)
    e1(fetched1[bad["index"]] <= 2, f"run 1 fetched the frame {fetched1[bad['index']]} times")
    patched = os.path.join(run1.work_dir, "nan_guard_patched_config.py")
    if not e1(os.path.exists(patched), "no nan_guard_patched_config.py"):
        check_all(run1=e1)
    from mmcv import Config

    entry = next(h for h in Config.fromfile(patched).custom_hooks if h["type"] == "NanGuardHook")
    carried = json.loads(json.dumps(entry.get("quarantine", [])))  # plain lists and dicts, as a spec holds them
    e1(carried == identities[:1], f"the patched config carries {carried}, the record {identities}")
    guard2 = {k: v for k, v in json.loads(json.dumps(entry)).items() if k != "type"}

    run2 = run_seed("petrv2_cbgs_run2", spec(petr_root, data, seed=1, batch_size=2, guard=guard2,
                                             corrupt=dict(tokens=[bad["token"]], value="nan"), **cbgs), runs_dir)
    table1, table2 = run1.data["cbgs_table"], run2.data["cbgs_table"]
    outer2 = [i for i, inner in enumerate(table2) if inner == bad["index"]]
    assert table2 != table1 and outer2 and not set(outer2) <= set(bad["outer"]), (
        f"the premise: run 2's CBGS table {table2} differs from run 1's {table1} and serves frame {bad['index']} "
        f"under an index run 1 did not quarantine")
    base = run_seed("petrv2_cbgs_run2_base", spec(petr_root, data, seed=1, batch_size=2, **cbgs,
                                                  guard={k: v for k, v in guard2.items() if k != "quarantine"}),
                    runs_dir)
    assert base.data["cbgs_table"] == table2, f"the baseline drew {base.data['cbgs_table']}, run 2 {table2}"
    got, want = _fetches(run2, size), _fetches(base, size)
    e2, e0 = Expect(run2), Expect(base)
    e2(run2.error is None, f"the run raised {run2.error}")
    e2(not run2.incidents(), f"incidents {[(x.get('event'), x.get('iteration')) for x in run2.incidents()]}")
    e2(got[bad["index"]] == 0, f"the corrupt frame was fetched {got[bad['index']]} times")
    e2(_quarantined(run2) == outer2, f"quarantined from the start {_quarantined(run2)}, its indices now {outer2}")
    good = [i for i in range(size) if i != bad["index"]]
    e2(all(got[i] >= want[i] for i in good), f"good frames fetched less than without quarantine: "
                                             f"{ {i: (got[i], want[i]) for i in good if got[i] < want[i]} }")
    e2(sum(got[i] - want[i] for i in good) == want[bad["index"]],
       f"extra fetches {sum(got[i] - want[i] for i in good)}, the bad frame's slots {want[bad['index']]}")
    e2(not run2.data.get("replayed"), f"the guard replayed {run2.data.get('replayed')}")
    e2(run2.final.get("epoch") == 1 and run2.final.get("params_finite"),
       f"final epoch {run2.final.get('epoch')}, params finite {run2.final.get('params_finite')}")
    e0(base.error is None, f"the run raised {base.error}")
    e0(want[bad["index"]] > 0, "the baseline never fetched the frame")
    SUMMARY.append(f"petrv2_cbgs next run: frame {bad['index']} ({bad['token'][:8]}); tables {table1} (seed 3) / "
                   f"{table2} (seed 1); run 1 fetches {fetched1}, records "
                   f"{[(x.get('event'), x.get('iteration')) for x in records1]}, carried {carried}; "
                   f"run 2 fetches {got} (records {len(run2.incidents())}), baseline {want}")
    check_all(run1=e1, run2=e2, baseline=e0)
