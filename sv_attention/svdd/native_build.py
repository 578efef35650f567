"""Build and load a small C kernel (source held in a Python module) through the system C compiler and ctypes.

The source is compiled once per machine into ``$SV_ATTENTION_CACHE`` (default
``~/.cache/sv_attention/native``; the system temp folder when that is not writable), in a folder named by the hash of the source, the flags, the compiler
and the CPU model (``-march=native`` code is never loaded on another CPU), and loaded with
:mod:`ctypes` (whose foreign calls release the GIL). No torch headers and no build tool are needed:
one ``cc`` call, well under a second.

Nothing is silent: a kernel that cannot be built (no compiler, a failed compilation, a library that
does not load) is reported once per process with ``RuntimeWarning`` and the reason, and
:func:`load_kernel` returns ``None`` so the caller runs its torch path (and counts it). Setting
``SV_ATTENTION_NATIVE=0`` turns the kernels off without a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

#: compiler flags (the kernels are plain C99 with pthreads; -ffast-math is never used: NaN checks matter)
CFLAGS = ("-O3", "-march=native", "-std=c99", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-fassociative-math")
#: C99 fragments shared by the kernels (one copy of each rule): a vectorisable float ``exp`` of non-positive
#: arguments (needs ``<math.h>``, ``<stdint.h>``), and ``sv_openmp()`` telling :func:`uses_openmp` how it was built
C_EXP_NEG_F = r"""
/* exp(x) for x <= 0 in float (Cephes' expf polynomial after reduction by ln 2, vectorisable, relative error
   ~1e-7 like float32's own rounding); x below -87 gives ~1e-38 */
static inline float exp_neg_f(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}
"""
C_OPENMP_PROBE = r"""
int sv_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
"""
#: added when the compiler takes them: a kernel's parallel region then runs on the OpenMP thread pool torch
#: itself uses (the same ``libgomp`` loaded once in the process), whose workers are usually still spinning from
#: torch's last parallel operation -- threads of the kernel's own would compete with them for the cores (measured:
#: the chained fits of a 2048-token prefill 1.3-1.8x slower). Without OpenMP the kernels start POSIX threads.
OPENMP_FLAGS = ("-fopenmp",)
#: environment switch: ``0`` / ``false`` / ``off`` disables the native kernels
ENV_SWITCH = "SV_ATTENTION_NATIVE"

_LOADED: dict[str, ctypes.CDLL | None] = {}
_REASONS: dict[str, str] = {}


def native_enabled() -> bool:
    """Whether :data:`ENV_SWITCH` allows native kernels (default: yes)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    """Where compiled kernels live: ``$SV_ATTENTION_CACHE`` or ``~/.cache/sv_attention/native``."""
    root = os.environ.get("SV_ATTENTION_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "sv_attention" / "native"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compiler() -> str | None:
    """The C compiler the kernels are built with (``$CC``, ``cc``, ``gcc`` or ``clang``), or None."""
    return _compiler()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def unavailable_reason(name: str) -> str | None:
    """Why kernel ``name`` did not load in this process (None if it loaded or was never asked for)."""
    return _REASONS.get(name)


def load_kernel(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled library of C ``source`` (cached per process and on disk), or ``None`` with a warning.

    Parameters
    ----------
    name : str  the kernel's name (file and warning names)
    source : str  C99 source

    Returns
    -------
    ctypes.CDLL or None  (None when :func:`native_enabled` is False, silently, or when the build failed,
        with one ``RuntimeWarning`` per process naming the reason)
    """
    if not native_enabled():
        return None
    if name in _LOADED:
        return _LOADED[name]
    lib: ctypes.CDLL | None = None
    try:
        lib = _build(name, source)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _REASONS[name] = str(exc)
        warnings.warn(f"sv_attention: the native kernel {name!r} could not be built ({exc}); its torch path is "
                      f"used instead (same results, slower). Set {ENV_SWITCH}=0 to silence this.",
                      RuntimeWarning, stacklevel=3)
    _LOADED[name] = lib
    return lib


def _build(name: str, source: str) -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (tried $CC, cc, gcc, clang)")
    digest = hashlib.sha256("\0".join((source, " ".join(CFLAGS), cc, _cpu_model(), platform.machine()))
                            .encode()).hexdigest()[:16]
    folder = cache_dir() / f"{name}-{digest}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: the system temp folder, one per user
        user = getattr(os, "getuid", lambda: 0)()
        folder = Path(tempfile.gettempdir()) / f"sv_attention-native-{user}" / f"{name}-{digest}"
        folder.mkdir(parents=True, exist_ok=True)
    lib_path = folder / f"{name}.so"
    if not lib_path.exists():
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            # with OpenMP where the compiler has it, else (the source's #ifdef) with POSIX threads
            for extra in (OPENMP_FLAGS, ()):
                proc = subprocess.run([cc, *CFLAGS, *extra, str(src), "-o", str(out), "-lm"], capture_output=True,
                                      text=True, timeout=120)
                if proc.returncode == 0:
                    break
            if proc.returncode != 0:
                raise RuntimeError(f"{Path(cc).name} failed: {proc.stderr.strip()[-400:]}")
            os.replace(out, lib_path)  # atomic: a concurrent process sees the whole library or none
    return ctypes.CDLL(str(lib_path))


def uses_openmp(lib: ctypes.CDLL) -> bool:
    """Whether a loaded kernel was built with OpenMP (it exports ``sv_openmp`` returning 1), not POSIX threads."""
    try:
        return bool(lib.sv_openmp())
    except AttributeError:
        return False
