"""The torch floor (1.9, what PETR and StreamPETR document) held statically, and the flags' fallbacks.

Only torch 2.13 / 2.14 install here, so the package's source is scanned: every torch API newer than 1.9 (checked
against the torch 1.9.0 / 1.10.0 / 1.13.0 / 2.0.0 sources, docs/versions.md) must sit in ``core/flags.py`` or in
the true branch of an ``if`` on its flag. ``petr_stability/testing`` runs on the test stacks only.
"""
import ast
import contextlib
import pathlib
import warnings

import pytest
import torch

from petr_stability.core import flags

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "petr_stability"

#: Attribute chains newer than torch 1.9 -> the flag that gates them (None: no flag yet, so never allowed).
NEWER_CHAINS = {
    "torch.autocast": "HAS_AUTOCAST",  # 1.10
    "torch.cpu.amp": "HAS_AUTOCAST",  # 1.10
    "torch.amp.autocast": "HAS_AUTOCAST",  # 1.13
    "torch.is_autocast_cpu_enabled": "HAS_AUTOCAST",  # 1.10
    "torch._foreach_norm": "HAS_FOREACH_NORM",  # ord argument: 1.13
    "torch.amp.GradScaler": "HAS_TORCH_AMP_GRADSCALER",  # 2.3
    "torch.serialization.safe_globals": "HAS_SAFE_GLOBALS",  # 2.5
    "torch.serialization.add_safe_globals": "HAS_SAFE_GLOBALS",  # 2.4
    "torch.UntypedStorage": None,  # 1.13
    "torch.cuda.OutOfMemoryError": None,  # 1.13
    "torch.cuda.mem_get_info": None,  # 1.10
    "torch.cuda.is_bf16_supported": None,  # 1.10
    "torch.set_float32_matmul_precision": None,  # 1.12
    "torch.compile": None,  # 2.0
    "torch.func": None,  # 2.0
    "torch.vmap": None,  # 2.0
    "dist.all_gather_into_tensor": None,  # 1.13
    "dist.reduce_scatter_tensor": None,  # 1.13
}
#: Method names newer than 1.9 on torch objects (tensors, modules, optimizers), whatever the receiver.
NEWER_METHODS = {
    "untyped_storage": None,  # 2.0
    "register_full_backward_pre_hook": None,  # 2.0
    "register_step_pre_hook": None,  # 2.0 (optimizers)
    "register_step_post_hook": None,  # 2.0
    "register_load_state_dict_post_hook": None,  # 1.13
}
#: Keyword arguments newer than 1.9 -> flag.
NEWER_KEYWORDS = {
    "weights_only": "HAS_WEIGHTS_ONLY",  # torch.load, 1.13
    "with_kwargs": "HAS_FORWARD_PRE_HOOK_KWARGS",  # register_forward_pre_hook, 2.0
    "use_reentrant": "HAS_CHECKPOINT_USE_REENTRANT",  # torch.utils.checkpoint, 1.11
}

#: Ungated uses whose call-site edits are handed to the files' owners (docs/versions.md, "Call sites"): remove an
#: entry once its edit is in. A use not listed here fails the test.
PENDING = set()


def _chain(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _names(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _gated(node, parents, flag):
    """True when ``node`` runs only where ``flag`` holds: inside the body of an ``if``/ternary testing it."""
    child = node
    for parent in reversed(parents):
        if isinstance(parent, (ast.If, ast.IfExp)) and flag in _names(parent.test):
            body = parent.body if isinstance(parent.body, list) else [parent.body]
            if any(child is b for b in body):
                return True
        child = parent
    return False


def ungated_uses(root=PACKAGE):
    """(file relative to the package, api, line, flag) for each newer-than-1.9 use not behind its flag."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "core/flags.py" or rel.startswith("testing/"):
            continue
        tree = ast.parse(path.read_text(), str(path))

        def visit(node, parents, rel=rel):
            hits = []
            if isinstance(node, ast.Attribute):
                chain = _chain(node)
                for api, flag in NEWER_CHAINS.items():
                    if chain == api or (chain or "").startswith(api + "."):
                        hits.append((api, flag))
                if node.attr in NEWER_METHODS and chain not in (f"self.{node.attr}", f"cls.{node.attr}"):
                    hits.append((node.attr, NEWER_METHODS[node.attr]))
            if isinstance(node, ast.keyword) and node.arg in NEWER_KEYWORDS:
                hits.append((node.arg, NEWER_KEYWORDS[node.arg]))
            for api, flag in hits:
                if flag is None or not _gated(node, parents, flag):
                    found.append((rel, api, getattr(node, "lineno", parents[-1].lineno), flag))
            for child in ast.iter_child_nodes(node):
                visit(child, parents + [node])

        visit(tree, [])
    # a chain is seen at each of its prefixes' parents (torch.amp.GradScaler and torch.amp): one report per line
    return sorted(set(found))


def test_every_newer_torch_api_is_behind_its_flag():
    new = [u for u in ungated_uses() if (u[0], u[1]) not in PENDING]
    assert not new, "ungated torch >= 1.10 APIs (gate them in core/flags.py):\n" + "\n".join(
        f"  petr_stability/{f}:{line}: {api} (flag: {flag or 'none yet: add one'})" for f, api, line, flag in new)


def test_the_scan_sees_ungated_and_gated_uses(tmp_path):
    (tmp_path / "mod.py").write_text(
        "import torch\n"
        "from .flags import HAS_AUTOCAST, HAS_WEIGHTS_ONLY\n"
        "def a():\n    return torch.autocast('cpu')\n"
        "def b():\n    if HAS_AUTOCAST:\n        return torch.autocast('cpu')\n    return None\n"
        "def c():\n    if HAS_AUTOCAST:\n        pass\n    else:\n        torch.autocast('cpu')\n"
        "def d(p):\n    return torch.load(p, weights_only=True) if HAS_WEIGHTS_ONLY else None\n"
        "def e(m, h):\n    m.register_forward_pre_hook(h, with_kwargs=True)\n"
        "def f(t):\n    return t.untyped_storage()\n"
    )
    assert [(api, line) for _, api, line, _ in ungated_uses(tmp_path)] == [
        ("torch.autocast", 4), ("torch.autocast", 13), ("untyped_storage", 19), ("with_kwargs", 17)]


def test_pending_call_sites_still_exist():
    """Keeps PENDING honest: an entry whose edit has landed must be removed (so the gate applies there again)."""
    assert {(f, api) for f, api, _, _ in ungated_uses()} >= PENDING


# ------------------------------------------------------------------------------------------ the flags' fallbacks
def test_flags_describe_this_torch():
    assert flags.TORCH_VERSION >= (2, 0)  # the stacks here: every flag is on
    assert flags.HAS_AUTOCAST and flags.HAS_FORWARD_PRE_HOOK_KWARGS and flags.HAS_WEIGHTS_ONLY
    assert flags.HAS_FOREACH_NORM and flags.HAS_SAFE_GLOBALS


def test_autocast_helpers_on_this_torch():
    with flags.autocast("cpu", torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
        with flags.autocast_off():
            assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
        assert torch.is_autocast_enabled("cpu")


def test_autocast_helpers_without_torch_autocast(monkeypatch):
    """torch 1.9: only torch.cuda.amp.autocast (fp16, CUDA); no CPU autocast to switch on or off."""
    monkeypatch.setattr(flags, "HAS_AUTOCAST", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.cuda.amp.autocast is deprecated on this torch
        assert isinstance(flags.autocast("cuda", torch.float16), torch.cuda.amp.autocast)
        assert isinstance(flags.autocast("cuda", enabled=False), torch.cuda.amp.autocast)
        assert isinstance(flags.autocast("cpu", enabled=False), contextlib.nullcontext)
        with flags.autocast_off():
            pass
    with pytest.raises(RuntimeError, match="needs torch >= 1.10"):
        flags.autocast("cpu", torch.float16)
    with pytest.raises(RuntimeError, match="needs torch >= 1.10"):
        flags.autocast("cuda", torch.bfloat16)


def test_grad_scaler_without_torch_amp(monkeypatch):
    monkeypatch.setattr(flags, "HAS_TORCH_AMP_GRADSCALER", False)
    with pytest.raises(RuntimeError, match="needs torch >= 2.3"):
        flags.make_grad_scaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(flags.make_grad_scaler("cuda", init_scale=8.0), torch.cuda.amp.GradScaler)
