"""The restricted unpickler that keeps safe_load safe on torch < 1.13 (no weights_only), tested on this torch.

Every load here goes through ``torch.load(pickle_module=restricted_pickle_module(...))``, as on torch 1.9, and is
compared with ``weights_only=True`` on the same file. Two tests replay torch 1.9.0's own call pattern (its
serialization.py ``_legacy_load`` and ``_load``), which differs from this torch's (no StorageType wrapper).
"""
import builtins
import collections
import io
import os
import pickle
import struct
import zipfile

import pytest
import torch
from torch import nn

import petr_stability.core.safe_load as safe_load_module
from petr_stability.adapters.mmengine_runner.checkpoints import MMENGINE_CHECKPOINT_GLOBALS
from petr_stability.core.errors import UnsafeCheckpointError
from petr_stability.core.safe_load import restricted_pickle_module, safe_load

FORMATS = {"zip": True, "legacy": False}  # torch.save's _use_new_zipfile_serialization


def legacy_load(path, extra_globals=()):
    return safe_load(path, extra_globals=extra_globals, restricted_unpickler=True)


def assert_same(a, b, where="root"):
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad, a.layout) == (b.dtype, b.shape, b.requires_grad, b.layout), where
        if a.is_sparse:
            a, b = a.to_dense(), b.to_dense()
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
        if hasattr(a, "__dict__"):  # a state dict's _metadata
            assert_same(vars(a), vars(b), f"{where}.__dict__")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert_same(vars(a), vars(b), f"{where}.vars")
    elif type(a).__module__ == "numpy":
        import numpy as np

        assert np.array_equal(a, b) and a.dtype == b.dtype, where
    else:
        assert a == b, where


def training_checkpoint():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    base = torch.arange(6.0)
    return {
        "state_dict": model.state_dict(),  # an OrderedDict with _metadata
        "optimizer": opt.state_dict(),  # step tensors, betas tuples, bools, None
        "meta": {"iter": 7, "epoch": 1, "name": "petr", "ratio": 0.25, "big": 2**70, "flags": [True, False, None],
                 "nested": {"a": [1, (2, 3.5), {"b": "c"}]}, "bytes": b"\x00\xff", "set": {1, 2}, "cplx": 1 + 2j,
                 "counts": collections.Counter(a=2), "order": collections.OrderedDict(x=1)},
        "param": nn.Parameter(torch.ones(2)),
        "tensors": {"half": torch.randn(3).half(), "bf16": torch.randn(2).bfloat16(), "int": torch.arange(4),
                    "bool": torch.tensor([True, False]), "empty": torch.empty(0), "base": base, "view": base[2:],
                    "sparse": torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,))},
        "types": [torch.float16, torch.device("cpu"), torch.Size([2, 3])],
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_training_checkpoint_loads_as_weights_only_does(tmp_path, fmt):
    path = str(tmp_path / "ckpt.pth")
    torch.save(training_checkpoint(), path, _use_new_zipfile_serialization=FORMATS[fmt])
    ours = legacy_load(path)
    assert_same(ours, torch.load(path, map_location="cpu", weights_only=True))
    ours["tensors"]["view"][0] = 100.0  # views still share their storage
    assert ours["tensors"]["base"][2] == 100.0


def test_module_exposes_what_torch_load_uses():
    module = restricted_pickle_module()
    assert module.__name__ != "dill" and issubclass(module.Unpickler, pickle._Unpickler)
    assert module.load(io.BytesIO(pickle.dumps({"a": [1, 2.0]}, protocol=2)), encoding="utf-8") == {"a": [1, 2.0]}
    assert restricted_pickle_module().Unpickler is not module.Unpickler  # each call has its own allowlist


# --------------------------------------------------------------------------------------------- malicious files
class RunsShell:
    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


class RunsEval:
    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return builtins.eval, (f"open({self.sentinel!r}, 'w').close()",)


PAYLOADS = {"os.system": (RunsShell, f"{os.system.__module__}.system"), "builtins.eval": (RunsEval, "builtins.eval")}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_torch_saved_code_is_refused_and_never_runs(tmp_path, payload, fmt):
    cls, global_name = PAYLOADS[payload]
    sentinel = tmp_path / "pwned"
    path = str(tmp_path / "evil.pth")
    torch.save({"state_dict": {"w": torch.ones(1)}, "meta": {"x": cls(str(sentinel))}}, path,
               _use_new_zipfile_serialization=FORMATS[fmt])
    with pytest.raises(UnsafeCheckpointError, match=f"outside the safe allowlist.*global {global_name} is not"):
        legacy_load(path, extra_globals=MMENGINE_CHECKPOINT_GLOBALS)
    assert not sentinel.exists()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("payload", PAYLOADS)
def test_raw_pickle_code_is_refused_and_never_runs(tmp_path, payload, protocol):
    cls, global_name = PAYLOADS[payload]
    sentinel = tmp_path / "pwned"
    path = str(tmp_path / "evil.pkl")
    with open(path, "wb") as f:
        pickle.dump({"w": [1, 2], "x": cls(str(sentinel))}, f, protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match=f"global {global_name} is not"):
        legacy_load(path)  # torch.load reads it as a legacy file: the first pickle is the "magic number"
    assert not sentinel.exists()


def test_the_eval_payload_is_live(tmp_path):
    """The control: the same bytes run code under a plain unpickler, so the refusals above are real."""
    sentinel = tmp_path / "pwned"
    pickle.loads(pickle.dumps(RunsEval(str(sentinel)), protocol=2))
    assert sentinel.exists()


def _call(func, *args):
    return func + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def _str(text):
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _getattr_escape(sentinel):
    """getattr(getattr(getattr(_rebuild_tensor_v2, '__globals__'), 'get')('__builtins__'), 'get')('eval')(code):
    only two globals, ``builtins.getattr`` (on MMEngine's list) and a torch rebuild function, both allowlisted."""
    ga = b"h\x00"  # BINGET 0: getattr
    fn = b"ctorch._utils\n_rebuild_tensor_v2\n"
    globals_ = _call(ga, fn, _str("__globals__"))
    builtins_ = _call(_call(ga, globals_, _str("get")), _str("__builtins__"))
    evaluate = _call(_call(ga, builtins_, _str("get")), _str("eval"))
    return b"\x80\x02cbuiltins\ngetattr\nq\x000" + _call(evaluate, _str(f"open({str(sentinel)!r}, 'w').close()")) + b"."


def test_find_class_alone_is_not_enough(tmp_path):
    """An unpickler that only checks globals runs the getattr chain: the reason REDUCE is checked too."""
    allowed = {("builtins", "getattr"), ("torch._utils", "_rebuild_tensor_v2")}

    class FindClassOnly(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) not in allowed:
                raise pickle.UnpicklingError(f"{module}.{name}")
            return super().find_class(module, name)

    sentinel = tmp_path / "pwned"
    FindClassOnly(io.BytesIO(_getattr_escape(sentinel))).load()
    assert sentinel.exists()


def test_getattr_escape_is_refused(tmp_path):
    sentinel = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    path.write_bytes(_getattr_escape(sentinel))
    with pytest.raises(UnsafeCheckpointError, match="getattr.*'__globals__'.* refused"):
        legacy_load(str(path), extra_globals=MMENGINE_CHECKPOINT_GLOBALS)
    assert not sentinel.exists()


def test_getattr_reads_only_class_attributes(tmp_path):
    # torch.serialization._get_layout.cache is a public dict on a function: SETITEMS could then write into it.
    data = b"\x80\x02cbuiltins\ngetattr\nq\x000" + _call(
        b"h\x00", b"ctorch.serialization\n_get_layout\n", _str("cache")) + b"."
    path = tmp_path / "evil.pkl"
    path.write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match="only public attributes of classes"):
        legacy_load(str(path), extra_globals=MMENGINE_CHECKPOINT_GLOBALS)


def test_results_of_allowed_globals_are_never_called(tmp_path):
    # getattr(OrderedDict, 'fromkeys') is a public attribute, but the bound method it returns is not allowlisted.
    data = b"\x80\x02cbuiltins\ngetattr\nq\x000" + _call(
        _call(b"h\x00", b"ccollections\nOrderedDict\n", _str("fromkeys")), b"]" + _str("k") + b"a") + b"."
    path = tmp_path / "evil.pkl"
    path.write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match="call of collections.OrderedDict.fromkeys refused"):
        legacy_load(str(path), extra_globals=MMENGINE_CHECKPOINT_GLOBALS)


@pytest.mark.parametrize("data, refused", [
    (b"(ccollections\nOrderedDict\no.", "opcode OBJ"),  # protocol 1 instantiation of whatever is on the stack
    (b"(S'true'\niposix\nsystem\n.", "opcode INST"),  # protocol 0 instantiation
    (b"\x80\x02\x82\x01.", "opcode EXT1"),  # the copyreg extension registry
    (b"\x80\x02]cbuiltins\nset\n)Rq\x00h\x00a.", "APPEND into a builtins.set"),
])
def test_object_building_opcodes_are_refused(tmp_path, data, refused):
    path = tmp_path / "evil.pkl"
    path.write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match=refused):
        legacy_load(str(path))


def test_a_pickled_module_is_refused(tmp_path):
    path = str(tmp_path / "model.pth")
    torch.save(nn.Linear(2, 2), path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointError, match="torch.nn.modules.linear.Linear is not allowlisted"):
        legacy_load(path)


def test_torchscript_archive_is_refused(tmp_path):
    path = str(tmp_path / "scripted.pt")
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), path)
    with pytest.raises(UnsafeCheckpointError, match="TorchScript"):
        legacy_load(path)


def test_truncated_file_raises_but_not_as_a_refusal(tmp_path):
    path = str(tmp_path / "trunc.pth")
    torch.save({"w": torch.ones(1000), "meta": list(range(100))}, path, _use_new_zipfile_serialization=False)
    with open(path, "r+b") as f:
        f.truncate(150)
    with pytest.raises((RuntimeError, EOFError, pickle.UnpicklingError)) as info:
        legacy_load(path)
    assert not isinstance(info.value, UnsafeCheckpointError)


# ----------------------------------------------------------------------------------------- runners' checkpoints
def mmengine_like_checkpoint():
    np = pytest.importorskip("numpy")
    history = pytest.importorskip("mmengine.logging.history_buffer")
    buf = history.HistoryBuffer()
    for v in (1.0, 0.5, 0.25):
        buf.update(v)
    return {
        "meta": {"epoch": 1, "iter": 8, "seed": 3, "experiment_name": "petr"},
        "state_dict": collections.OrderedDict(w=torch.ones(2)),
        "message_hub": {"log_scalars": {"train/loss": buf}, "runtime_info": {"iter": 8, "arr": np.arange(3.0),
                                                                             "scalar": np.float32(0.5)},
                        "resumed_keys": {"iter": True}},
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_mmengine_checkpoint_loads_with_its_globals(tmp_path, fmt):
    path = str(tmp_path / "iter_8.pth")
    torch.save(mmengine_like_checkpoint(), path, _use_new_zipfile_serialization=FORMATS[fmt])
    ours = legacy_load(path, extra_globals=MMENGINE_CHECKPOINT_GLOBALS)
    assert_same(ours, safe_load(path, extra_globals=MMENGINE_CHECKPOINT_GLOBALS, restricted_unpickler=False))
    assert ours["message_hub"]["log_scalars"]["train/loss"].mean() == pytest.approx(1.75 / 3)
    with pytest.raises(UnsafeCheckpointError, match="HistoryBuffer|numpy"):  # the call's list, nothing standing
        legacy_load(path)


def test_mmcv1_checkpoint_loads_without_extra_globals(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    ckpt = {"meta": {"epoch": 2, "iter": 10, "mmcv_version": "1.6.0", "time": "Mon", "config": "model = dict()",
                     "CLASSES": ("car", "truck"), "hook_msgs": {"last_ckpt": "work_dirs/epoch_2.pth"}},
            "state_dict": model.state_dict(), "optimizer": opt.state_dict()}
    path = str(tmp_path / "epoch_2.pth")
    torch.save(ckpt, path, _use_new_zipfile_serialization=False)  # torch 1.9 and mmcv-full write the zip format
    assert_same(legacy_load(path), torch.load(path, map_location="cpu", weights_only=True))


# -------------------------------------------------------------------------------------------- which path runs
def test_without_weights_only_safe_load_takes_the_unpickler(tmp_path, monkeypatch):
    path = str(tmp_path / "ok.pth")
    torch.save({"w": torch.ones(2)}, path)
    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(safe_load_module, "HAS_WEIGHTS_ONLY", False)  # as on torch < 1.13
    monkeypatch.setattr(torch, "load", spy)
    assert torch.equal(safe_load(path)["w"], torch.ones(2))
    (kwargs,) = seen
    assert kwargs["pickle_module"].__name__ == "petr_stability_restricted_pickle" and "weights_only" not in kwargs
    with pytest.raises(UnsafeCheckpointError, match="needs >= 1.13"):
        safe_load(path, restricted_unpickler=False)


def test_with_weights_only_safe_load_keeps_it(tmp_path, monkeypatch):
    path = str(tmp_path / "ok.pth")
    torch.save({"w": torch.ones(2)}, path)
    seen = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k) or real_load(*a, **k))
    safe_load(path)
    assert seen[0]["weights_only"] is True and "pickle_module" not in seen[0]


# ---------------------------------------------------------------------------- torch 1.9.0's own call pattern
def _torch19_legacy_load(f, pickle_module, **pickle_load_args):
    """torch 1.9.0 serialization.py ``_legacy_load`` (non-tar branch), the pickle-module calls verbatim."""
    pickle_load_args.setdefault("encoding", "utf-8")
    ids = []

    def persistent_load(saved_id):
        ids.append(saved_id)
        return torch.zeros(saved_id[4], dtype=torch.float32).storage()  # the (typename, type, key, loc, size, view)

    assert pickle_module.load(f, **pickle_load_args) == 0x1950A86A20F9469CFC6C  # MAGIC_NUMBER
    assert pickle_module.load(f, **pickle_load_args) == 1001  # PROTOCOL_VERSION
    pickle_module.load(f, **pickle_load_args)  # sys_info
    unpickler = pickle_module.Unpickler(f, **pickle_load_args)
    unpickler.persistent_load = persistent_load
    result = unpickler.load()
    keys = pickle_module.load(f, **pickle_load_args)  # deserialized_storage_keys
    return result, ids, keys


def test_torch19_legacy_call_pattern(tmp_path):
    path = str(tmp_path / "legacy.pth")
    torch.save({"w": torch.ones(3), "meta": {"iter": 2}}, path, _use_new_zipfile_serialization=False)
    with open(path, "rb") as f:
        result, ids, keys = _torch19_legacy_load(f, restricted_pickle_module())
    assert result["meta"] == {"iter": 2} and result["w"].shape == (3,)
    (pid,) = ids
    assert pid[0] == "storage" and pid[1] is restricted_pickle_module().Unpickler.allowed["torch.FloatStorage"]
    assert keys == [pid[2]]


def test_torch19_zipfile_call_pattern(tmp_path):
    """torch 1.9.0 ``_load``: its UnpicklerWrapper subclasses ``pickle_module.Unpickler`` and maps module names."""
    module = restricted_pickle_module()

    class UnpicklerWrapper(module.Unpickler):
        def find_class(self, mod_name, name):
            return super().find_class({"torch.tensor": "torch._tensor"}.get(mod_name, mod_name), name)

    path = str(tmp_path / "zip.pth")
    torch.save({"w": torch.ones(3)}, path)
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    unpickler = UnpicklerWrapper(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = lambda saved_id: torch.zeros(saved_id[4]).storage()
    assert unpickler.load()["w"].shape == (3,)
