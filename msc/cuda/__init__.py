"""CUDA backend: plans rendered to CUDA C++ (templates/) and compiled with
NVRTC through cuda-python (no GPU or driver needed), and the runtime that
launches them (``Communicator``, msc.cuda.runtime) on a GPU (torch CUDA
tensors; needs a driver) or on the emulated device (``device="emu"`` or
``MSC_DEVICE=emu``: the same kernel text built as host C++ and run with
threads on the CPU, msc.cuda.emu; numpy arrays or CPU torch tensors)."""
from msc.cuda.codegen import DTYPES, OPS, KernelLayout, render
from msc.cuda.compiler import CompiledKernel, cache_dir, compile, compile_host, nvrtc_compile
from msc.cuda.device import driver_available
from msc.cuda.diagnose import BrokenCommunicatorError, DeviceTimeoutError, LaunchError
from msc.cuda.runtime import Communicator

__all__ = ["DTYPES", "OPS", "BrokenCommunicatorError", "Communicator", "CompiledKernel", "DeviceTimeoutError",
           "KernelLayout", "LaunchError", "cache_dir", "compile", "compile_host", "driver_available", "nvrtc_compile", "render"]
