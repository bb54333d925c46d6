"""Reading a GGUF file: metadata, tensor directory, dequantized tensors.

The ``gguf`` package's ``GGUFReader`` builds a numpy view per array element while it parses, which
costs ~4 s on SmolLM2's 98k-entry tokenizer arrays; this reader parses the header with ``struct``
and memory-maps the tensor data instead (~0.1 s). The file layout (GGUF v2/v3, little-endian):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv × (key: str, type: u32, value)          str = u64 length + utf-8 bytes
    n_tensors × (name: str, n_dims: u32, dims: n_dims × u64, ggml_type: u32, offset: u64)
    padding to ``general.alignment`` (32) | tensor data (each tensor at data_start + offset)

Dims are fastest-first (ggml's ne[0] is the row length), so a torch shape is ``dims[::-1]``.
Dequantization uses torch for the common types (F32, F16, BF16, Q8_0, Q4_0, Q4_1) and the
``gguf`` package's numpy code for every other type it knows.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from residency.dataplane.model.errors import ModelFileError, UnsupportedModel

try:
    import gguf as _gguf
except ImportError:  # pragma: no cover - gguf is a declared dependency
    _gguf = None

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALAR = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
              6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # torch order (slowest first)
    ggml_type: int
    offset: int                 # absolute byte offset in the file
    num_bytes: int


class GGUFFile:
    """A parsed GGUF: ``metadata`` (key -> python value), ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelFileError(f"cannot map GGUF file {path}: {e}") from e
        buf = memoryview(self._mm)
        if bytes(buf[:4]) != b"GGUF":
            raise ModelFileError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if self.version not in (2, 3):
            raise UnsupportedModel(f"{path}: GGUF version {self.version} (supported: 2, 3)")
        self._buf, self._pos = buf, 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._str()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            (n_dims,) = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), ggml_type, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            numel = int(np.prod(dims)) if dims else 1
            nbytes = _num_bytes(ggml_type, numel, dims[0] if dims else 1, name)
            start = data_start + offset
            if start + nbytes > len(self._mm):
                raise ModelFileError(f"{path}: tensor {name} runs past the end of the file")
            self.tensors[name] = TensorInfo(name, dims[::-1], ggml_type, start, nbytes)
        del self._buf

    # ------------------------------------------------------------ header parsing
    def _unpack(self, fmt: str) -> tuple:
        vals = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return vals

    def _str(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        s = bytes(self._buf[self._pos + 8:self._pos + 8 + n]).decode("utf-8", errors="replace")
        self._pos += 8 + n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._str()
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype])[0]
        if vtype == _ARRAY:
            etype, n = self._unpack("<IQ")
            if etype in _NP_SCALAR:
                dt = np.dtype(_NP_SCALAR[etype]).newbyteorder("<")
                arr = np.frombuffer(self._buf, dtype=dt, count=n, offset=self._pos)
                self._pos += n * dt.itemsize
                return arr.tolist()
            return [self._value(etype) for _ in range(n)]
        raise ModelFileError(f"{self.path}: unknown GGUF value type {vtype} at byte {self._pos}")

    # ------------------------------------------------------------ tensors
    def raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return self._mm[info.offset:info.offset + info.num_bytes]

    def lazy(self, name: str) -> "LazyTensor":
        """The tensor unread, sliceable like a tensor: a slice of rows dequantizes only those rows
        (each row of a GGUF tensor is its own run of quantization blocks); other indexing reads the
        whole tensor first. What a tensor-parallel rank reads its share through."""
        return LazyTensor(self, self.tensors[name])

    def load(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, torch shape (slowest dim first)."""
        return self._dequantize(self.tensors[name], self.raw(name), self.tensors[name].shape)

    def _dequantize(self, info: TensorInfo, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        name = info.name
        deq = _TORCH_DEQUANT.get(info.ggml_type)
        if deq is not None:
            # One copy out of the read-only map; torch refuses to wrap non-writable arrays.
            raw = torch.from_numpy(np.array(data, copy=True))
            return deq(raw).reshape(shape)
        if _gguf is None:
            raise UnsupportedModel(f"{self.path}: tensor {name} has ggml type {info.ggml_type}; install gguf")
        qtype = _gguf.GGMLQuantizationType(info.ggml_type)
        block, type_size = _gguf.GGML_QUANT_SIZES[qtype]
        rows = np.array(data).reshape(-1, info.shape[-1] // block * type_size)
        try:
            out = _gguf.quants.dequantize(rows, qtype)
        except NotImplementedError as e:
            raise UnsupportedModel(f"{self.path}: tensor {name}: cannot dequantize {qtype.name}") from e
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


class LazyTensor:
    """One tensor of a GGUFFile, read when indexed (see ``GGUFFile.lazy``)."""

    def __init__(self, f: GGUFFile, info: TensorInfo):
        self.f, self.info = f, info

    def get_shape(self) -> tuple[int, ...]:
        return self.info.shape

    def __getitem__(self, idx) -> torch.Tensor:
        shape = self.info.shape
        first, rest = (idx[0], idx[1:]) if isinstance(idx, tuple) else (idx, ())
        rows_only = (len(shape) >= 2 and isinstance(first, slice) and first.step in (None, 1)
                     and all(r == slice(None) for r in rest))
        if not rows_only:
            return self.f.load(self.info.name)[idx]
        lo, hi, _ = first.indices(shape[0])
        hi = max(hi, lo)
        row_bytes = self.info.num_bytes // shape[0]
        data = self.f.raw(self.info.name)[lo * row_bytes:hi * row_bytes]
        return self.f._dequantize(self.info, data, (hi - lo,) + tuple(shape[1:]))


def _num_bytes(ggml_type: int, numel: int, row: int, name: str) -> int:
    if _gguf is None:
        sizes = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34)}
        if ggml_type not in sizes:
            raise UnsupportedModel(f"tensor {name}: ggml type {ggml_type} needs the gguf package")
        block, size = sizes[ggml_type]
    else:
        try:
            block, size = _gguf.GGML_QUANT_SIZES[_gguf.GGMLQuantizationType(ggml_type)]
        except ValueError as e:
            raise UnsupportedModel(f"tensor {name}: unknown ggml type {ggml_type}") from e
    if row % block:
        raise ModelFileError(f"tensor {name}: row of {row} is not a multiple of the {block}-element block")
    return numel // block * size


# ------------------------------------------------------------ torch dequantizers
# Each takes the raw bytes (uint8, 1-D) and returns float32, 1-D, in file order.
def _f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float32).clone()


def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float16).float()


def _bf16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.bfloat16).float()


def _scale(blocks: torch.Tensor, lo: int) -> torch.Tensor:
    return blocks[:, lo:lo + 2].contiguous().view(torch.float16).float()


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    # block of 32: d (f16) | 32 × int8             value = d · q
    b = raw.view(-1, 34)
    return (b[:, 2:].contiguous().view(torch.int8).float() * _scale(b, 0)).reshape(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # 16 bytes hold 32 weights: the low nibbles are weights 0..15, the high nibbles 16..31.
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    # block of 32: d (f16) | 16 bytes of nibbles   value = d · (q − 8)
    b = raw.view(-1, 18)
    return ((_nibbles(b[:, 2:]) - 8.0) * _scale(b, 0)).reshape(-1)


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    # block of 32: d (f16) | m (f16) | 16 bytes of nibbles   value = d · q + m
    b = raw.view(-1, 20)
    return (_nibbles(b[:, 4:]) * _scale(b, 0) + _scale(b, 2)).reshape(-1)


_TORCH_DEQUANT = {0: _f32, 1: _f16, 30: _bf16, 8: _q8_0, 2: _q4_0, 3: _q4_1}
