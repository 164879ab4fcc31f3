# llama.cpp/ggml log routed to structlog, and process-wide backend lifetime.
# Included by _llama.pyx (one extension module); split by area to keep files small.

cdef int _log_min_level = GGML_LOG_LEVEL_WARN
cdef int _last_level = GGML_LOG_LEVEL_INFO
cdef bint _log_alive = True
_log_parts = []
_errors = deque(maxlen=8)
_LEVEL_NAMES = {GGML_LOG_LEVEL_DEBUG: "debug", GGML_LOG_LEVEL_INFO: "info",
                GGML_LOG_LEVEL_WARN: "warning", GGML_LOG_LEVEL_ERROR: "error"}
# warnings about what Power asks for on purpose are information, not something a user should act on:
# a full-size SWA cache is what lets a verify pass roll back on sliding-window models (Context swa_full)
_CHOSEN = ("using full-size SWA cache",)


cdef void _log_emit(int level, const char * text) noexcept with gil:
    try:
        _log_parts.append(text.decode("utf-8", "replace"))
        if not _log_parts[-1].endswith("\n"):
            return
        line = "".join(_log_parts).rstrip()
        _log_parts.clear()
        if not line:
            return
        if level >= GGML_LOG_LEVEL_ERROR:
            _errors.append(line)
        if level == GGML_LOG_LEVEL_WARN and any(c in line for c in _CHOSEN):
            level = GGML_LOG_LEVEL_INFO
        if level >= _log_min_level:
            getattr(_log, _LEVEL_NAMES.get(level, "info"))("llama.log", text=line)
    except BaseException:
        pass


cdef void _log_cb(ggml_log_level level, const char * text, void * ud) noexcept nogil:
    global _last_level
    cdef int lvl = <int>level
    if lvl == GGML_LOG_LEVEL_CONT:
        lvl = _last_level
    else:
        _last_level = lvl
    if not _log_alive or (lvl < _log_min_level and lvl < GGML_LOG_LEVEL_ERROR):
        return
    _log_emit(lvl, text)


def set_log_level(level: str) -> None:
    """Forward llama.cpp messages at or above ``level`` (debug, info, warning, error) to structlog."""
    global _log_min_level
    table = {"debug": GGML_LOG_LEVEL_DEBUG, "info": GGML_LOG_LEVEL_INFO, "warning": GGML_LOG_LEVEL_WARN,
             "error": GGML_LOG_LEVEL_ERROR}
    if level not in table:
        raise ConfigError("log_level", level, "one of debug, info, warning, error")
    _log_min_level = table[level]


def last_errors() -> list:
    """The last llama.cpp error lines (they explain a NULL model or context)."""
    return list(_errors)


def system_info() -> str:
    return (<bytes>llama_print_system_info()).decode("utf-8", "replace")


# -- backends: loaded from this package's folder, their own functions through the registry -----------
# Portable wheels build ggml-cpu as modules loaded at run time (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS:
# libggml-cpu-<variant>.so from the x64 baseline up to AVX-512, native/tools/build_llama.py); the best one
# this CPU runs is loaded here, before any model. A build that links its backends has no such files.
_LIB_DIR = os.path.dirname(os.path.abspath(__file__))

ctypedef void (*_set_flag_t)(cpp_bool on) noexcept nogil
ctypedef cpp_bool (*_get_flag_t)() noexcept nogil


cdef ggml_backend_reg_t _cpu_reg() except NULL:
    cdef ggml_backend_reg_t reg = ggml_backend_reg_by_name(b"CPU")
    if reg == NULL:
        variants = sorted(f for f in os.listdir(_LIB_DIR) if f.startswith("libggml-cpu"))
        raise RuntimeFault(f"llama.cpp has no CPU backend: none of {variants} in {_LIB_DIR} loads on this "
                           "machine (a wheel's libggml-cpu-x64.so runs on every x86-64 CPU: reinstall power-native)")
    return reg


cdef void * _backend_proc(ggml_backend_reg_t reg, str name) except NULL:
    """``name`` from a backend's ``get_proc_address``: the one way Power reaches a backend's own functions
    (ggml-cpu's and ggml-rpc's), which nothing links where they are modules loaded at run time."""
    cdef void * fn = ggml_backend_reg_get_proc_address(reg, name.encode())
    if fn == NULL:
        backend = (<bytes>ggml_backend_reg_name(reg)).decode("utf-8", "replace")
        raise RuntimeFault(f"llama.cpp's {backend} backend has no {name}: the llama.cpp libraries this "
                           "power-native loaded are not its build (the pinned source with native/patches); "
                           "reinstall power-native")
    return fn


def cpu_backend() -> str:
    """The file the CPU backend runs from: ``libggml-cpu-<variant>.so`` where ggml picked the best CPU
    variant at run time (portable wheels), ``libggml-cpu.so.0`` in a build that links one."""
    cdef Dl_info info
    if not dladdr(_backend_proc(_cpu_reg(), "ggml_cpu_get_batch_invariant"), &info) or info.dli_fname == NULL:
        raise RuntimeFault("dladdr cannot name the file of llama.cpp's CPU backend")
    return os.path.basename((<bytes>info.dli_fname).decode("utf-8", "replace"))


def set_batch_invariant(bint on) -> None:
    """Switch ggml-cpu's batch-invariant kernels (Power's patch 0002) on or off for the process: a
    verify row then has the same bits as a one-token decode (no n == 1 special cases)."""
    (<_set_flag_t>_backend_proc(_cpu_reg(), "ggml_cpu_set_batch_invariant"))(on)


def batch_invariant() -> bool:
    return (<_get_flag_t>_backend_proc(_cpu_reg(), "ggml_cpu_get_batch_invariant"))()


def _shutdown() -> None:
    global _log_alive
    _log_alive = False  # the callback stays installed (silent): NULL would print to stderr


llama_log_set(_log_cb, NULL)
llama_backend_init()
ggml_backend_load_all_from_path(_LIB_DIR.encode())
atexit.register(_shutdown)
set_log_level(os.environ.get("POWER_NATIVE_LOG_LEVEL", "warning"))


# -- the one return-code helper ---------------------------------------------------------------------
