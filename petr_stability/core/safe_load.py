"""Checkpoint loading that never runs arbitrary pickled code.

On torch >= 1.13 ``torch.load(weights_only=True)`` with a scoped allowlist does it. Older torch (the PETR and
StreamPETR stacks document torch 1.9.0) has no ``weights_only``: there the same allowlist is enforced by
:func:`restricted_pickle_module`, an unpickler passed as ``torch.load(pickle_module=...)``.
"""
import _compat_pickle
import collections
import contextlib
import functools
import importlib
import pickle
import pickletools
import struct
import types
import zipfile
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence

import torch

from .errors import UnsafeCheckpointError
from .flags import HAS_SAFE_GLOBALS, HAS_WEIGHTS_ONLY

__all__ = ["resolve_globals", "safe_load", "allow_globals", "restricted_pickle_module", "RestrictedUnpickler"]


def _resolve_named(names: Sequence[str]) -> Dict[str, Any]:
    """Dotted name -> object for each name that exists in this environment; absent ones are skipped."""
    found: Dict[str, Any] = {}
    for name in names:
        module_name, _, attr = name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
            found[name] = getattr(module, attr)
        except (ImportError, AttributeError):
            continue
    return found


def resolve_globals(names: Sequence[str]) -> List[Any]:
    """Imports each dotted name that exists in this environment; absent ones are skipped."""
    found: List[Any] = []
    for obj in _resolve_named(names).values():
        if not any(obj is f for f in found):  # numpy.core and numpy._core name the same objects
            found.append(obj)
    return found


@contextlib.contextmanager
def allow_globals(names: Sequence[str]) -> Iterator[None]:
    """Allows ``names`` for ``weights_only`` loads inside the block only (no-op before torch 2.5)."""
    if HAS_SAFE_GLOBALS:
        with torch.serialization.safe_globals(resolve_globals(names)):
            yield
    else:
        yield


# ------------------------------------------------------------------------------------- restricted unpickler
class _Refused(pickle.UnpicklingError):
    """The file asks for something outside the allowlist (never raised for a merely corrupt file)."""


#: What torch's weights-only unpickler allows by default (torch/_weights_only_unpickler.py, torch 2.x), by the
#: names a pickle uses; the names absent from this torch (newer rebuild functions on 1.9) are skipped. dtypes,
#: qschemes and the tensor and storage classes are added from the running torch.
_TORCH_GLOBALS = (
    "collections.OrderedDict",
    "collections.Counter",
    "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout",
    "torch.Size",
    "torch.Tensor",
    "torch.device",
    "_codecs.encode",  # bytes, as protocol 2 pickles them
    "builtins.bytearray",
    "builtins.set",
    "builtins.complex",
    "torch._tensor._rebuild_from_type_v2",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_meta_tensor_no_storage",
    "torch._utils._rebuild_nested_tensor",
    "torch._utils._rebuild_wrapper_subclass",
    "torch._utils._rebuild_device_tensor_from_numpy",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor",
)


def _qualified_name(obj: Any) -> Optional[str]:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else None


def _add(allowed: Dict[str, Any], name: str, obj: Any) -> None:
    # A class or function is allowed under the name the caller gave and under its own qualified name (how
    # torch's safe_globals keys it): a pickle names it either way (torch.Tensor is pickled as torch._tensor.Tensor).
    allowed[name] = obj
    qualified = _qualified_name(obj)
    if qualified is not None:
        allowed.setdefault(qualified, obj)


@functools.lru_cache(maxsize=None)
def _torch_allowlist() -> Dict[str, Any]:
    allowed: Dict[str, Any] = {}
    for name, obj in _resolve_named(_TORCH_GLOBALS).items():
        _add(allowed, name, obj)
    leaf_types = tuple(t for t in (torch.dtype, getattr(torch, "qscheme", None)) if isinstance(t, type))
    for value in vars(torch).values():
        if isinstance(value, leaf_types):
            allowed[str(value)] = value  # 'torch.float32', 'torch.per_tensor_affine': how dtypes pickle
    for cls in getattr(torch, "_tensor_classes", ()):
        allowed[f"{cls.__module__}.{cls.__name__}"] = cls
    storage_type = getattr(torch.serialization, "StorageType", None)
    untyped = tuple(getattr(torch.storage, n) for n in ("TypedStorage", "UntypedStorage") if hasattr(torch.storage, n))
    for cls in getattr(torch, "_storage_classes", ()):
        # torch < 2.0 reads a storage through its class (data_type(size)); newer torch wraps the legacy typed
        # classes in an inert StorageType, as its weights-only unpickler does.
        wrapped = storage_type(cls.__name__) if storage_type is not None and cls not in untyped else cls
        allowed[f"{cls.__module__}.{cls.__name__}"] = wrapped
    return allowed


def _public_getattr(obj: Any, name: Any, *default: Any) -> Any:
    """``getattr`` as an allowlisted global may call it: public attributes of classes only.

    MMEngine checkpoints need ``getattr``: protocol 2 pickles a method such as ``HistoryBuffer.min`` as
    ``getattr(HistoryBuffer, 'min')``, a public name on a class, and that is all this allows. Private and dunder
    names (``__globals__``, ``__dict__``, ``__class__``) would reach module namespaces, and attributes of other
    objects (a function's ``cache`` dict) are state a pickle could then write into.
    """
    if not isinstance(obj, type) or not isinstance(name, str) or name.startswith("_"):
        raise _Refused(f"getattr({_describe(obj)}, {name!r}) refused: only public attributes of classes are read")
    return getattr(obj, name, *default)


def _describe(obj: Any) -> str:
    qualname = getattr(obj, "__qualname__", None)
    # A bound method of a C type has no __module__; its owner has.
    module = getattr(obj, "__module__", None) or getattr(getattr(obj, "__self__", None), "__module__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    return f"{type(obj).__module__}.{type(obj).__qualname__} object"


_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}


class _Dispatch(dict):
    """Opcode table whose absent entries refuse: an opcode not listed never runs."""

    def __missing__(self, code: int) -> Callable[[Any], None]:
        def refuse(_: Any) -> None:
            raise _Refused(f"pickle opcode {_OPCODE_NAMES.get(code, code)} is not allowed")

        return refuse


# Opcodes that only build data (numbers, strings, containers, memo, framing) run as in the pure-Python pickle.
# GLOBAL and STACK_GLOBAL go through find_class. Absent, so refused: PERSID (text ids), INST and OBJ (protocol
# 0/1 instantiation of any class on the stack), EXT1/2/4 (the copyreg extension registry), NEXT_BUFFER and
# READONLY_BUFFER (out-of-band buffers). Those that call or mutate objects are re-implemented below.
_DATA_OPCODES = (
    "MARK", "STOP", "POP", "POP_MARK", "DUP", "FLOAT", "INT", "BININT", "BININT1", "LONG", "BININT2", "NONE",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "DICT", "EMPTY_DICT", "GET", "BINGET",
    "LONG_BINGET", "LIST", "EMPTY_LIST", "PUT", "BINPUT", "LONG_BINPUT", "TUPLE", "EMPTY_TUPLE", "BINFLOAT",
    "PROTO", "TUPLE1", "TUPLE2", "TUPLE3", "NEWTRUE", "NEWFALSE", "LONG1", "LONG4", "BINBYTES", "SHORT_BINBYTES",
    "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES8", "EMPTY_SET", "FROZENSET", "MEMOIZE", "FRAME", "BYTEARRAY8",
    "GLOBAL", "STACK_GLOBAL",
)
_SETITEM_TARGETS = (dict, collections.OrderedDict, collections.Counter)


class RestrictedUnpickler(pickle._Unpickler):
    """An unpickler that resolves and calls only allowlisted globals, with torch's weights-only semantics.

    Built on the pure-Python unpickler because restricting ``find_class`` alone is not enough: ``REDUCE``
    would still call whatever callable an allowed global returns (``getattr`` hands out bound methods). As in
    torch's weights-only unpickler: ``REDUCE`` calls, and ``NEWOBJ`` instantiates, only allowlisted objects;
    ``BUILD`` sets state only on tensors, ``OrderedDict`` and instances of allowlisted classes; items go only
    into plain lists, sets and dicts; a persistent id must name a storage. Use :func:`restricted_pickle_module`,
    which binds an allowlist to a subclass.
    """

    allowed: Dict[str, Any] = {}
    allowed_ids: FrozenSet[int] = frozenset()
    dispatch = _Dispatch({getattr(pickle, op)[0]: pickle._Unpickler.dispatch[getattr(pickle, op)[0]]
                          for op in _DATA_OPCODES})

    def load(self) -> Any:
        """Reads one pickle; a truncated or corrupt one raises ``UnpicklingError`` (as the C unpickler does)."""
        try:
            return super().load()
        except (IndexError, KeyError, struct.error) as exc:  # the pure-Python unpickler's errors on short data
            raise pickle.UnpicklingError(f"pickle data was truncated or corrupt ({type(exc).__name__}: {exc})") from exc

    def find_class(self, module: str, name: str) -> Any:
        """Returns the allowlisted object named ``module.name``; never imports anything."""
        if self.proto < 3 and self.fix_imports:  # Python 2 names, as the standard unpickler maps them
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        if full not in self.allowed:
            raise _Refused(f"global {full} is not allowlisted")
        return self.allowed[full]

    def _check_allowed(self, obj: Any, what: str) -> None:
        if id(obj) not in self.allowed_ids:
            raise _Refused(f"{what} {_describe(obj)} refused: it is not an allowlisted global")

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        self._check_allowed(func, "call of")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self._check_allowed(cls, "creation of")
        self.append(torch.nn.Parameter(*args) if cls is torch.nn.Parameter else cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self._check_allowed(cls, "creation of")
        self.append(cls.__new__(cls, *args, **kwargs))

    def load_build(self) -> None:
        inst = self.stack[-2]
        kind = type(inst)
        if id(kind) in self.allowed_ids and kind not in (torch.Tensor, torch.nn.Parameter):
            super().load_build()  # __setstate__, or the instance's __dict__ and slots, as pickle does
            return
        state = self.stack.pop()
        if kind is torch.Tensor:
            inst.set_(*state)  # legacy tensor pickles
        elif kind is torch.nn.Parameter:
            inst.__setstate__(state)
        elif kind is collections.OrderedDict:
            inst.__dict__.update(state)  # a state dict's _metadata
        else:
            raise _Refused(f"setting the state of a {_describe(kind)} refused: its type is not allowlisted")

    def _target(self, kinds: tuple, opcode: str) -> Any:
        target = self.stack[-1]
        if type(target) not in kinds:
            raise _Refused(f"{opcode} into a {_describe(type(target))} refused")
        return target

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target((list,), "APPEND").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._target((list,), "APPENDS").extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._target(_SETITEM_TARGETS, "SETITEM")[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._target(_SETITEM_TARGETS, "SETITEMS")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._target((set,), "ADDITEMS").update(items)

    def load_binpersid(self) -> None:
        pid = self.stack.pop()
        # torch resolves a persistent id to a storage; anything else (a pickled nn.Module's 'module' id) is refused.
        kind = pid[0].decode("ascii") if isinstance(pid, tuple) and pid and isinstance(pid[0], bytes) else (
            pid[0] if isinstance(pid, tuple) and pid else None)
        if not (type(pid) is int or kind == "storage"):
            raise _Refused(f"persistent id {kind or type(pid).__name__!r} refused: only storages are loaded")
        self.append(self.persistent_load(pid))


for _name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS",
              "BINPERSID"):
    RestrictedUnpickler.dispatch[getattr(pickle, _name)[0]] = getattr(RestrictedUnpickler, f"load_{_name.lower()}")


def restricted_pickle_module(extra_globals: Sequence[str] = ()) -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load`` that allows only torch's tensor globals plus ``extra_globals``.

    It exposes what ``torch.load`` uses of a pickle module on every torch from 1.9 on: ``Unpickler`` (subclassed
    by torch's loaders, created as ``Unpickler(file, **pickle_load_args)``, given a ``persistent_load``),
    ``load(file, **pickle_load_args)`` (the legacy format's headers) and ``__name__``.

    Args:
        extra_globals: dotted names of the non-tensor types the file may hold, allowed for this module only.
            ``builtins.getattr`` reads public attributes of classes only. Defaults to none.
    """
    allowed = dict(_torch_allowlist())
    for name, obj in _resolve_named(extra_globals).items():
        _add(allowed, name, _public_getattr if obj is getattr else obj)
    unpickler = type("Unpickler", (RestrictedUnpickler,),
                     {"allowed": allowed, "allowed_ids": frozenset(id(v) for v in allowed.values())})

    def load(file: Any, **kwargs: Any) -> Any:
        return unpickler(file, **kwargs).load()

    module = types.ModuleType("petr_stability_restricted_pickle", "torch.load pickle_module with an allowlist")
    module.Unpickler = unpickler  # type: ignore[attr-defined]
    module.load = load  # type: ignore[attr-defined]
    module.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
    return module


def _refuse_torchscript(path: str) -> None:
    # torch.load hands a TorchScript archive to torch.jit.load without the pickle module; weights_only refuses it.
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if any(n.split("/", 1)[-1] == "constants.pkl" for n in archive.namelist()):
                raise UnsafeCheckpointError(f"refused to load {path}: it is a TorchScript archive, not a checkpoint")


# ------------------------------------------------------------------------------------------------- safe_load
def safe_load(path: str, map_location: Any = "cpu", extra_globals: Sequence[str] = (),
              restricted_unpickler: Optional[bool] = None) -> Dict:
    """Loads a checkpoint with a minimal allowlist scoped to this call; no pickled code runs.

    Args:
        path: the file.
        map_location: as for ``torch.load``. Defaults to ``'cpu'``.
        extra_globals: dotted names of the non-tensor types the file may hold, allowed for this call only (a runner
            family's list: :data:`~petr_stability.adapters.mmengine_runner.checkpoints.MMENGINE_CHECKPOINT_GLOBALS`).
            Defaults to none.
        restricted_unpickler: load through :func:`restricted_pickle_module` instead of ``weights_only=True``.
            Defaults to None: exactly when this torch has no ``weights_only`` (torch < 1.13).

    Raises:
        UnsafeCheckpointError: the file asks for a global outside the allowlist (a malicious or foreign
            pickle): the message says which one. Truncated files raise the underlying error.
    """
    if restricted_unpickler is None:
        restricted_unpickler = not HAS_WEIGHTS_ONLY
    try:
        if restricted_unpickler:
            _refuse_torchscript(path)
            # torch >= 1.13 refuses an explicit pickle_module unless weights_only is False; older torch has no such
            # argument (it would reach the Unpickler as a keyword).
            kwargs = {"weights_only": False} if HAS_WEIGHTS_ONLY else {}
            return torch.load(path, map_location=map_location, pickle_module=restricted_pickle_module(extra_globals),
                              **kwargs)
        if HAS_WEIGHTS_ONLY:
            with allow_globals(extra_globals):
                return torch.load(path, map_location=map_location, weights_only=True)
        raise UnsafeCheckpointError(
            f"cannot load {path} with weights_only: torch {torch.__version__} has none (needs >= 1.13); "
            "restricted_unpickler=False was asked for"
        )
    except pickle.UnpicklingError as exc:
        if restricted_unpickler and not isinstance(exc, _Refused):
            raise  # a corrupt file, not a refusal
        raise UnsafeCheckpointError(
            f"refused to load {path}: it needs a type outside the safe allowlist, so it could run code "
            f"when unpickled ({str(exc).splitlines()[0]})"
        ) from exc
