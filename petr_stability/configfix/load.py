"""Reading configs as the runner does: through ``mmengine.config.Config`` or MMCV 1.x's ``mmcv.Config``."""
import ast
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from .keys import plain

__all__ = [
    "LOADERS",
    "NoConfigLoaderError",
    "ConfigSource",
    "available_loaders",
    "default_loader",
    "load_config",
    "load_config_text",
    "read_config",
    "base_files",
    "uses_read_base",
]

#: The config readers this package can use: ``'mmengine'`` (``mmengine.config.Config``) and ``'mmcv'`` (MMCV 1.x's
#: ``mmcv.Config``; mmcv 2.x has none). Both merge ``_base_`` files and resolve ``{{_base_.x}}``; only MMEngine
#: reads ``_base_.x`` references and ``read_base()`` configs.
LOADERS = ("mmengine", "mmcv")


class NoConfigLoaderError(ImportError):
    """Neither mmengine nor MMCV 1.x is installed, so no config file can be read."""


@dataclass
class ConfigSource:
    """A config as plain dicts, and where it came from.

    Attributes:
        config: the merged config (``_base_`` files merged, ``_delete_`` resolved).
        source: what it was read from, for messages (a path, ``'config text'``, ``"the run's effective config"``).
        path: the ``.py`` file it was read from; None for a dict, a ``Config`` object or config text.
    """

    config: Dict[str, Any]
    source: str
    path: Optional[str] = None


@functools.lru_cache(maxsize=None)
def _config_class(loader: str) -> Optional[type]:
    """The ``Config`` class of ``loader``, or None where it is not installed (imported once, on first use)."""
    try:
        if loader == "mmengine":
            from mmengine.config import Config as cls
        else:
            import mmcv

            cls = getattr(mmcv, "Config", None)  # mmcv 2.x has none: for configs it is "not installed"
    except ImportError:
        return None
    return cls


def available_loaders() -> Tuple[str, ...]:
    """The loaders of :data:`LOADERS` installed here, in order of preference."""
    return tuple(name for name in LOADERS if _config_class(name) is not None)


def default_loader() -> str:
    """``'mmengine'`` where mmengine is importable, else ``'mmcv'`` (MMCV 1.x).

    Raises:
        NoConfigLoaderError: neither is installed.
    """
    for name in LOADERS:  # in order, so that MMCV 1.x is not imported (it warns on import) where mmengine is there
        if _config_class(name) is not None:
            return name
    raise NoConfigLoaderError("reading a config file needs mmengine (mmengine.config.Config) or MMCV 1.x "
                              "(mmcv.Config, mmcv < 2.0); neither is installed")


def _loader_class(loader: Optional[str]) -> type:
    name = default_loader() if loader is None else loader
    if name not in LOADERS:
        raise ValueError(f"loader must be one of {list(LOADERS)} or None, got {loader!r}")
    cls = _config_class(name)
    if cls is None:
        what = "mmengine" if name == "mmengine" else "MMCV 1.x (mmcv < 2.0, which has mmcv.Config)"
        raise NoConfigLoaderError(f"loader={name!r} needs {what}, which is not installed")
    return cls


def load_config(path: Union[str, os.PathLike], loader: Optional[str] = None) -> Dict[str, Any]:
    """Reads an MMEngine or MMCV 1.x Python config with its ``_base_`` files merged in.

    ``custom_imports`` is kept as data and never imported (``import_custom_modules=False``).

    Args:
        path: the config file (``.py``).
        loader: ``'mmengine'`` or ``'mmcv'``. Defaults to None (:func:`default_loader`).

    Returns:
        The merged config as plain dicts, lists and scalars.

    Raises:
        FileNotFoundError: the file (or one of its ``_base_`` files) does not exist.
        ValueError: not a ``.py`` file, or reading it failed (the message names the file and the error).
        NoConfigLoaderError: no loader is installed.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"config path must be a string, got {path!r}")
    path = os.path.abspath(os.fspath(path))
    if not path.endswith(".py"):
        raise ValueError(f"only Python configs (.py) can be read, got {path}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} does not exist")
    cls = _loader_class(loader)
    try:
        return plain(cls.fromfile(path, import_custom_modules=False).to_dict())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path}: {exc}") from exc
    except Exception as exc:  # NameError, ImportError, SyntaxError, ... raised by the config's own code
        raise ValueError(f"could not read config {path}: {type(exc).__name__}: {exc}") from exc


def _absolute_bases(text: str, base_dir: str) -> str:
    """``text`` with relative ``_base_`` paths made absolute against ``base_dir`` (the text itself has no file)."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise ValueError(f"config text is not valid Python: {exc}") from exc
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_base_" for t in node.targets):
            bases = _literal_bases(node.value, "config text")
            fixed = [b if os.path.isabs(b) or "::" in b else os.path.normpath(os.path.join(base_dir, b))
                     for b in bases]
            lines = text.splitlines(keepends=True)
            start = sum(len(line) for line in lines[:node.value.lineno - 1]) + node.value.col_offset
            end = sum(len(line) for line in lines[:node.value.end_lineno - 1]) + node.value.end_col_offset
            return text[:start] + repr(fixed) + text[end:]
    return text


def load_config_text(text: str, base_dir: Optional[str] = None, loader: Optional[str] = None) -> Dict[str, Any]:
    """Reads config *text*, e.g. what MMCV 1.x runners keep in ``runner.meta['config']`` (``cfg.pretty_text``).

    Both frameworks' ``Config.fromstring`` go through ``fromfile`` with ``import_custom_modules=True``, so the text
    is written to a private temporary file here and read with ``import_custom_modules=False`` instead. Relative
    ``_base_`` paths are made absolute against ``base_dir`` first (``{{ fileDirname }}`` names the temporary dir).

    Args:
        text: the config's Python source.
        base_dir: where relative ``_base_`` paths are resolved. Defaults to None (the working directory).
        loader: ``'mmengine'`` or ``'mmcv'``. Defaults to None (:func:`default_loader`).

    Returns:
        The merged config as plain dicts.
    """
    if not isinstance(text, str):
        raise TypeError(f"config text must be a string, got {type(text).__name__}")
    text = _absolute_bases(text, os.path.abspath(base_dir or os.getcwd()))
    tmp = tempfile.mkdtemp(prefix="petr_stability_config_")
    path = os.path.join(tmp, "config_text.py")
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return load_config(path, loader)
    except ValueError as exc:
        raise ValueError(str(exc).replace(f"config {path}", "config text").replace(path, "config text")) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_config(cfg_like: Any, base_dir: Optional[str] = None, loader: Optional[str] = None) -> ConfigSource:
    """Any config a caller holds as plain dicts: a dict, an mmengine or mmcv ``Config``, a ``.py`` path or text.

    Args:
        cfg_like: the config. A string with a newline is config text; any other string is a path.
        base_dir: where relative ``_base_`` paths of config text are resolved. Defaults to the working directory.
        loader: for a path or text: ``'mmengine'`` or ``'mmcv'``. Defaults to None (:func:`default_loader`).

    Returns:
        A :class:`ConfigSource`.
    """
    if isinstance(cfg_like, Mapping):
        return ConfigSource(plain(cfg_like), "the run's effective config")
    if isinstance(cfg_like, os.PathLike):
        cfg_like = os.fspath(cfg_like)
    if isinstance(cfg_like, str):
        if "\n" in cfg_like:
            return ConfigSource(load_config_text(cfg_like, base_dir, loader), "config text")
        path = os.path.abspath(cfg_like)
        return ConfigSource(load_config(path, loader), path, path)
    to_dict = getattr(cfg_like, "to_dict", None)  # mmengine Config; mmcv 1.x Config hands it to its ConfigDict
    if callable(to_dict):
        return ConfigSource(plain(to_dict()), "the run's effective config")
    inner = getattr(cfg_like, "_cfg_dict", None)
    if isinstance(inner, Mapping):
        return ConfigSource(plain(inner), "the run's effective config")
    raise TypeError(f"expected a config (a dict, an mmengine or mmcv Config, a .py path or config text), got "
                    f"{type(cfg_like).__name__}")


def _literal_bases(value: ast.expr, where: str) -> List[str]:
    try:
        bases = ast.literal_eval(value)
    except ValueError as exc:
        raise ValueError(f"{where}: _base_ must be a string or a list of strings") from exc
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, (list, tuple)) or not all(isinstance(b, str) for b in bases):
        raise ValueError(f"{where}: _base_ must be a string or a list of strings, got {bases!r}")
    return list(bases)


def _tree(path: str) -> Optional[ast.Module]:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


def uses_read_base(path: str) -> bool:
    """Whether a config file inherits with ``with read_base():`` (an MMEngine lazy-import config)."""
    tree = _tree(path)
    for node in tree.body if tree is not None else []:
        for item in node.items if isinstance(node, ast.With) else []:
            call = item.context_expr
            if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", "")) == "read_base":
                return True
    return False


def base_files(path: str) -> Optional[List[str]]:
    """The absolute ``_base_`` files of a config file, in order; None where that cannot be told from the file
    (it does not parse, ``read_base()``, a package-scoped ``mmdet::`` base)."""
    tree = _tree(path)
    if tree is None or uses_read_base(path):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_base_" for t in node.targets):
            try:
                bases = _literal_bases(node.value, path)
            except ValueError:
                return None
            if any("::" in b for b in bases):
                return None
            here = os.path.dirname(os.path.abspath(path))
            return [b if os.path.isabs(b) else os.path.normpath(os.path.join(here, b)) for b in bases]
    return []
