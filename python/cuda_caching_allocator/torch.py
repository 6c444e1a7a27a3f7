"""Install cuda-caching-allocator as PyTorch's CUDA allocator, with every hook PyTorch offers.

    import cuda_caching_allocator.torch as cca
    cca.enable()                      # before the first CUDA allocation of the process
    ...
    cca.stat("reserved_bytes.all.peak")

`enable` loads the allocator library (the package's native module ``cuda_caching_allocator._cca``,
built from ``python/src`` by maturin), checks its
configuration, creates PyTorch's ``CUDAPluggableAllocator`` over ``cca_alloc`` / ``cca_free`` and
registers the hooks PyTorch's wrapper takes from Python (``torch/csrc/cuda/Module.cpp``):

* ``set_record_stream_fn`` -> ``cca_record_stream``: ``Tensor.record_stream`` (NCCL process
  groups, FSDP, DDP's reducer and data prefetchers call it) delays the reuse of a block until the
  named stream's work is done;
* ``set_reset_fn`` -> ``cca_reset``: ``torch.cuda.empty_cache()``;
* ``set_memory_fraction_fn`` -> ``cca_memory_fraction_hook``:
  ``torch.cuda.set_per_process_memory_fraction``;
* ``set_init_fn`` -> ``cca_init``;
* ``set_begin_allocate_to_pool`` / ``set_end_allocate_to_pool_fn`` / ``set_release_pool`` ->
  ``cca_begin_allocate_to_pool`` / ``cca_end_allocate_to_pool`` / ``cca_release_pool`` (CUDA graph
  private pools: ``torch.cuda.graph``, ``make_graphed_callables``), when the library exports them.

What PyTorch's pluggable wrapper itself refuses (``torch.cuda.memory_stats()``, snapshots, OOM
observers, ``cacheInfo``) is not reachable this way; :func:`stat` and :func:`summary` read the
allocator's own statistics (PyTorch's keys) instead.
"""

import ctypes
import importlib.util
import os

_LIBRARY_ENV = "CCA_TORCH_LIBRARY"
_CONFIG_ENV = "CUDA_CACHING_ALLOCATOR_CONF"
_NATIVE_MODULE = "cuda_caching_allocator._cca"

_state = {"lib": None, "allocator": None, "path": None, "graph_hooks": False}


class EnableError(RuntimeError):
    """The allocator could not be installed; the message says why and what to do."""


def _find_library(library):
    if library:
        candidates = [library]
    elif os.environ.get(_LIBRARY_ENV):
        candidates = [os.environ[_LIBRARY_ENV]]
    else:
        spec = importlib.util.find_spec(_NATIVE_MODULE)
        candidates = [spec.origin] if spec is not None and spec.origin else []
    for path in candidates:
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise EnableError(
        "cuda-caching-allocator's native library was not found (looked for: "
        + (", ".join(candidates) or _NATIVE_MODULE)
        + "). Install the package (`pip install ./python` with Rust, or the wheel from "
        + f"`maturin build --release -m python/Cargo.toml`), or pass library=... or set {_LIBRARY_ENV}."
    )


def _address(lib, name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def enable(config=None, library=None, graphs=True):
    """Install the allocator for every CUDA device of this process.

    Call it before anything allocates CUDA memory (PyTorch cannot swap an allocator in use).

    Args:
        config: an allocator configuration string (PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` syntax plus
            the crate's ``cca_*`` keys), read as PyTorch reads it (on top of PyTorch's defaults;
            ``cca_preset:default,...`` builds on the crate's default); ``None`` keeps
            ``CUDA_CACHING_ALLOCATOR_CONF`` or PyTorch's variables, and the crate's default when
            none is set.
        library: path of the allocator library; default: ``CCA_TORCH_LIBRARY`` or the library
            installed beside this module.
        graphs: register the CUDA-graph private-pool hooks when the library has them.

    Returns:
        PyTorch's ``CUDAPluggableAllocator`` object.

    Raises:
        EnableError: the library is missing, the configuration is bad, or CUDA memory was already
            allocated with another allocator.
    """
    import torch

    if _state["allocator"] is not None:
        if library and os.path.abspath(library) != _state["path"]:
            raise EnableError("enable() was already called with another library: " + _state["path"])
        return _state["allocator"]
    path = _find_library(library)
    if config is not None:
        current = os.environ.get(_CONFIG_ENV)
        if current is not None and current != config:
            raise EnableError(
                f"{_CONFIG_ENV} is set to {current!r} and enable() was given {config!r}: "
                "choose one"
            )
        os.environ[_CONFIG_ENV] = config
    lib = ctypes.CDLL(path)
    lib.cca_check_config.restype = ctypes.c_int
    if lib.cca_check_config() != 0:
        raise EnableError(
            "bad allocator configuration (the reason is printed on stderr); check "
            f"{_CONFIG_ENV} / PYTORCH_CUDA_ALLOC_CONF"
        )
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "cca_alloc", "cca_free")
    hooks = alloc.allocator()
    hooks.set_record_stream_fn(_address(lib, "cca_record_stream"))
    hooks.set_reset_fn(_address(lib, "cca_reset"))
    hooks.set_memory_fraction_fn(_address(lib, "cca_memory_fraction_hook"))
    hooks.set_init_fn(_address(lib, "cca_init"))
    graph_hooks = False
    if graphs and hasattr(lib, "cca_begin_allocate_to_pool"):
        hooks.set_begin_allocate_to_pool(_address(lib, "cca_begin_allocate_to_pool"))
        hooks.set_end_allocate_to_pool_fn(_address(lib, "cca_end_allocate_to_pool"))
        hooks.set_release_pool(_address(lib, "cca_release_pool"))
        graph_hooks = True
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise EnableError(
            "PyTorch's CUDA allocator is already in use: call enable() before the first CUDA "
            f"allocation of the process ({e})"
        ) from e
    lib.cca_memory_stat.restype = ctypes.c_int64
    lib.cca_memory_stat.argtypes = [ctypes.c_int, ctypes.c_char_p]
    _state.update(lib=lib, allocator=alloc, path=path, graph_hooks=graph_hooks)
    return alloc


def enabled():
    """Whether :func:`enable` installed the allocator in this process."""
    return _state["allocator"] is not None


def graph_hooks():
    """Whether the CUDA-graph private-pool hooks are registered."""
    return _state["graph_hooks"]


def library():
    """The loaded allocator library (a ``ctypes.CDLL``), or ``None`` before :func:`enable`."""
    return _state["lib"]


def stat(key, device=0):
    """One statistic of ``device``'s cache by its ``torch.cuda.memory_stats()`` key, or ``None``
    when the key is unknown or the device's cache was never used."""
    lib = _state["lib"]
    if lib is None:
        raise EnableError("enable() was not called")
    value = lib.cca_memory_stat(device, key.encode())
    return None if value < 0 else value


def summary(device=0):
    """Prints PyTorch's ``memory_summary()`` table of ``device``'s cache on stderr."""
    lib = _state["lib"]
    if lib is None:
        raise EnableError("enable() was not called")
    lib.cca_print_summary(device)
