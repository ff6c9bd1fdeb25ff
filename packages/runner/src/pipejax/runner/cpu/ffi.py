"""What the CPU kernels (``decode_kernel``, ``prefill_kernel``, ``dense_kernel``) share: reading XLA's typed FFI call
frame from numba code (``xla/ffi/api/c_api.h`` in jaxlib's headers, by the fields' offsets) and its buffers as
arrays, answering XLA's metadata query (``serve``: the body of every handler), and compiling a kernel's handlers,
whose parallel loops run on TBB. Imported only where a kernel is built.
"""

from __future__ import annotations

import ctypes

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# Byte offsets / 8 of the int64 fields read from XLA's FFI structs (64-bit layout of c_api.h).
_FRAME_EXTENSION, _FRAME_STAGE, _FRAME_ARGS, _FRAME_RETS = 1, 4, 9, 14  # XLA_FFI_CallFrame
_BUFFER_DATA, _BUFFER_RANK, _BUFFER_DIMS = 3, 4, 5  # XLA_FFI_Buffer
_EXTENSION_TYPE, _EXTENSION_METADATA = 1, 3  # XLA_FFI_Metadata_Extension: type, then XLA_FFI_Metadata*
_METADATA_MAJOR, _METADATA_MINOR, _METADATA_TRAITS = 6, 7, 8  # int32 fields of XLA_FFI_Metadata
_FFI_API = (0, 3)  # XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR of jaxlib 0.10.2's headers
_STAGE_EXECUTE, _EXTENSION_IS_METADATA = 3, 1


@intrinsic
def ptr(typingctx, addr):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.int64), codegen


@intrinsic
def address(typingctx, p):
    """A pointer's address as an int64 (``ptr``'s inverse)."""

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return types.int64(types.voidptr), codegen


@numba.njit(inline="always")
def int64s(addr, n):
    return numba.carray(ptr(addr), (n,), np.int64)


@numba.njit(inline="always")
def float32s(addr, n):
    """The ``n`` float32s at ``addr``: a view of no more than a pointer (a slice or a row of a numba array costs its
    index checks in a kernel's innermost loops)."""
    return numba.carray(ptr(addr), (n,), np.float32)


@numba.njit(inline="always")
def frame_of(frame_addr):
    return int64s(frame_addr, 15)


@numba.njit(inline="always")
def arguments(frame, n):
    """The call's ``n`` argument buffers' addresses, and its one result buffer's."""
    return int64s(frame[_FRAME_ARGS], n), int64s(frame[_FRAME_RETS], 1)


@numba.njit(inline="always")
def buffer(args, i):
    buf = int64s(args[i], 6)
    return ptr(buf[_BUFFER_DATA]), int64s(buf[_BUFFER_DIMS], buf[_BUFFER_RANK])


@numba.njit(inline="always")
def scalar_i32(args, i):
    data, _ = buffer(args, i)
    return numba.carray(data, (1,), np.int32)[0]


@numba.njit(inline="always")
def scalar_f32(args, i):
    data, _ = buffer(args, i)
    return numba.carray(data, (1,), np.float32)[0]


@numba.njit(inline="always")
def vector_i32(args, i):
    data, dims = buffer(args, i)
    return numba.carray(data, (dims[0],), np.int32)


@numba.njit(inline="always")
def array3_f32(args, i):
    data, dims = buffer(args, i)
    return numba.carray(data, (dims[0], dims[1], dims[2]), np.float32)


@numba.njit(inline="always")
def array4_f32(args, i):
    data, dims = buffer(args, i)
    return numba.carray(data, (dims[0], dims[1], dims[2], dims[3]), np.float32)


@numba.njit(inline="always")
def paged_attention_operands(args):
    """The operands both attention kernels begin with: q [T, H, D]; the K and V caches [L, N, block_size, K, D],
    flattened, and their shape; the layer; the block tables [R, B]."""
    k_data, dims = buffer(args, 1)
    v_data, _ = buffer(args, 2)
    cache_shape = (dims[0], dims[1], dims[2], dims[3], dims[4])
    size = dims[0] * dims[1] * dims[2] * dims[3] * dims[4]
    tables, t_dims = buffer(args, 4)
    return (array3_f32(args, 0), numba.carray(k_data, (size,), np.float32), numba.carray(v_data, (size,), np.float32),
            cache_shape, scalar_i32(args, 3), numba.carray(tables, (t_dims[0], t_dims[1]), np.int32))


@numba.njit(inline="always")
def answered(frame) -> bool:
    """Whether this call is not an execution (XLA asking for metadata, or another stage): answered here."""
    if frame[_FRAME_EXTENSION] != 0:  # XLA asking for the handler's metadata, not running it
        ext = int64s(frame[_FRAME_EXTENSION], 4)
        if (ext[_EXTENSION_TYPE] & 0xFFFFFFFF) == _EXTENSION_IS_METADATA:
            meta = numba.carray(ptr(ext[_EXTENSION_METADATA]), (10,), np.int32)
            meta[_METADATA_MAJOR], meta[_METADATA_MINOR], meta[_METADATA_TRAITS] = _FFI_API[0], _FFI_API[1], 0
            return True
    return (frame[_FRAME_STAGE] & 0xFFFFFFFF) != _STAGE_EXECUTE


def use_tbb() -> None:
    """Make numba's parallel loops run on TBB from the ``tbb`` wheel: the one threading layer of numba that is
    safe when several threads launch parallel loops at once (in-process pipeline stages do), and that needs no
    system library. The wheel puts libtbb in the environment's lib folder, off the loader's path, so it is
    loaded here by its full path before numba's TBB pool asks for it by name."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("tbb")
    except PackageNotFoundError as e:
        raise RuntimeError("the tbb package is not installed") from e
    libs = [f for f in dist.files or () if f.name == "libtbb.so.12"]
    if not libs:
        raise RuntimeError(f"the tbb package {dist.version} has no libtbb.so.12")
    ctypes.CDLL(str(dist.locate_file(libs[0])), mode=ctypes.RTLD_GLOBAL)
    numba.config.THREADING_LAYER = "tbb"
    # Start the pool now: a handler loaded from numba's cache does not, and would crash on its first call.
    numba.get_num_threads()
    if numba.threading_layer() != "tbb":
        raise RuntimeError(f"numba's threading layer is {numba.threading_layer()!r}, not 'tbb'")


@numba.njit(inline="always")
def serve(frame_addr, operands, kernel):
    """The body of every kernel's handler: answers XLA's metadata query, or runs ``kernel(*operands(frame))`` on
    the call's buffers; returns null (success)."""
    frame = frame_of(frame_addr)
    if not answered(frame):
        kernel(*operands(frame))
    return ptr(0)


def compile_cfunc(handler, parallel: bool):
    """``handler`` (``XLA_FFI_Error* (XLA_FFI_CallFrame*)``, a module-level function: numba caches the cfunc of
    nothing else, so each kernel keeps its own pair of handlers) compiled as a C function, cached on disk by
    numba. ``parallel``: the handler runs numba's parallel loops, on TBB (raises where TBB cannot be loaded). Keep
    the returned object alive as long as XLA may call it."""
    if parallel:
        use_tbb()
    return numba.cfunc(types.voidptr(types.int64), cache=True)(handler)


def handler_compiler(handler, handler_parallel):
    """A kernel module's ``compile_handler(parallel=False)``: its handler (``parallel``: the one over numba's
    threads, on TBB) compiled by ``compile_cfunc``."""

    def compile_handler(parallel: bool = False):
        return compile_cfunc(handler_parallel if parallel else handler, parallel)

    return compile_handler
