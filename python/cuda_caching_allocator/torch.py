"""Install cuda-caching-allocator as PyTorch's CUDA allocator.

    import cuda_caching_allocator.torch as cca
    cca.enable()                  # before the first CUDA allocation; the crate's default
    ...
    torch.cuda.memory_stats()     # our figures, through PyTorch's own API

A configuration string is read on top of PyTorch's defaults, as PYTORCH_CUDA_ALLOC_CONF is:
``cca.enable(config="max_split_size_mb:256")`` is PyTorch's policy with that key, and
``cca.enable(config="cca_preset:default,max_split_size_mb:256")`` the crate's default with it.

Two routes (docs/pytorch.md):

* ``"shim"`` (the default when a C++ compiler, the CUDA toolkit and ninja are present): a C++
  ``c10::cuda::CUDACachingAllocator::CUDAAllocator`` over the native library
  (``csrc/cca_shim.cpp``), compiled against the installed torch by
  ``torch.utils.cpp_extension.load`` at the first :func:`enable` (cached in
  ``~/.cache/cuda_caching_allocator``, or ``CCA_SHIM_BUILD_DIR``) and installed with
  ``changeCurrentAllocator`` (as ``torch._C._cuda_changeCurrentAllocator``). PyTorch's own APIs then work: ``memory_stats`` and
  every ``memory_*`` function, ``memory_summary``, ``reset_peak_memory_stats``, ``empty_cache``,
  ``set_per_process_memory_fraction``, ``record_stream``, ``_record_memory_history`` /
  ``_snapshot`` / ``_dump_snapshot``, OOM observers, ``cacheInfo``, CUDA graph private pools and
  ``torch.cuda.MemPool``.
* ``"pluggable"`` (the fallback): PyTorch's ``CUDAPluggableAllocator`` over ``cca_alloc`` /
  ``cca_free`` with every hook it takes from Python (``record_stream``, ``empty_cache``,
  memory fraction, init, the CUDA graph pool hooks). PyTorch refuses ``memory_stats()``,
  snapshots, OOM observers and ``cacheInfo`` on it: :func:`stat` and :func:`summary` read the
  allocator's own statistics instead.
"""

import ctypes
import hashlib
import importlib.util
import os
import shutil
import warnings

_LIBRARY_ENV = "CCA_TORCH_LIBRARY"
_CONFIG_ENV = "CUDA_CACHING_ALLOCATOR_CONF"
_NATIVE_MODULE = "cuda_caching_allocator._cca"

_SHIM_DIR_ENV = "CCA_SHIM_BUILD_DIR"
# The native library's C ABI this package speaks (the shim checks its own copy, kAbiVersion).
_ABI_VERSION = 7
_ROUTE_ENV = "CCA_TORCH_ROUTE"

_state = {"lib": None, "allocator": None, "path": None, "graph_hooks": False, "route": None,
          "shim": None, "config": None, "asked_route": None}


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


def _apply_config(config):
    """Puts ``config`` in ``CUDA_CACHING_ALLOCATOR_CONF`` (refusing a conflicting value)."""
    if config is None:
        return os.environ.get(_CONFIG_ENV, "")
    current = os.environ.get(_CONFIG_ENV)
    if current is not None and current != config:
        raise EnableError(
            f"{_CONFIG_ENV} is set to {current!r} and enable() was given {config!r}: choose one"
        )
    os.environ[_CONFIG_ENV] = config
    return config


def _load_library(path):
    """Loads the native library at ``path``; raises EnableError unless it speaks this package's
    C ABI (a stale ``CCA_TORCH_LIBRARY`` or ``library=`` otherwise failed later, inside PyTorch's
    settings hook, on a missing symbol)."""
    lib = ctypes.CDLL(path)
    try:
        lib.cca_abi_version.restype = ctypes.c_int
        version = lib.cca_abi_version()
    except AttributeError:
        raise EnableError(f"{path} is not cuda_caching_allocator's native library "
                          "(no cca_abi_version)") from None
    if version != _ABI_VERSION:
        raise EnableError(
            f"the native library {path} has C ABI version {version}; this package needs "
            f"{_ABI_VERSION}: use the library of the same build as the package"
        )
    lib.cca_check_config.restype = ctypes.c_int
    lib.cca_last_error.restype = ctypes.c_char_p
    lib.cca_memory_stat.restype = ctypes.c_int64
    lib.cca_memory_stat.argtypes = [ctypes.c_int, ctypes.c_char_p]
    lib.cca_set_quiet.restype = ctypes.c_int
    lib.cca_set_quiet.argtypes = [ctypes.c_int]
    return lib


def _check_config(lib, given=False):
    """Raises EnableError naming what is wrong with the configuration the library would read;
    ``given``: it came from ``enable(config=...)`` rather than the environment."""
    # The message goes into the exception, not to stderr as well; the previous setting comes
    # back after (the shim, once installed, keeps the library quiet).
    was_quiet = lib.cca_set_quiet(1)
    try:
        bad = lib.cca_check_config() != 0
        reason = (lib.cca_last_error() or b"").decode(errors="replace") if bad else ""
    finally:
        lib.cca_set_quiet(was_quiet)
    if bad:
        prefix = "bad configuration: "
        if reason.startswith(prefix):
            reason = reason[len(prefix):]
        where = "enable(config=...)" if given else f"check {_CONFIG_ENV} / PYTORCH_CUDA_ALLOC_CONF"
        raise EnableError(f"bad allocator configuration: {reason} ({where})")


def _configure(config, path):
    """Puts ``config`` in the environment, loads the library at ``path`` and checks the
    configuration with it; returns (configuration string, library). A bad configuration leaves
    the environment as it was, so that a corrected call (and child processes) do not inherit
    it."""
    previous = os.environ.get(_CONFIG_ENV)
    cfg = _apply_config(config)
    try:
        lib = _load_library(path)
        _check_config(lib, given=config is not None)
    except BaseException:
        _restore_config_env(previous)
        raise
    return cfg, lib


def _restore_config_env(previous):
    """Puts back the value ``CUDA_CACHING_ALLOCATOR_CONF`` had (``None``: unset)."""
    if previous is None:
        os.environ.pop(_CONFIG_ENV, None)
    else:
        os.environ[_CONFIG_ENV] = previous


def shim_source():
    """Path of the C++ shim's source file shipped in the package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "cca_shim.cpp")


def _shim_build_dir(torch_version, source, root=None):
    """The shim's cached build folder: one per torch version and shim source."""
    root = root or os.environ.get(_SHIM_DIR_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "cuda_caching_allocator"
    )
    digest = hashlib.sha256(source).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in torch_version)
    return os.path.join(root, f"shim-torch{safe}-{digest}")


def _missing_toolchain():
    """Why the shim cannot be compiled here (``None`` when it can)."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found; set CXX)"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit (CUDA_HOME not set and nvcc not found)"
    if shutil.which("ninja") is None:
        try:
            cpp_extension.verify_ninja_availability()
        except RuntimeError:
            return "no ninja (torch.utils.cpp_extension builds with it: pip install ninja)"
    return None


def _resolve_route(route, missing, source="enable(route=...)"):
    """The route to take: ``route`` as asked, ``"auto"`` picking the shim unless ``missing``
    says why it cannot be built; ``source`` names where ``route`` came from."""
    if route not in ("auto", "shim", "pluggable"):
        raise EnableError(f"{source} must be 'auto', 'shim' or 'pluggable', not {route!r}")
    if route == "shim" and missing:
        raise EnableError(f"the C++ shim cannot be built: {missing}")
    if route == "auto":
        return "pluggable" if missing else "shim"
    return route


def build_shim(build_dir=None, verbose=False):
    """Compiles (or loads from its cache) the C++ shim against the installed torch and returns
    the extension module."""
    import torch
    from torch.utils import cpp_extension

    src = shim_source()
    with open(src, "rb") as f:
        source = f.read()
    build_dir = build_dir or _shim_build_dir(torch.__version__, source)
    os.makedirs(build_dir, exist_ok=True)
    return cpp_extension.load(
        name="cca_shim",
        sources=[src],
        build_directory=build_dir,
        with_cuda=True,
        extra_cflags=["-O2"],
        extra_ldflags=["-ldl"],
        verbose=verbose,
    )


def _install_pluggable(torch, lib, path, graphs):
    # Note [Configuration fixed at enable] (python/src/hooks.rs): the caches read the
    # configuration now, as the shim's constructor makes them do, not at the first allocation.
    if lib.cca_config_expandable() < 0:
        reason = (lib.cca_last_error() or b"").decode(errors="replace")
        raise EnableError(f"bad allocator configuration: {reason}")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "cca_alloc", "cca_free")
    hooks = alloc.allocator()
    hooks.set_record_stream_fn(_address(lib, "cca_record_stream"))
    hooks.set_reset_fn(_address(lib, "cca_reset"))
    hooks.set_memory_fraction_fn(_address(lib, "cca_memory_fraction_hook"))
    hooks.set_init_fn(_address(lib, "cca_init"))
    graph_hooks = False
    if graphs and not hasattr(hooks, "set_begin_allocate_to_pool"):
        raise EnableError(
            f"torch {torch.__version__}'s CUDAPluggableAllocator has no CUDA-graph pool hooks "
            "(set_begin_allocate_to_pool): pass graphs=False, or use a newer torch or the shim "
            "route"
        )
    if graphs:
        hooks.set_begin_allocate_to_pool(_address(lib, "cca_begin_allocate_to_pool"))
        hooks.set_end_allocate_to_pool_fn(_address(lib, "cca_end_allocate_to_pool"))
        hooks.set_release_pool(_address(lib, "cca_release_pool"))
        graph_hooks = True
    torch.cuda.memory.change_current_allocator(alloc)
    if graph_hooks:
        _wrap_routing(torch, lib)
    return alloc, graph_hooks


# PyTorch's bindings that route allocations into a private pool without a capture, with the kind
# of filter each hands PyTorch's allocator (python/src/pools.rs, cca_next_routing).
_ROUTING_BINDINGS = (
    ("_cuda_beginAllocateCurrentThreadToPool", 1),  # use_mem_pool, CUDA graph trees' warm-up
    ("_cuda_beginAllocateToPool", 2),  # every allocation of the device
    ("_cuda_beginAllocateCurrentStreamToPool", 3),  # the device's current stream
)


def _wrap_routing(torch, lib):
    """On the pluggable route, wraps PyTorch's routing bindings (``torch._C`` and the names
    ``torch.cuda.memory`` imported from it) so that each tells the library, just before it calls
    PyTorch, which filter PyTorch is about to pass to the pool hook: the hook receives PyTorch's
    C++ ``std::function`` and cannot call it, and without this routed only captures (Note
    [Routings without a capture on the pluggable route], python/src/pools.rs). A module that
    imported a binding by name before ``enable()`` keeps PyTorch's own."""
    fn = lib.cca_next_routing
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
    memory = getattr(torch.cuda, "memory", None)
    for name, kind in _ROUTING_BINDINGS:
        original = getattr(torch._C, name, None)
        if original is None or getattr(original, "_cca_routing", False):
            continue
        wrapper = _routing_wrapper(torch, fn, original, kind)
        setattr(torch._C, name, wrapper)
        if memory is not None and getattr(memory, name, None) is original:
            setattr(memory, name, wrapper)


def _routing_wrapper(torch, announce, original, kind):
    def begin(device, mempool_id):
        stream = None
        if kind == 3:
            stream = torch.cuda.current_stream(device).cuda_stream
        announce(kind, stream)
        try:
            return original(device, mempool_id)
        finally:
            announce(0, None)

    begin._cca_routing = True
    begin.__name__ = getattr(original, "__name__", "begin")
    begin.__doc__ = getattr(original, "__doc__", None)
    return begin


def _settings_not_applied(lib, settings):
    """The keys of ``settings`` that would change the library's running configuration, as the
    shim's hook words them ("" for none); raises ``EnableError`` with the library's message."""
    fn = lib.cca_settings_not_applied
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    raw = settings.encode()
    n = fn(raw, None, 0)
    if n < 0:
        raise EnableError(lib.cca_last_error().decode(errors="replace"))
    buf = ctypes.create_string_buffer(n + 1)
    fn(raw, buf, len(buf))
    return buf.value.decode(errors="replace")


def _settings_message(lib, env):
    """The warning for ``env`` on the pluggable route ("" when it changes nothing)."""
    try:
        text = _settings_not_applied(lib, env)
    except EnableError as e:
        return (f"cuda_caching_allocator: allocator settings {env!r} were applied to PyTorch's own "
                f"settings only; this allocator cannot read them: {e}")
    if not text:
        return ""
    return (f"cuda_caching_allocator: allocator settings {env!r} were applied to PyTorch's own "
            "settings only; this allocator takes its configuration once, when enable() installs "
            f"it, and keeps it. Not applied: {text}. Pass these keys to "
            "cuda_caching_allocator.torch.enable(config=...) instead.")


def _wrap_settings(torch, lib, shim):
    """Wraps PyTorch's ``torch._C._accelerator_setAllocatorSettings`` (what
    ``torch.cuda.memory._set_allocator_settings`` calls) so that a change this allocator does not
    apply raises a ``UserWarning`` naming the keys. On the shim route the shim's hook in PyTorch's
    configuration parser words the warning (and keeps PyTorch's ``expandable_segments`` at what
    the allocator does) and hands it over here, since PyTorch's binding sends a C++ warning to
    stderr only; on the pluggable route the library is asked directly."""
    owner = torch._C if hasattr(torch._C, "_accelerator_setAllocatorSettings") else None
    if owner is not None:
        name = "_accelerator_setAllocatorSettings"
    else:  # an older torch: the Python function is all there is to wrap
        owner, name = torch.cuda.memory, "_set_allocator_settings"
    original = getattr(owner, name, None)
    if original is None:  # a torch without run-time settings: nothing to wrap
        return

    def set_allocator_settings(env):
        if shim is not None:
            shim.settings_warnings_to_python(True)
            try:
                result = original(env)
            finally:
                msg = shim.settings_warnings_to_python(False)
                # PyTorch's generic parser sets expandable_segments token by token before it
                # refuses a bad string, and then the hook does not run: set it back.
                shim.sync_pytorch_expandable()
        else:
            result = original(env)
            msg = _settings_message(lib, env)
        if msg:
            warnings.warn(msg, UserWarning, stacklevel=3)
        return result

    setattr(owner, name, set_allocator_settings)


def enable(config=None, library=None, graphs=True, route="auto", build_dir=None, verbose=False):
    """Install the allocator for every CUDA device of this process.

    Call it before anything allocates CUDA memory (PyTorch cannot swap an allocator in use).

    Args:
        config: an allocator configuration string (PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` syntax plus
            the crate's ``cca_*`` keys), read as PyTorch reads it (on top of PyTorch's defaults;
            ``cca_preset:default,...`` builds on the crate's default); ``None`` keeps
            ``CUDA_CACHING_ALLOCATOR_CONF`` or PyTorch's variables, and the crate's default when
            none is set.
        library: path of the native library; default: ``CCA_TORCH_LIBRARY`` or the package's own.
        graphs: on the pluggable route, register the CUDA-graph private-pool hooks (the shim
            always supports graphs).
        route: ``"auto"`` (the shim when a C++ compiler and the CUDA toolkit are present, else
            the pluggable route with a warning), ``"shim"`` or ``"pluggable"``; the environment
            variable ``CCA_TORCH_ROUTE`` overrides ``"auto"``.
        build_dir: the shim's build folder (default: a cache folder per torch version).
        verbose: print the shim's compilation.

    Returns:
        The allocator object PyTorch holds (``torch.cuda.memory._CUDAAllocator`` on the shim
        route, ``CUDAPluggableAllocator`` on the pluggable one).

    Raises:
        EnableError: the library is missing, the configuration is bad, the shim was asked for and
            cannot be built, or CUDA memory was already allocated with another allocator.
    """
    import torch

    if _state["allocator"] is not None:
        _check_same_as_first(library, config, route)
        return _state["allocator"]
    path = _find_library(library)
    previous = os.environ.get(_CONFIG_ENV)
    cfg, lib = _configure(config, path)
    try:
        alloc = _install(torch, lib, path, cfg, graphs, route, build_dir, verbose)
    except BaseException:
        # Nothing installed (or an install that failed): the environment as it was, so that a
        # corrected call and child processes do not inherit this call's configuration.
        _restore_config_env(previous)
        raise
    return alloc


def _install(torch, lib, path, cfg, graphs, route, build_dir, verbose):
    """enable() once the configuration is checked: picks the route, installs, records it."""
    asked_route = route
    source = "enable(route=...)"
    if route == "auto" and os.environ.get(_ROUTE_ENV):
        route, source = os.environ[_ROUTE_ENV], _ROUTE_ENV
    missing = _missing_toolchain() if route in ("auto", "shim") else None
    chosen = _resolve_route(route, missing, source)
    if route == "auto" and chosen == "pluggable":
        _warn_pluggable(missing)
    shim = None
    if chosen == "shim":
        try:
            shim = build_shim(build_dir, verbose)
        except Exception as e:  # a compiler error, a missing header: say which
            if route != "auto":
                raise EnableError(f"building the C++ shim failed: {e}") from e
            chosen = "pluggable"
            _warn_pluggable(f"building the C++ shim failed ({e})")
    try:
        if chosen == "shim":
            shim.install(path, cfg)
            _state["shim"] = shim
            alloc = torch.cuda.memory._get_current_allocator()
            graph_hooks = True
        else:
            alloc, graph_hooks = _install_pluggable(torch, lib, path, graphs)
        _wrap_settings(torch, lib, _state["shim"] if chosen == "shim" else None)
    except RuntimeError as e:
        if isinstance(e, EnableError):
            raise
        if "already initialized" in str(e):
            raise EnableError(_in_use_message(e)) from e
        raise EnableError(f"installing the allocator failed: {e}") from e
    _state.update(lib=lib, allocator=alloc, path=path, graph_hooks=graph_hooks, route=chosen,
                  config=cfg, asked_route=asked_route)
    return alloc


def _in_use_message(e):
    """The message of an install PyTorch refused because its CUDA allocator is initialized
    (``changeCurrentAllocator``: "Can't swap an already initialized allocator"), PyTorch's line
    quoted without the C++ location it appends."""
    first = (str(e).strip().splitlines() or [""])[0]
    return ("PyTorch's CUDA allocator is already initialized, so PyTorch refuses to replace it: "
            "call enable() before anything initialises CUDA in PyTorch (a CUDA tensor, "
            "torch.cuda.init(), torch.cuda.current_device(), ...); nothing was installed and "
            f"PyTorch's own allocator stays (PyTorch: {first})")


def _warn_pluggable(why):
    warnings.warn(
        f"cuda_caching_allocator: {why}; falling back to PyTorch's CUDAPluggableAllocator, on "
        "which torch.cuda.memory_stats(), snapshots, OOM observers and cacheInfo are refused "
        "(docs/pytorch.md)",
        RuntimeWarning,
        stacklevel=4,  # enable()'s caller: _warn_pluggable <- _install <- enable <- caller
    )


def _check_same_as_first(library, config, route):
    """A second enable() returns the running allocator, unless it asks for something else."""
    if library and os.path.abspath(library) != _state["path"]:
        raise EnableError("enable() was already called with another library: " + _state["path"])
    if config is not None and config != _state["config"]:
        raise EnableError(
            f"enable() was already called and the allocator runs with configuration "
            f"{_state['config']!r}; it cannot change to {config!r} in this process"
        )
    if route != "auto" and route != _state["route"]:
        raise EnableError(
            f"enable() was already called and took the {_state['route']!r} route; it cannot "
            f"change to {route!r} in this process"
        )


def route():
    """The route :func:`enable` took (``"shim"`` or ``"pluggable"``), or ``None`` before it."""
    return _state["route"]


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
    when the key is unknown or the device's cache was never used (``max_split_size`` is -1 for
    "no limit", as in PyTorch's statistics).

    Beyond PyTorch's keys, ``device_calls.KIND`` counts the driver calls the cache made and
    ``device_ns.KIND`` the host nanoseconds spent inside them, ``KIND`` one of ``map``,
    ``set_access``, ``unmap``, ``create``, ``release``, ``reserve``, ``release_range``,
    ``allocate``, ``free``, ``synchronize``, ``stream_synchronize``, ``event_create``,
    ``event_record``, ``event_query``, ``stream_wait_event``, or ``all``: where the allocator's
    own time goes when a step is slower than expected."""
    lib = _state["lib"]
    if lib is None:
        raise EnableError("enable() was not called")
    value = lib.cca_memory_stat(device, key.encode())
    if value == -1 and key == "max_split_size":
        # PyTorch's -1 for "no limit": a value, when the device's cache is in use.
        used = lib.cca_memory_stat(device, b"num_alloc_retries") >= 0
        return -1 if used else None
    return None if value < 0 else value


def host_time():
    """The allocator's host time, summed over every thread since :func:`enable`, when the
    environment had ``CCA_HOST_TIMING=1`` at :func:`enable` (shim route only): a dict with
    ``alloc_ns``, ``alloc_calls``, ``free_ns`` and ``free_calls`` (the shim's own work
    included; each call pays two clock reads for it). ``None`` when timing is off or on the
    pluggable route, where PyTorch calls the library directly."""
    if _state["lib"] is None:
        raise EnableError("enable() was not called")
    shim = _state.get("shim")
    if shim is None:
        return None
    on, alloc_ns, alloc_calls, free_ns, free_calls = shim.host_time()
    if not on:
        return None
    return {"alloc_ns": alloc_ns, "alloc_calls": alloc_calls, "free_ns": free_ns,
            "free_calls": free_calls}


def summary(device=0):
    """Prints PyTorch's ``memory_summary()`` table of ``device``'s cache on stderr."""
    lib = _state["lib"]
    if lib is None:
        raise EnableError("enable() was not called")
    lib.cca_print_summary(device)
