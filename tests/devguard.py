"""A CPU stand-in for a GPU run's device split, so that tests catch misplaced tensors on the CPU machine.

On a GPU machine the tests' ``DEV`` is ``"cuda"`` while a tensor made without ``device=`` lands on the CPU: an op
mixing the two fails there (and a kernel handed a CPU tensor fails in Triton's launcher), but on the CPU machine
every tensor is on the CPU and such faults never show. :class:`HostDeviceGuard` tags each tensor the code makes as
*host* (a factory call without ``device=``, ``.cpu()``) or *device* (``device=`` / ``.to(...)`` given a string in a
test file, as the tests' ``DEV``, ``.cuda()``; given a ``torch.device``, as code passes another tensor's
``.device``, or a string in library code, the result is left untagged: neutral; a move returns a new tensor, as on a
GPU), propagates the tags through every op (an op's output is device if an input is, else host if an input is), and
raises where CUDA would: an op whose inputs hold a device tensor and a host tensor of dim > 0 (CUDA accepts 0-dim
CPU tensors, host index tensors in ``t[idx]`` and cross-device ``copy_``), and a kvrepro kernel wrapper given a host
tensor (checked when it validates its pool). Calls made from inside Triton's interpreter are not tagged (it moves
the arguments itself).

Use the ``host_device_guard`` fixture (active only where ``DEV`` is the CPU).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {"arange", "tensor", "zeros", "ones", "empty", "full", "randn", "rand", "randint", "randperm",
             "linspace", "as_tensor", "eye", "empty_strided"}
LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "randn_like", "rand_like"}
CROSS_DEVICE_OK = {"__getitem__", "copy_", "to", "cpu", "cuda", "__repr__", "__format__", "__str__", "tolist",
                   "item", "__len__", "__bool__", "__index__", "__int__", "__float__", "numpy", "equal"}
_SKIP = (os.sep + "triton" + os.sep, os.sep + "torch" + os.sep)
ATTR = "_kvrepro_place"
TESTS = os.path.dirname(os.path.abspath(__file__)) + os.sep


class DeviceMixError(RuntimeError):
    pass


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _asked(device, test: bool) -> str | None:
    """The tag of a tensor made or moved to ``device``: a string in a test (the tests' ``DEV``, "cuda" on a GPU) is
    the device; elsewhere (library defaults such as ``device="cpu"``) or a ``torch.device`` object (as code takes it
    from another tensor, ``x.device``, which this guard cannot follow) the result is left untagged: neutral, it never
    raises on its own."""
    return "device" if isinstance(device, str) and test else None


def place(t: torch.Tensor) -> str | None:
    return getattr(t, ATTR, None)


def _tag(out, where: str | None) -> None:
    if where is None:
        return
    for t in _tensors(out):
        try:
            setattr(t, ATTR, where)
        except (AttributeError, RuntimeError):
            pass


class HostDeviceGuard(TorchFunctionMode):
    """The mode; see the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        caller = sys._getframe(1).f_code.co_filename
        out = func(*args, **kwargs)
        if any(s in caller for s in _SKIP):
            return out
        name = getattr(func, "__name__", "")
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        test = caller.startswith(TESTS)
        moved = name in ("cpu", "cuda") or name == "to" and (
            kwargs.get("device") is not None or any(isinstance(a, (str, torch.device)) for a in args[1:]))
        if moved and ins and out is ins[0]:    # a move within the CPU returns its input; on a GPU it is a new tensor
            out = out.clone()
        if name in FACTORIES:
            _tag(out, "host" if kwargs.get("device") is None else _asked(kwargs["device"], test))
        elif name in LIKE:
            _tag(out, (place(ins[0]) if ins else None) if kwargs.get("device") is None
                 else _asked(kwargs["device"], test))
        elif name == "cpu":
            _tag(out, "host")
        elif name == "cuda":
            _tag(out, "device")
        elif moved:
            d = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
            _tag(out, _asked(d, test))
        elif name.endswith("_") and not name.startswith("__") or name == "__setitem__":
            self._check(name, ins[1:] if name == "copy_" else ins, skip_index=name == "__setitem__")
        else:
            self._check(name, ins)
            _tag(out, "device" if any(place(t) == "device" for t in ins)
                 else "host" if any(place(t) == "host" for t in ins) else None)
        return out

    @staticmethod
    def _check(name: str, ins, skip_index: bool = False) -> None:
        if name in CROSS_DEVICE_OK:
            return
        if skip_index:   # t[idx] = value: the index may be on the host, the value may not (unless 0-dim)
            ins = ins[:1] + ins[-1:]
        dev = [t for t in ins if place(t) == "device"]
        host = [t for t in ins if place(t) == "host" and t.dim() > 0]
        if dev and host:
            raise DeviceMixError(f"{name}: a host tensor {tuple(host[0].shape)} (made without device=) meets a device "
                                 f"tensor {tuple(dev[0].shape)}; on a GPU this is 'Expected all tensors to be on the "
                                 "same device'")


def check_kernel_args(frame_locals: dict) -> None:
    """Raise if a kernel wrapper's arguments (its frame's locals) hold a host tensor of dim > 0."""
    for k, v in frame_locals.items():
        for t in _tensors(v):
            if place(t) == "host" and t.dim() > 0:
                raise DeviceMixError(f"kernel argument {k} {tuple(t.shape)} is a host tensor (made without device=); "
                                     "on a GPU Triton refuses it: 'Pointer argument cannot be accessed from Triton'")


@pytest.fixture
def host_device_guard(monkeypatch):
    """Run the test under :class:`HostDeviceGuard` where the tests' device is the CPU (on a GPU the split is real)."""
    if torch.cuda.is_available():
        yield None
        return
    from kvrepro.ops import common, decode, prefill, store

    real = common.check_pool

    def guarded(pool, layout, **kw):
        check_kernel_args(sys._getframe(1).f_locals)
        return real(pool, layout, **kw)

    for mod in (decode, prefill, store):
        monkeypatch.setattr(mod, "check_pool", guarded)
    with HostDeviceGuard() as g:
        yield g
