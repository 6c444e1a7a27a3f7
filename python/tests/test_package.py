"""CI tests of the installed package without a GPU and without torch: the pure-Python parts of
``cuda_caching_allocator.torch`` and the native library's C ABI on its error and no-device paths.

Run with the package installed (``python/tests/ci.sh`` installs the freshly built wheel into a
virtual environment): ``python test_package.py``. Prints one line per test and closes with
``N passed, N failed``; exits non-zero on any failure.
"""

import ctypes
import os
import sys
import tempfile
import traceback

import cuda_caching_allocator.torch as cca

RESULTS = []
CONF = "CUDA_CACHING_ALLOCATOR_CONF"


def test(fn):
    try:
        fn()
        RESULTS.append(True)
        print(f"PASS {fn.__name__}")
    except Exception:
        RESULTS.append(False)
        print(f"FAIL {fn.__name__}\n{traceback.format_exc()}")
    return fn


def expect_error(fn, *words):
    try:
        fn()
    except cca.EnableError as e:
        for w in words:
            assert w in str(e), f"{w!r} not in {str(e)!r}"
        return
    raise AssertionError("no EnableError")


def lib():
    l = cca._load_library(cca._find_library(None))
    l.cca_device_stats.restype = ctypes.c_int
    l.cca_last_error_kind.restype = ctypes.c_int
    l.cca_pool_use_count.restype = ctypes.c_int
    l.cca_cache_info.restype = ctypes.c_uint64
    l.cca_alloc.restype = ctypes.c_void_p
    l.cca_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    l.cca_memory_fraction.restype = ctypes.c_double
    return l


class Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("current", "peak", "allocated", "freed")]


class DeviceStats(ctypes.Structure):
    _fields_ = ([(n, Stat * 3) for n in (
        "allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
        "active_bytes", "inactive_split_bytes", "requested_bytes")]
        + [("oversize_allocations", Stat), ("oversize_segments", Stat)]
        + [(n, ctypes.c_int64) for n in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                          "num_device_alloc", "num_device_free", "max_split_size")])


class Pool(ctypes.Structure):
    _fields_ = [("first", ctypes.c_uint64), ("second", ctypes.c_uint64)]


@test
def route_resolution():
    assert cca._resolve_route("auto", None) == "shim"
    assert cca._resolve_route("auto", "no C++ compiler") == "pluggable"
    assert cca._resolve_route("pluggable", "no C++ compiler") == "pluggable"
    assert cca._resolve_route("shim", None) == "shim"
    expect_error(lambda: cca._resolve_route("shim", "no C++ compiler ('c++' not found)"),
                 "cannot be built", "no C++ compiler")
    expect_error(lambda: cca._resolve_route("fast", None), "'fast'")


@test
def shim_build_dir_per_torch_and_source():
    a = cca._shim_build_dir("2.11.0+cu130", b"one", "/cache")
    b = cca._shim_build_dir("2.11.0+cu130", b"two", "/cache")
    c = cca._shim_build_dir("2.12.0", b"one", "/cache")
    assert len({a, b, c}) == 3, (a, b, c)
    assert a.startswith("/cache/shim-torch2.11.0_cu130-"), a
    assert "+" not in os.path.basename(a)
    os.environ["CCA_SHIM_BUILD_DIR"] = "/elsewhere"
    try:
        assert cca._shim_build_dir("2.11.0", b"one").startswith("/elsewhere/")
    finally:
        del os.environ["CCA_SHIM_BUILD_DIR"]


@test
def shim_source_is_packaged():
    src = cca.shim_source()
    assert os.path.isfile(src), src
    with open(src) as f:
        text = f.read()
    assert "class Shim : public CCA::CUDAAllocator" in text
    assert "kAbiVersion = 7" in text


@test
def config_conflict_refused():
    os.environ.pop(CONF, None)
    try:
        assert cca._apply_config("expandable_segments:True") == "expandable_segments:True"
        assert os.environ[CONF] == "expandable_segments:True"
        assert cca._apply_config(None) == "expandable_segments:True"
        expect_error(lambda: cca._apply_config("max_split_size_mb:64"), "choose one", CONF)
    finally:
        os.environ.pop(CONF, None)


@test
def library_found_in_package_and_override_checked():
    path = cca._find_library(None)
    assert os.path.basename(path).startswith("_cca") and path.endswith(".so"), path
    missing = os.path.join(tempfile.gettempdir(), "no-such-libcca.so")
    expect_error(lambda: cca._find_library(missing), missing)


@test
def abi_version_and_layouts():
    l = lib()
    assert l.cca_abi_version() == 7
    assert ctypes.sizeof(DeviceStats) == 976


@test
def bad_config_reported_with_reason():
    l = lib()
    os.environ[CONF] = "max_split_size_mb:banana"
    try:
        assert l.cca_check_config() == -1
        assert l.cca_last_error_kind() == 2
        msg = l.cca_last_error().decode()
        assert "max_split_size_mb" in msg, msg
        expect_error(lambda: cca._check_config(l), "bad allocator configuration", "max_split_size_mb")
    finally:
        del os.environ[CONF]
    assert l.cca_check_config() == 0
    assert l.cca_last_error_kind() == 0 and l.cca_last_error() == b""


@test
def bad_config_leaves_the_environment_as_it_was():
    # enable(config="...banana") must not leave the bad string behind: a corrected call (and
    # child processes) would inherit it. The message names the key once and where it came from.
    path = cca._find_library(None)
    os.environ.pop(CONF, None)
    try:
        expect_error(lambda: cca._configure("max_split_size_mb:banana", path),
                     "max_split_size_mb", "enable(config=...)")
        try:
            cca._configure("max_split_size_mb:banana", path)
        except cca.EnableError as e:
            assert str(e).count("bad configuration") == 0, str(e)
        assert CONF not in os.environ, os.environ.get(CONF)
        cfg, _ = cca._configure("max_split_size_mb:256", path)
        assert cfg == "max_split_size_mb:256" and os.environ[CONF] == cfg
        os.environ[CONF] = "cca_preset:default"
        expect_error(lambda: cca._configure("max_split_size_mb:banana", path), "choose one")
        assert os.environ[CONF] == "cca_preset:default"
        os.environ[CONF] = "max_split_size_mb:banana"
        expect_error(lambda: cca._configure(None, path), CONF)
        assert os.environ[CONF] == "max_split_size_mb:banana"
    finally:
        os.environ.pop(CONF, None)


@test
def failed_enable_leaves_the_environment_as_it_was():
    # A good configuration but a failure after it (here a bad route) must not leave the
    # configuration behind either. A stand-in for torch: enable() imports it first.
    import types
    saved_torch = sys.modules.get("torch")
    sys.modules["torch"] = types.ModuleType("torch")
    os.environ.pop(CONF, None)
    try:
        expect_error(lambda: cca.enable(config="max_split_size_mb:256", route="Shim"),
                     "'Shim'")
        assert CONF not in os.environ, os.environ.get(CONF)
        os.environ[CONF] = "max_split_size_mb:256"
        expect_error(lambda: cca.enable(route="Shim"), "'Shim'")
        assert os.environ[CONF] == "max_split_size_mb:256"
        assert not cca.enabled()
    finally:
        os.environ.pop(CONF, None)
        if saved_torch is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = saved_torch


@test
def checking_the_config_keeps_the_quiet_setting():
    # _check_config silences the library for its check only: a shim that made it quiet for good
    # (its errors go into Python exceptions) must not find it printing again.
    l = lib()
    assert l.cca_set_quiet(1) == 0
    try:
        cca._check_config(l)
        assert l.cca_set_quiet(1) == 1, "the check turned quiet off"
    finally:
        l.cca_set_quiet(0)
    cca._check_config(l)
    assert l.cca_set_quiet(0) == 0, "the check left the library quiet"


@test
def second_enable_asking_for_something_else_refused():
    saved = dict(cca._state)
    try:
        cca._state.update(allocator=object(), path="/x/_cca.so", config="cca_preset:pytorch",
                          route="shim")
        cca._check_same_as_first(None, None, "auto")
        cca._check_same_as_first(None, "cca_preset:pytorch", "shim")
        expect_error(lambda: cca._check_same_as_first(None, "cca_preset:default", "auto"),
                     "'cca_preset:pytorch'", "'cca_preset:default'")
        expect_error(lambda: cca._check_same_as_first(None, None, "pluggable"), "'shim'")
        expect_error(lambda: cca._check_same_as_first("/y/_cca.so", None, "auto"), "/x/_cca.so")
    finally:
        cca._state.clear()
        cca._state.update(saved)


@test
def route_error_names_its_source():
    expect_error(lambda: cca._resolve_route("Shim", None, "CCA_TORCH_ROUTE"),
                 "CCA_TORCH_ROUTE", "'Shim'")


@test
def unused_device_reads_as_empty():
    l = lib()
    s = DeviceStats()
    s.num_ooms = 77
    assert l.cca_device_stats(0, ctypes.byref(s)) == 1
    assert s.num_ooms == 0 and s.allocated_bytes[0].current == 0
    assert l.cca_device_stats(-1, ctypes.byref(s)) == -1
    assert l.cca_device_stats(0, None) == -1
    assert l.cca_memory_stat(0, b"allocated_bytes.all.current") == -1
    assert l.cca_pool_use_count(0, Pool(0, 1)) == 0
    assert l.cca_cache_info(0) == 0
    assert l.cca_memory_fraction(0) == 1.0


@test
def bad_alloc_arguments_are_errors_not_crashes():
    l = lib()
    l.cca_set_quiet(1)
    try:
        assert l.cca_alloc(-5, 0, None) is None
        assert l.cca_last_error_kind() == 2
        assert b"bad size -5" in l.cca_last_error(), l.cca_last_error()
        assert l.cca_alloc(16, -1, None) is None
        assert b"device -1" in l.cca_last_error()
        assert l.cca_enable_peer_access(0, -1) == -1
        assert l.cca_last_error_kind() == 2
        assert b"peer -1" in l.cca_last_error(), l.cca_last_error()
        # A good call clears the error.
        assert l.cca_check_config() == 0 and l.cca_last_error_kind() == 0
    finally:
        l.cca_set_quiet(0)


@test
def oom_sizes_only_after_an_out_of_memory_failure():
    # cca_last_oom_sizes answers -1 and writes nothing after any other failure or a success
    # (its out-of-memory answer needs a GPU: gpu/probes/torch_review.py oom_sizes).
    l = lib()
    rounded, segment = ctypes.c_size_t(7), ctypes.c_size_t(7)
    l.cca_set_quiet(1)
    try:
        assert l.cca_alloc(-5, 0, None) is None and l.cca_last_error_kind() == 2
        assert l.cca_last_oom_sizes(ctypes.byref(rounded), ctypes.byref(segment)) == -1
        assert l.cca_check_config() == 0
        assert l.cca_last_oom_sizes(ctypes.byref(rounded), ctypes.byref(segment)) == -1
        assert l.cca_last_oom_sizes(None, None) == -1
        assert (rounded.value, segment.value) == (7, 7)
    finally:
        l.cca_set_quiet(0)


@test
def runtime_settings_name_the_keys_not_applied():
    # What the shim's hook on torch.cuda.memory._set_allocator_settings warns with: the keys of
    # the new string that the running configuration (the default here) does not have.
    l = lib()
    l.cca_settings_not_applied.restype = ctypes.c_long
    l.cca_settings_not_applied.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    assert l.cca_config_expandable() == 1
    buf = ctypes.create_string_buffer(512)
    n = l.cca_settings_not_applied(b"expandable_segments:False", buf, len(buf))
    assert buf.value == b"expandable_segments (True -> False)", buf.value
    assert n == len(buf.value)
    n = l.cca_settings_not_applied(b"expandable_segments:True,max_split_size_mb:64", buf, len(buf))
    assert buf.value == b"max_split_size_mb (PyTorch's default -> 64)", buf.value
    # The same settings again, or keys only PyTorch's pinned allocator reads: nothing.
    assert l.cca_settings_not_applied(b"expandable_segments:True", buf, len(buf)) == 0
    assert buf.value == b""
    assert l.cca_settings_not_applied(b"pinned_num_register_threads:4", buf, len(buf)) == 0
    # A short buffer: truncated, NUL-terminated, the full length returned.
    short = ctypes.create_string_buffer(8)
    full = l.cca_settings_not_applied(b"expandable_segments:False", None, 0)
    assert full == len(b"expandable_segments (True -> False)"), full
    assert l.cca_settings_not_applied(b"expandable_segments:False", short, 8) == full
    assert short.value == b"expanda"
    l.cca_set_quiet(1)
    try:
        assert l.cca_settings_not_applied(b"max_split_size_mb:banana", buf, len(buf)) == -1
        assert b"max_split_size_mb" in l.cca_last_error(), l.cca_last_error()
        assert l.cca_settings_not_applied(None, buf, len(buf)) == -1
    finally:
        l.cca_set_quiet(0)


@test
def runtime_settings_wrapper_warns():
    # The wrapper of torch._C._accelerator_setAllocatorSettings, over a stand-in for torch:
    # PyTorch's function still runs; on the pluggable route the library names the keys, on the
    # shim route the shim's hook hands its text over.
    import types
    import warnings

    def fake_torch():
        calls = []
        t = types.SimpleNamespace(_C=types.SimpleNamespace(
            _accelerator_setAllocatorSettings=lambda env: calls.append(env)))
        return t, calls

    l = lib()
    assert cca._settings_not_applied(l, "expandable_segments:True") == ""
    t, calls = fake_torch()
    cca._wrap_settings(t, l, None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t._C._accelerator_setAllocatorSettings("expandable_segments:False")
        t._C._accelerator_setAllocatorSettings("expandable_segments:True")
        t._C._accelerator_setAllocatorSettings("max_split_size_mb:banana")
    assert calls == ["expandable_segments:False", "expandable_segments:True",
                     "max_split_size_mb:banana"], calls
    msgs = [str(m.message) for m in w]
    assert len(msgs) == 2, msgs
    assert "Not applied: expandable_segments (True -> False)" in msgs[0], msgs
    assert "cannot read them" in msgs[1] and "max_split_size_mb" in msgs[1], msgs

    class FakeShim:
        def __init__(self):
            self.on, self.pending, self.log, self.synced = False, "", [], 0

        def sync_pytorch_expandable(self):
            self.synced += 1

        def settings_warnings_to_python(self, on):
            self.log.append(on)
            out, self.pending, self.on = self.pending, "", on
            return out

    shim = FakeShim()
    t, calls = fake_torch()
    inner = t._C._accelerator_setAllocatorSettings

    def hooked(env):  # what the shim's C++ hook does while the wrapper asked for the text
        inner(env)
        assert shim.on
        shim.pending = "from the hook" if "False" in env else ""

    t._C._accelerator_setAllocatorSettings = hooked
    cca._wrap_settings(t, l, shim)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t._C._accelerator_setAllocatorSettings("expandable_segments:False")
        t._C._accelerator_setAllocatorSettings("expandable_segments:True")
    assert [str(m.message) for m in w] == ["from the hook"], [str(m.message) for m in w]
    assert shim.log == [True, False, True, False] and not shim.on and shim.synced == 2
    l.cca_set_quiet(1)
    try:
        expect_error(lambda: cca._settings_not_applied(l, "max_split_size_mb:banana"),
                     "max_split_size_mb")
    finally:
        l.cca_set_quiet(0)


@test
def enable_without_torch_names_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        try:
            cca.enable()
        except ImportError as e:
            assert "torch" in str(e)
            return
        raise AssertionError("enable() without torch did not raise ImportError")


@test
def stat_before_enable_refused():
    expect_error(lambda: cca.stat("allocated_bytes.all.current"), "enable() was not called")
    assert cca.route() is None and not cca.enabled()


def run_python(code, env=None):
    """Runs ``code`` in a fresh interpreter (a process of its own: the native library's
    configuration, once read, stays for the process); returns (exit status, stdout, stderr)."""
    import subprocess
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})), timeout=120)
    return p.returncode, p.stdout, p.stderr


@test
def an_error_with_stderr_closed_returns_instead_of_aborting():
    # With stderr a pipe nobody reads (a dead log collector, `| head`), the error line's write
    # fails; eprintln! panicked there, the panic guard's own report panicked again outside its
    # catch, and the process aborted at the C boundary (status 134) instead of cca_alloc
    # returning NULL with the error recorded.
    code = """
import ctypes, os
import cuda_caching_allocator.torch as cca
l = cca._load_library(cca._find_library(None))
l.cca_last_error_kind.restype = ctypes.c_int
l.cca_alloc.restype = ctypes.c_void_p
l.cca_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
r, w = os.pipe()
os.close(r)
saved = os.dup(2)
os.dup2(w, 2)
p = l.cca_alloc(-5, 0, None)
os.dup2(saved, 2)
print(p, l.cca_last_error_kind(), l.cca_last_error().decode())
"""
    rc, out, err = run_python(code)
    assert rc == 0, (rc, out, err[-2000:])
    assert out.split(None, 2)[:2] == ["None", "2"] and "bad size -5" in out, out


@test
def the_configuration_is_fixed_when_the_caches_read_it():
    # The package fixes the caches' configuration at enable() on both routes (the pluggable
    # one read it only at the first allocation, so a later change of the environment won);
    # once fixed, a check against an environment that says otherwise refuses, naming both.
    code = f"""
import os
import cuda_caching_allocator.torch as cca
l = cca._load_library(cca._find_library(None))
l.cca_set_quiet(1)
os.environ[{CONF!r}] = "cca_preset:default"
assert l.cca_check_config() == 0, "nothing fixed yet: any good configuration passes"
os.environ[{CONF!r}] = "cca_preset:pytorch"
assert l.cca_check_config() == 0
assert l.cca_config_expandable() == 0, "the caches read cca_preset:pytorch (no expandable)"
os.environ[{CONF!r}] = "cca_preset:default"
assert l.cca_check_config() == -1
msg = l.cca_last_error().decode()
assert "the caches run PyTorch's defaults" in msg and "says expandable_segments:True" in msg, msg
assert l.cca_config_expandable() == 0, "the caches keep what they read"
os.environ[{CONF!r}] = "max_split_size_mb:banana"
assert l.cca_check_config() == -1 and "banana" in l.cca_last_error().decode()
os.environ[{CONF!r}] = "cca_preset:pytorch"
assert l.cca_check_config() == 0
print("ok")
"""
    rc, out, err = run_python(code)
    assert rc == 0 and out.strip() == "ok", (rc, out, err[-2000:])


@test
def a_library_of_another_abi_is_refused_at_load():
    # library= (or CCA_TORCH_LIBRARY) naming a stale build: refused when loaded, naming both
    # versions, instead of a missing symbol inside PyTorch's settings hook later.
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    assert cc, "no C compiler (CI has one: check_shim_compiles.sh needs it)"
    with tempfile.TemporaryDirectory() as d:
        for name, body in (("old", "int cca_abi_version(void) { return 3; }"),
                           ("other", "int not_ours(void) { return 0; }")):
            src = os.path.join(d, name + ".c")
            with open(src, "w") as f:
                f.write(body + "\n")
            subprocess.run([cc, "-shared", "-fPIC", "-o", os.path.join(d, name + ".so"), src],
                           check=True)
        expect_error(lambda: cca._load_library(os.path.join(d, "old.so")),
                     "C ABI version 3", f"needs {cca._ABI_VERSION}")
        expect_error(lambda: cca._load_library(os.path.join(d, "other.so")),
                     "not cuda_caching_allocator's native library")
    assert cca._ABI_VERSION == lib().cca_abi_version()


@test
def an_unused_device_reads_the_configured_split_limit_and_fraction():
    # torch.cuda.memory_stats(d)["max_split_size"] and get_per_process_memory_fraction(d) of a
    # device whose cache was not made yet: PyTorch makes every device's cache at init, so they
    # carry the configuration; the library read 0 (a split limit of 0 bytes) and 1.0 there, and
    # the configured values once the device had allocated.
    code = """
import ctypes
import cuda_caching_allocator.torch as cca
l = cca._load_library(cca._find_library(None))
l.cca_device_stats.restype = ctypes.c_int
l.cca_memory_fraction.restype = ctypes.c_double
buf = (ctypes.c_int64 * (976 // 8))()
rc = l.cca_device_stats(0, buf)
print(rc, buf[-1], l.cca_memory_fraction(0), buf[0])
"""
    for conf, want in (("cca_preset:pytorch", "1 -1 1.0 0"),
                       ("cca_preset:pytorch,max_split_size_mb:64,per_process_memory_fraction:0.5",
                        f"1 {64 << 20} 0.5 0")):
        rc, out, err = run_python(code, {CONF: conf})
        assert rc == 0, (rc, out, err[-2000:])
        assert out.strip() == want, (conf, out, want)


@test
def null_pointers_are_refused_not_dereferenced():
    # A null callback or output pointer to the C ABI is a clear error, checked before anything
    # else (a device's cache is not made for it), not a call through null or a write to it.
    l = lib()
    out = ctypes.c_uint64(0)
    l.cca_import_pages.restype = ctypes.c_void_p
    l.cca_set_quiet(1)
    try:
        assert l.cca_snapshot(0, None, None, None) == -1
        assert b"null callback" in l.cca_last_error(), l.cca_last_error()
        assert l.cca_restore_pool(0, Pool(0, 1), None, 3, None, None) == -1
        assert b"null callback" in l.cca_last_error(), l.cca_last_error()
        cb = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int)(
            lambda *a: None)
        assert l.cca_restore_pool(0, Pool(0, 1), None, 3, cb, None) == -1
        assert b"null blocks" in l.cca_last_error(), l.cca_last_error()
        dropped = []
        drop = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda ctx: dropped.append(ctx))
        assert l.cca_begin_allocate_to_pool_with(0, Pool(0, 1), None, ctypes.c_void_p(7),
                                                 drop) == -1
        assert b"null accept" in l.cca_last_error() and dropped == [7], (l.cca_last_error(),
                                                                        dropped)
        assert l.cca_export_pages(0, ctypes.c_uint64(4096), None, 4, None, None, None) == -1
        assert b"null output" in l.cca_last_error(), l.cca_last_error()
        assert l.cca_import_pages(0, 1, ctypes.c_uint64(2 << 20), None, 2,
                                  ctypes.byref(out)) is None
        assert b"null pointer" in l.cca_last_error(), l.cca_last_error()
        assert l.cca_import_pages(0, 1, ctypes.c_uint64(2 << 20), None, 0, None) is None
        assert b"null pointer" in l.cca_last_error(), l.cca_last_error()
    finally:
        l.cca_set_quiet(0)


@test
def routing_bindings_announce_their_filter():
    # The pluggable route's wrappers of PyTorch's routing bindings (stand-ins for torch here): the
    # library is told the filter's kind before PyTorch is called and forgets it after, also when
    # PyTorch raises; torch.cuda.memory's imported names are wrapped with torch._C's; a name
    # already wrapped is left alone.
    import types

    l = lib()
    l.cca_next_routing.restype = ctypes.c_int
    l.cca_next_routing.argtypes = [ctypes.c_int, ctypes.c_void_p]
    for kind in (1, 2, 3, 0):
        assert l.cca_next_routing(kind, None) == 0, kind
    l.cca_set_quiet(1)
    try:
        assert l.cca_next_routing(9, None) == -1
        assert b"unknown kind 9" in l.cca_last_error(), l.cca_last_error()
    finally:
        l.cca_set_quiet(0)

    log = []

    def binding(name, fails=False):
        def f(device, pool):
            log.append((name, device, pool))
            if fails:
                raise RuntimeError("refused")
        return f

    thread_binding = binding("thread")
    c = types.SimpleNamespace(_cuda_beginAllocateCurrentThreadToPool=thread_binding,
                              _cuda_beginAllocateToPool=binding("all", fails=True))
    memory = types.SimpleNamespace(_cuda_beginAllocateCurrentThreadToPool=thread_binding)
    stream = types.SimpleNamespace(cuda_stream=0x1234)
    t = types.SimpleNamespace(_C=c, cuda=types.SimpleNamespace(
        memory=memory, current_stream=lambda d: stream))

    class Announce:
        restype = argtypes = None

        def __call__(self, kind, s):
            log.append(("announce", kind, s))
            return 0

    fake_lib = types.SimpleNamespace(cca_next_routing=Announce())
    cca._wrap_routing(t, fake_lib)
    assert memory._cuda_beginAllocateCurrentThreadToPool is c._cuda_beginAllocateCurrentThreadToPool
    assert not hasattr(c, "_cuda_beginAllocateCurrentStreamToPool")
    memory._cuda_beginAllocateCurrentThreadToPool(0, (0, 1))
    try:
        c._cuda_beginAllocateToPool(1, (0, 2))
        raise AssertionError("PyTorch's refusal was swallowed")
    except RuntimeError as e:
        assert str(e) == "refused", e
    assert log == [("announce", 1, None), ("thread", 0, (0, 1)), ("announce", 0, None),
                   ("announce", 2, None), ("all", 1, (0, 2)), ("announce", 0, None)], log
    c._cuda_beginAllocateCurrentStreamToPool = binding("stream")
    wrapped = c._cuda_beginAllocateCurrentThreadToPool
    cca._wrap_routing(t, fake_lib)
    assert c._cuda_beginAllocateCurrentThreadToPool is wrapped
    del log[:]
    c._cuda_beginAllocateCurrentStreamToPool(0, (0, 3))
    assert log == [("announce", 3, 0x1234), ("stream", 0, (0, 3)), ("announce", 0, None)], log


@test
def an_install_refused_as_in_use_says_so_each_time():
    # PyTorch refuses to swap an initialized allocator (changeCurrentAllocator); the message says
    # so, first and on a retry, with PyTorch's line and not the C++ location after it.
    e = RuntimeError("Can't swap an already initialized allocator\n"
                     "Exception raised from changeCurrentAllocator at x.cpp:1")
    msg = cca._in_use_message(e)
    assert "already initialized" in msg and "enable() before" in msg, msg
    assert "Can't swap an already initialized allocator)" in msg and "x.cpp" not in msg, msg
    # The pluggable route through enable(), twice, over a stand-in torch whose swap refuses.
    code = """
import sys, types
import cuda_caching_allocator.torch as cca
class Hooks:
    def __getattr__(self, name):
        return lambda *a: None
class Plug:
    def __init__(self, *a):
        pass
    def allocator(self):
        return Hooks()
def refuse(alloc):
    raise RuntimeError("Can't swap an already initialized allocator\\nException raised from x")
torch = types.ModuleType("torch")
torch.__version__ = "2.11.0"
torch._C = types.SimpleNamespace()
torch.cuda = types.SimpleNamespace(memory=types.SimpleNamespace(
    CUDAPluggableAllocator=Plug, change_current_allocator=refuse))
sys.modules["torch"] = torch
for attempt in (1, 2):
    try:
        cca.enable(route="pluggable")
    except cca.EnableError as e:
        print(attempt, "already initialized" in str(e) and "Can't swap" in str(e), cca.enabled())
"""
    rc, out, err = run_python(code)
    assert rc == 0 and out.split() == ["1", "True", "False", "2", "True", "False"], (rc, out, err)


failed = RESULTS.count(False)
print(f"{len(RESULTS) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
