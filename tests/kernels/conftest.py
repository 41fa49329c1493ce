"""Shared fixtures for kernel tests.

``poison_empty`` (autouse) makes uninitialised memory visible: every tensor that
code in ``kernels/`` obtains from ``torch.empty`` / ``torch.empty_like`` /
``Tensor.new_empty`` is filled with NaN (floats), -1 (integers) or True (bool)
before it is handed back. A kernel that forgets to write part of its output then
fails the comparison against its reference instead of passing by luck (FLA's
``tests/conftest.py`` does the same). Calls from anywhere else (tests, torch
internals, the Triton interpreter) are left alone.

Interpreter mode: on a machine without CUDA this conftest sets
``TRITON_INTERPRET=1`` at import, before anything here imports triton, so the
``*_triton`` launchers run their kernels in Triton's CPU interpreter. Triton
reads the flag when ``triton.language`` is imported and when each kernel is
decorated, so it only takes effect if no earlier-collected test module imported
triton first; ``require_interpreter`` fails loudly (never skips) when that
happened. Safest: run kernel tests as ``TRITON_INTERPRET=1 pytest tests/kernels``
or set the flag in the root ``tests/conftest.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

_KERNELS_DIR = os.path.realpath(importlib.util.find_spec("dspine.kernels").submodule_search_locations[0]) + os.sep


def _poison_(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return t
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-1)
    return t


def _from_kernels(depth: int = 2) -> bool:
    """True when the caller of the wrapped allocator lives in ``kernels/``."""
    filename = sys._getframe(depth).f_code.co_filename
    return os.path.realpath(filename).startswith(_KERNELS_DIR)


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return _poison_(out) if _from_kernels() else out

    def empty_like(*args, **kwargs):
        out = real_empty_like(*args, **kwargs)
        return _poison_(out) if _from_kernels() else out

    def new_empty(self, *args, **kwargs):
        out = real_new_empty(self, *args, **kwargs)
        return _poison_(out) if _from_kernels() else out

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    yield


def require_interpreter(module) -> None:
    """Fail (not skip) when the Triton kernels of ``module`` cannot run here.

    On CUDA the compiled kernels run on CUDA tensors; on CPU every ``@triton.jit``
    function of the module must be an interpreter function.
    """
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        pytest.fail("triton is not installed: pip install 'dspine-serve[kernels]'")
    if torch.cuda.is_available():
        return
    from triton.runtime.jit import JITFunction

    compiled = [n for n, v in vars(module).items() if isinstance(v, JITFunction) and not isinstance(v, InterpretedFunction)]
    if compiled:
        pytest.fail(f"{module.__name__}: kernels {compiled} were decorated before TRITON_INTERPRET=1 was set; "
                    "run `TRITON_INTERPRET=1 pytest tests/kernels`")


def kernel_device() -> str:
    """Where kernel tests put their tensors: CUDA when present, else CPU (interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
    """Relative RMS error check (FLA style): rms(ref - out) / rms(ref) <= ratio.

    NaN anywhere in ``out`` (an unwritten, poisoned element) fails immediately.
    """
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != ref {tuple(ref.shape)}"
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert not torch.isnan(out64).any(), f"{name}: output contains NaN (unwritten or poisoned memory)"
    err = (out64 - ref64).pow(2).mean().sqrt().item()
    base = ref64.pow(2).mean().sqrt().item()
    rel = err / max(base, 1e-12)
    assert rel <= ratio, f"{name}: relative RMS error {rel:.3e} > {ratio:.1e} (abs {err:.3e})"


@pytest.fixture(name="assert_close")
def assert_close_fixture():
    """The ``assert_close`` helper as a fixture (``--import-mode=importlib`` cannot import conftest)."""
    return assert_close


@pytest.fixture(name="kernel_device")
def kernel_device_fixture() -> str:
    """"cuda" when present (compiled kernels), else "cpu" (Triton interpreter)."""
    return kernel_device()


@pytest.fixture(name="kernel_module")
def kernel_module_fixture():
    """``kernel_module("bridge")`` -> the module ``dspine.kernels.bridge`` with its interpreter checked.

    (``import dspine.kernels.bridge as m`` would give the *function* ``bridge``: the
    package re-exports each op under its module's name.)
    """

    def get(op: str):
        module = importlib.import_module(f"dspine.kernels.{op}")
        require_interpreter(module)
        return module

    return get
