"""CUDA backend: plans rendered to CUDA C++ (templates/) and compiled with
NVRTC through cuda-python. Compiling needs no GPU or driver."""
from msc.cuda.codegen import DTYPES, OPS, KernelLayout, render
from msc.cuda.compiler import CompiledKernel, cache_dir, compile, nvrtc_compile

__all__ = ["DTYPES", "OPS", "CompiledKernel", "KernelLayout", "cache_dir", "compile", "nvrtc_compile", "render"]
