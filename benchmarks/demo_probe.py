"""Exploration probe for the demo's ``dynamics`` scenario: a plain torch loop with the demo's fp16 step.

Trains the PETR-shaped model (CPU fp16 autocast, a dynamic ``GradScaler``, ``clip_grad_norm_``, AdamW,
linear warm-up then cosine) at a given learning rate and prints per-step loss, grad_norm, loss scale and the
largest attention logit, so a regime where the default run diverges can be found quickly.
``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/demo_probe.py --lr 3e-3 --iters 120``
"""
import argparse
import math
import time

import torch
import torch.nn.functional as F

from petr_stability.core.flags import make_grad_scaler
from petr_stability.core.watch.spikes import GradNormMonitor
from petr_stability.demo.run import _layer_cfg
from petr_stability.testing.petr_like import PETRLike, make_batch

__all__ = ["main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=35.0)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--num-query", type=int, default=16)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--const", action="store_true", help="no cosine decay")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--adaptive", action="store_true", help="clip at GradNormMonitor.clip_bound(max_norm)")
    return p


def main(argv=None) -> dict:
    a = parser().parse_args(argv)
    torch.manual_seed(a.seed)
    model = PETRLike(num_layers=a.layers, num_query=a.num_query, layer_cfg=_layer_cfg(a.dropout))
    data = make_batch(a.iters * a.batch + 16, tokens=a.tokens, num_query=a.num_query, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)
    scaler = make_grad_scaler("cpu")
    monitor = GradNormMonitor(window=50, z=3.0, warmup=10)
    max_norm = a.max_norm
    logits = []
    attns = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]

    def probe(mod, inp, kw, out):
        q = kw["query"]
        k = kw["key"]
        w = mod.in_proj_weight
        d = mod.embed_dim
        hd = d // mod.num_heads
        qq = F.linear(q.float(), w[:d].float(), mod.in_proj_bias[:d].float())
        kk = F.linear(k.float(), w[d:2 * d].float(), mod.in_proj_bias[d:2 * d].float())
        lq = qq.reshape(qq.shape[0], -1, hd).transpose(0, 1)
        lk = kk.reshape(kk.shape[0], -1, hd).transpose(0, 1)
        logits.append(float((lq @ lk.transpose(1, 2)).abs().max()) / math.sqrt(hd))

    for m in attns:
        m.register_forward_hook(probe, with_kwargs=True)
    t0 = time.perf_counter()
    skipped = 0
    first_bad = None
    ever_skipped_after_calib = 0
    for it in range(a.iters):
        if it < a.warmup:
            lr = a.lr * (1 / 3 + (2 / 3) * it / a.warmup)
        elif a.const:
            lr = a.lr
        else:
            lr = 2e-7 + (a.lr - 2e-7) * 0.5 * (1 + math.cos(math.pi * (it - a.warmup) / (a.iters - a.warmup)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = data[it * a.batch:(it + 1) * a.batch]
        x = torch.stack([b["inputs"] for b in batch])
        c = torch.stack([b["cls_t"] for b in batch])
        r = torch.stack([b["reg_t"] for b in batch])
        logits.clear()
        model.train()
        with torch.autocast("cpu", dtype=torch.float16):
            losses = model.losses(x, c, r)
        loss = sum(losses.values())
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        if a.adaptive:
            monitor.observe(gn)
            max_norm = monitor.clip_bound(a.max_norm)
        scaler.step(opt)
        scaler.update()
        skipped += 0 if math.isfinite(gn) else 1
        if not math.isfinite(gn) and it > 12:
            ever_skipped_after_calib += 1
            if first_bad is None:
                first_bad = it
        fin = all(bool(torch.isfinite(t).all()) for t in list(model.parameters()) + list(model.buffers()))
        if a.quiet:
            continue
        if it % a.every == 0 or it == a.iters - 1 or not math.isfinite(gn):
            print(f"it {it:4d} lr {lr:.2e} loss {float(loss):8.3f} gn {gn:10.3g} scale {scaler.get_scale():8g} "
                  f"logit {max(logits) if logits else 0:9.1f} finite {fin} skipped {skipped} "
                  f"{time.perf_counter() - t0:5.1f}s", flush=True)
    # held-out eval loss without nan_to_num
    model.eval()
    hx = torch.stack([b["inputs"] for b in data[-16:]])
    hc = torch.stack([b["cls_t"] for b in data[-16:]])
    hr = torch.stack([b["reg_t"] for b in data[-16:]])
    head = model.pts_bbox_head
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        mem = model.img_backbone(hx).transpose(0, 1)
        q = head.query_embedding.weight.unsqueeze(1).expand(-1, hx.shape[0], -1)
        out = torch.zeros_like(q)
        for layer in head.layers:
            out = layer(out, key=mem, value=mem, query_pos=q)
        cls = head.cls_branch(out).transpose(0, 1).float()
        reg = head.reg_branch(out).transpose(0, 1).float()
    ev = float(F.cross_entropy(cls.flatten(0, 1), hc.flatten()) + F.l1_loss(reg, hr))
    res = dict(eval=ev, skipped=skipped, late_skips=ever_skipped_after_calib, first_bad=first_bad,
               scale=scaler.get_scale(), time=time.perf_counter() - t0)
    print("RESULT", argv, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}, flush=True)
    return res


if __name__ == "__main__":
    main()
