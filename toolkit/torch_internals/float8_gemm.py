"""A float8 GEMM that adds its product into an fp32 matrix in place, through cuBLASLt:
out += (a · a_scale) @ (b · b_scale).T.

Why hand-written: the float8 GEMM torch exposes (`torch._scaled_mm`, torch 2.11 on the GPU
machines) always writes a fresh output (cuBLASLt's beta is 0). A float8 weight gradient then
costs a second kernel that adds it into Megatron-Core's fp32 gradient buffer: 73 ms a step
on the Llama-3-8B shape (16 layers, one H200), which the bf16 linears no longer pay since
their GEMM adds into the buffer itself (`torch.addmm(..., out_dtype=float32)`). cuBLASLt,
the library `_scaled_mm` calls, takes an fp32 C operand with beta = 1 for float8 A and B
(Transformer Engine's float8 weight-gradient GEMM accumulates into `main_grad` this way).
This module binds the cuBLASLt calls that ask for it with ctypes, in the library torch
has already loaded. A scaled addmm proposed for torch after 2.11 would replace it.

On CPU (the tests, float8 emulated) the same sum runs as an fp32 GEMM of the dequantized
operands.
"""
from __future__ import annotations

import ctypes
import functools
import sys
import threading
import warnings

import torch

# cuBLASLt's constants (cublasLt.h, cublas_api.h, library_types.h)
_CUDA_R_32F = 0
_CUDA_FLOAT8 = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}  # bytes; cuBLASLt assumes 256 unless told
_WORKSPACE_BYTES = 32 << 20  # what cuBLASLt's guide recommends for Hopper


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (an opaque 64 bytes) and its needs."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def fits_in_place(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether cuBLASLt's float8 GEMM can add into `out` in place: row-major operands, every
    dimension a multiple of 16, every address 16-byte aligned (`out` may be a view into a
    larger buffer), not inside a CUDA-graph capture (the workspace would come from the
    graph's pool). Elsewhere `accumulate_float8_gemm` writes the product, then adds it."""
    return (all(t.dim() == 2 and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (a, b, out))
            and a.shape[1] % 16 == 0 and out.shape[1] % 16 == 0 and out.shape[0] % 16 == 0
            and not torch.cuda.is_current_stream_capturing())


def accumulate_float8_gemm(a, a_inverse_scale, b, b_inverse_scale, out, use_fast_accum: bool = False) -> None:
    """out += (a · a_inverse_scale) @ (b · b_inverse_scale).T, in one GEMM.

    a: [M, K] and b: [N, K], float8, row-major (the contraction dimension contiguous in
    both: the layout cuBLASLt's float8 GEMMs require); the inverse scales are one-element
    fp32 tensors on out's device (torchao's scale is the factor that made the float8 data,
    so these undo it: what `torch._scaled_mm` takes); out: [M, N], fp32, row-major."""
    _check_operands(a, a_inverse_scale, b, b_inverse_scale, out)
    if not out.is_cuda:
        out.addmm_(a.float() * a_inverse_scale, (b.float() * b_inverse_scale).t())
        return
    with torch.cuda.device(out.device):
        # the heuristic picks among algorithms that work at these addresses' alignment (a
        # weight's view into DDP's buffer may be aligned to less than cuBLASLt's default 256)
        alignments = tuple(_alignment(t) for t in (b, a, out))
        plan = (_plan(out.device.index, out.shape[0], out.shape[1], a.shape[1], a.dtype, b.dtype, use_fast_accum,
                      alignments) if fits_in_place(a, b, out) else None)
        if plan is None:  # e.g. a weight whose view into DDP's buffer starts unaligned
            _warn_once(f"float8 weight gradient of shape {tuple(out.shape)} written, then added: cuBLASLt cannot "
                       "add into this buffer in place (alignment, layout or CUDA-graph capture)")
            out.add_(torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=a_inverse_scale,
                                      scale_b=b_inverse_scale, out_dtype=out.dtype, use_fast_accum=use_fast_accum))
            return
        stream = torch.cuda.current_stream().cuda_stream
        workspace = _workspace(out.device.index, stream)
        one = ctypes.c_float(1.0)
        lib = _library()
        # cuBLASLt is column-major: out row-major [M, N] is column-major [N, M] = b · a.T, with
        # b as cuBLASLt's A (transposed) and a as its B; both float8 operands are "TN". The
        # descriptor is shared by every call of this shape: its scale pointers are set and
        # used under one lock.
        with _LOCK:
            _set(lib, plan.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(b_inverse_scale.data_ptr()))
            _set(lib, plan.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(a_inverse_scale.data_ptr()))
            _check(lib.cublasLtMatmul(_handle(out.device.index), plan.desc, ctypes.byref(one),
                                      ctypes.c_void_p(b.data_ptr()), plan.lt_a_layout, ctypes.c_void_p(a.data_ptr()),
                                      plan.lt_b_layout, ctypes.byref(one), ctypes.c_void_p(out.data_ptr()),
                                      plan.lt_c_layout, ctypes.c_void_p(out.data_ptr()), plan.lt_c_layout,
                                      ctypes.byref(plan.algo), ctypes.c_void_p(workspace.data_ptr()),
                                      ctypes.c_size_t(_WORKSPACE_BYTES), ctypes.c_void_p(stream)), "cublasLtMatmul")


def _check_operands(a, a_inverse_scale, b, b_inverse_scale, out) -> None:
    """What a wrong call would otherwise turn into reads out of bounds on the GPU."""
    if a.dtype not in _CUDA_FLOAT8 or b.dtype not in _CUDA_FLOAT8 or out.dtype != torch.float32:
        raise TypeError(f"expected float8 operands into an fp32 buffer, got {a.dtype}, {b.dtype} into {out.dtype}")
    if a.dim() != 2 or b.dim() != 2 or tuple(out.shape) != (a.shape[0], b.shape[0]) or a.shape[1] != b.shape[1]:
        raise ValueError(f"shapes {tuple(a.shape)} and {tuple(b.shape)} do not make {tuple(out.shape)}")
    for scale in (a_inverse_scale, b_inverse_scale):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != out.device:
            raise ValueError(f"a scale must be one fp32 value on {out.device}, got {scale.dtype} "
                             f"{tuple(scale.shape)} on {scale.device}")


class _Plan:
    """The descriptors of one GEMM shape and the algorithm cuBLASLt's heuristic chose for
    it. The layouts are named from cuBLASLt's side: its A is the caller's b."""

    def __init__(self, device, m, n, k, a_dtype, b_dtype, use_fast_accum, alignments):
        lib = _library()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        _set(lib, self.desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        _set(lib, self.desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        _set(lib, self.desc, _DESC_FAST_ACCUM, ctypes.c_int8(int(use_fast_accum)))
        # column-major: A is b [n rows of k] seen as k x n, B is a seen as k x m, C is n x m
        self.lt_a_layout = _layout(lib, _CUDA_FLOAT8[b_dtype], k, n, k)
        self.lt_b_layout = _layout(lib, _CUDA_FLOAT8[a_dtype], k, m, k)
        self.lt_c_layout = _layout(lib, _CUDA_R_32F, n, m, n)
        preference = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "MatmulPreferenceCreate")
        size = ctypes.c_uint64(_WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                         ctypes.sizeof(size)), "MatmulPreferenceSetAttribute")
        for operand, alignment in zip("abcd", alignments + alignments[-1:]):
            value = ctypes.c_uint32(alignment)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(preference, _PREF_MIN_ALIGNMENT[operand], ctypes.byref(value),
                                                             ctypes.sizeof(value)), "MatmulPreferenceSetAttribute")
        result, found = _HeuristicResult(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(_handle(device), self.desc, self.lt_a_layout, self.lt_b_layout,
                                                    self.lt_c_layout, self.lt_c_layout, preference, 1,
                                                    ctypes.byref(result), ctypes.byref(found))
        lib.cublasLtMatmulPreferenceDestroy(preference)
        self.found = status == 0 and found.value >= 1
        self.algo = (ctypes.c_uint64 * 8)(*result.algo)

    def __del__(self):
        """A plan the bounded cache dropped (or a shape with no algorithm) frees its
        descriptors; at the process's end the driver frees everything anyway."""
        if sys.is_finalizing():
            return
        lib = _library()
        for layout in (getattr(self, name, None) for name in ("lt_a_layout", "lt_b_layout", "lt_c_layout")):
            if layout is not None:  # absent where the constructor failed before making it
                lib.cublasLtMatrixLayoutDestroy(layout)
        lib.cublasLtMatmulDescDestroy(self.desc)


@functools.lru_cache(maxsize=512)  # bounded: the token count is part of the key (packed or dynamic shapes)
def _plan(device, m, n, k, a_dtype, b_dtype, use_fast_accum, alignments) -> _Plan | None:
    """The plan of a shape, or None where cuBLASLt has no float8 algorithm adding into fp32
    at these alignments (remembered, so the heuristic is asked once)."""
    plan = _Plan(device, m, n, k, a_dtype, b_dtype, use_fast_accum, alignments)
    return plan if plan.found else None


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 256 that divides the tensor's address."""
    address = t.data_ptr()
    return min(256, address & -address) if address else 256


_LOCK = threading.Lock()
_WARNED = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


def _layout(lib, dtype, rows, cols, leading):
    layout = ctypes.c_void_p()
    _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                          ctypes.c_int64(leading)), "MatrixLayoutCreate")
    return layout


def _set(lib, desc, attribute, value) -> None:
    _check(lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
           f"MatmulDescSetAttribute({attribute})")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@functools.cache
def _handle(device: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device: int, stream: int) -> torch.Tensor:
    """One workspace per device and stream, for the process's life: GEMMs on one stream
    run one after another, so they can share it; GEMMs on two streams cannot."""
    return torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")


@functools.cache
def _library() -> ctypes.CDLL:
    """The cuBLASLt torch loaded (the same release torch's own GEMMs run), found in this
    process's memory map once torch has made a cuBLAS handle."""
    torch.cuda.current_blas_handle()
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcublasLt.so" in line]
    lib = ctypes.CDLL(paths[0] if paths else "libcublasLt.so")
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [pointer],
        "cublasLtMatmulDescCreate": [pointer, ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [pointer, ctypes.c_int, pointer, size],
        "cublasLtMatmulDescDestroy": [pointer],
        "cublasLtMatrixLayoutDestroy": [pointer],
        "cublasLtMatrixLayoutCreate": [pointer, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatmulPreferenceCreate": [pointer],
        "cublasLtMatmulPreferenceSetAttribute": [pointer, ctypes.c_int, pointer, size],
        "cublasLtMatmulPreferenceDestroy": [pointer],
        "cublasLtMatmulAlgoGetHeuristic": [pointer] * 7 + [ctypes.c_int, pointer, pointer],
        "cublasLtMatmul": [pointer] * 14 + [size, pointer],
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib
