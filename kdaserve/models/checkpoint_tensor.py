"""A checkpoint tensor not read yet: what a tensor-parallel rank is handed, so that it reads only
its own slice of a sharded weight (safetensors `get_slice`), never the whole tensor of a weight it
keeps a part of.

`shape`, `dtype` and `dim()` come from the file's header; `narrow(dim, start, length)` (what
layers/distributed.local_slice takes a rank's part with) reads that part alone; anything else
reads the tensor whole, once: a torch function it is passed to (`param.copy_(t)`,
`torch.cat([...])`) through `__torch_function__`, and any tensor method or attribute
(`t.reshape(...)`, `t.float()`) through `__getattr__`, so every loader keeps working unchanged and
only the ones that slice first read less."""

from __future__ import annotations

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointTensor:
    def __init__(self, handle, name: str, on_read=None):
        """`handle`: an open safetensors file; `on_read(name, nbytes)`: told of every read (tests)."""
        self.name = name
        self._handle, self._slice = handle, handle.get_slice(name)   # the file stays open while the tensor lives
        self.shape = torch.Size(self._slice.get_shape())
        self.dtype = _DTYPES[self._slice.get_dtype()]
        self._whole: torch.Tensor | None = None
        self._on_read = on_read

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def _read(self, index) -> torch.Tensor:
        t = self._slice[index]
        if self._on_read is not None:
            self._on_read(self.name, t.numel() * t.element_size())
        return t

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (or columns, ...) [start, start + length) of dimension `dim`, read alone."""
        if self._whole is not None:
            return self._whole.narrow(dim, start, length)
        return self._read((slice(None),) * dim + (slice(start, start + length),))

    def load(self) -> torch.Tensor:
        """The whole tensor (read once)."""
        if self._whole is None:
            self._whole = self._read(slice(None)) if self.dim() else self._read(())
        return self._whole

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.load(), name)

    # Python looks special methods up on the type, past __getattr__: the ones a loader may use.
    def __getitem__(self, index):
        return self.load()[index]

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self):
        return iter(self.load())

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def whole(x):
            if isinstance(x, CheckpointTensor):
                return x.load()
            if isinstance(x, (list, tuple)):
                return type(x)(whole(v) for v in x)
            return x

        return func(*whole(args), **{k: whole(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"CheckpointTensor({self.name!r}, shape={list(self.shape)}, dtype={self.dtype}, read={self._whole is not None})"
