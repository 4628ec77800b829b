"""Tensors of the lab's torch stand-in: a shape, a dtype and one value (see __init__)."""

from . import _hw, cuda


class dtype:  # noqa: N801 - torch's name
    def __init__(self, name, itemsize, floating):
        self.name, self.itemsize, self.is_floating_point = name, itemsize, floating

    def __repr__(self):
        return f"torch.{self.name}"


bfloat16 = dtype("bfloat16", 2, True)
float16 = dtype("float16", 2, True)
float32 = dtype("float32", 4, True)
int32 = dtype("int32", 4, False)
bool_ = dtype("bool", 1, False)


class Generator:
    def __init__(self, device="cpu"):
        self.device = device

    def manual_seed(self, seed):
        return self


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


class Tensor:
    def __init__(self, shape, dtype_, value=0.0, wrong=0, device=None):
        self.shape, self.dtype, self.value, self.wrong = tuple(shape), dtype_, value, wrong
        self.device = cuda.current_device() if device is None else device

    def numel(self):
        return _numel(self.shape)

    def element_size(self):
        return self.dtype.itemsize

    def _like(self, shape=None, value=None, dtype_=None, wrong=0):
        return Tensor(self.shape if shape is None else shape, dtype_ or self.dtype,
                      self.value if value is None else value, wrong, self.device)

    def fill_(self, value):
        nbytes = self.numel() * self.dtype.itemsize
        _hw.TIMELINE.enqueue(nbytes / (_hw.gpu_figure("mem_write_gbs", 1000) * _hw.GB))
        physical = cuda._physical(self.device)
        bad = int(_hw.faults().get("memory_errors", {}).get(str(physical), 0))
        self.value, self.wrong = value, min(bad, self.numel()) if nbytes >= 2**30 else 0
        return self

    def zero_(self):
        return self.fill_(0)

    def split(self, size):
        n, out, left = self.numel(), [], self.wrong
        for start in range(0, n, size):
            out.append(self._like((min(size, n - start),), wrong=left))
            left = 0
        return out

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        shape = list(self.shape)
        out = []
        for dim, i in enumerate(index):
            if isinstance(i, slice):
                out.append(len(range(*i.indices(shape[dim]))))
            elif not -shape[dim] <= i < shape[dim]:
                raise IndexError(f"index {i} is out of bounds for dimension {dim}")
        return self._like(tuple(out) + tuple(shape[len(index):]))

    def __ne__(self, other):
        return self._like(dtype_=bool_, value=self.value != other, wrong=self.wrong)

    def sum(self):
        if self.dtype is bool_:  # how many are true: all, or the words read back wrong
            total = self.numel() if self.value else self.wrong
        else:
            total = self.value * self.numel()
        return self._like((), value=total, dtype_=float32)

    def item(self):
        cuda.synchronize()
        return self.value

    def float(self):
        return self._like(dtype_=float32)

    def abs(self):
        return self._like(value=abs(self.value))

    def max(self):
        return self._like(())

    def all(self):
        return self._like((), value=bool(self.value), dtype_=bool_)

    def __sub__(self, other):
        return self._like(value=self.value - other.value)

    def __truediv__(self, other):
        return self._like(value=self.value / other.value if other.value else float("inf"))

    def __matmul__(self, other):
        m, k = self.shape
        n = other.shape[1]
        tflops = _hw.gpu_figure("tflops_bf16", 100) * (1 if self.dtype is bfloat16 else 0.5)
        _hw.TIMELINE.enqueue(2 * m * n * k / (tflops * 1e12))
        physical = cuda._physical(self.device)
        off = float(_hw.faults().get("matmul_error", {}).get(str(physical), 0))
        product = self.value * other.value * (1 + off if self.dtype is bfloat16 else 1)
        return Tensor((m, n), self.dtype, product, 0, self.device)


def empty(*shape, dtype=float32, device=None):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return Tensor(shape, dtype)


def randn(*shape, dtype=float32, device=None, generator=None):
    return Tensor(shape, dtype, 1.0)


def isfinite(tensor):
    return tensor._like(dtype_=bool_, value=abs(tensor.value) != float("inf"))
