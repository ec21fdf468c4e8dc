"""torchtitan's own Trainer on CPU gloo ranks: the patches that needs, a tiny llama3, and synthetic tokens.

torchtitan 0.3.0 is written for accelerators, and for a newer torch than 2.13. The patches are applied in one place,
``use_cpu()``, which a rank calls before it imports ``torchtitan.trainer``; the config choices are made in one
place, ``tiny_llama3_config()``. None touches the checkpointing path under test:

* its device is ``torch._utils._get_available_device_type() or "cuda"``, read once at import into module globals
  of several modules: ``torchtitan.tools.utils.device_type``/``device_module`` are set to the CPU before those
  modules import them (``use_cpu`` refuses to run after they did);
* its metrics ask the device module for a name, properties and memory statistics, which ``torch.cpu`` lacks:
  the CPU module gets stand-ins (a name, the machine's memory, empty statistics);
* ``torchtitan.trainer`` imports minimal_async_ep's GPU kernels (expert parallelism, never run here), which
  ``import triton``, a ~1 GB GPU compiler not installed here: that one module is stubbed, each kernel raising if
  called. (A stub ``triton`` would not do: torch would then take triton for installed and import its compiler.)
* it turns FSDP's gradient division off (``set_gradient_divide_factor(1.0)``), which FSDP sends as a
  ``PREMUL_SUM`` reduce-scatter that gloo refuses: FSDP is also told to reduce with a plain SUM
  (``set_force_sum_reduction_for_comms``), then divides by 1.0 locally, which changes no value;
* FlexAttention has no CPU backward, and 0.3.0 refuses ``"sdpa"`` for language models by name: the tiny model's
  attention configs are swapped for ``ScaledDotProductAttention.Config`` (causal, what llama3 computes without
  document masks), and the synthetic data carries no ``positions``, so no masks are built;
* after the first step it shortens the process groups' timeouts with ``torch.distributed.set_timeout``, which
  torch 2.13 lacks: skipped where torch lacks it;
* its default ``spmd_backend="spmd_types"`` hands torch 2.13's ``fully_shard`` plain tensors it refuses ("all
  parameters must be DTensors"), and ``"full_dtensor"`` keeps meshes across Trainers of one process, so a second
  Trainer's fails in ``fully_shard``: the tiny model uses ``"partial_dtensor"`` (a config line: FSDP2 alone shards
  it, its parameters and optimizer state DTensors as under the other two);
* DCP's pinned-memory stager (``async_mode="async_with_pinned_mem"``) pins through the accelerator's host
  allocator and copies on an accelerator stream, and refuses without one: ``use_pinned_memory`` and
  ``use_non_blocking_copy`` are switched off on the stager torchtitan builds (its shared memory, staging in a
  background thread and DCP's process executor stay as they are);
* the tiny model computes in float32 (``mixed_precision_param``; bf16 matmuls are slow on CPU), without activation
  checkpointing or validation, on 2 layers of the debug model, sequences of 32 tokens, 2 a batch.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

# The one module torchtitan.trainer imports that imports triton (minimal_async_ep's GPU kernels).
_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
# Modules that copy torchtitan.tools.utils.device_type / device_module into their own globals at import.
_DEVICE_READERS = ("torchtitan.components.metrics", "torchtitan.distributed.utils",
                   "torchtitan.distributed.parallel_dims", "torchtitan.models.common.token_dispatcher",
                   "torchtitan.tools.profiler")

VOCAB = 2048  # the debug llama3's vocabulary


def use_cpu() -> None:
    """Apply every patch of this module's docstring; call before anything imports ``torchtitan.trainer``."""
    already = [name for name in _DEVICE_READERS if name in sys.modules]
    if already:
        raise RuntimeError(f"use_cpu() must run before torchtitan's device readers are imported: {already}")
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type, titan_utils.device_module = "cpu", _cpu_device_module()
    _import_trainer_without_triton()
    _sum_reduction_for_gloo()
    _timeouts_left_alone_before_torch_2_14()
    _stager_without_pinned_memory()


def _cpu_device_module() -> types.ModuleType:
    module = types.ModuleType("torch_cpu_for_torchtitan")
    module.__dict__.update({name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")})
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    nothing = lambda device=None: None  # noqa: E731
    vars(module).update(
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=total_memory),
        memory_stats=lambda device=None: {},
        reset_peak_memory_stats=nothing, empty_cache=nothing,
        set_device=lambda device: None,  # torch.cpu.set_device accepts "cpu" only, torchtitan passes cpu:0
        current_device=lambda: 0,  # torch.cpu's is "cpu", which torchtitan passes as barrier(device_ids=[...])
    )
    return module


def _import_trainer_without_triton() -> None:
    kernels = types.ModuleType(_TRITON_KERNELS)

    def kernel(name: str):
        if name.startswith("__"):
            raise AttributeError(name)  # inspect walks sys.modules asking for __file__

        def needs_triton(*args, **kwargs):
            raise RuntimeError(f"{_TRITON_KERNELS}.{name} is a triton kernel, stubbed out for CPU tests")

        return needs_triton

    vars(kernels)["__getattr__"] = kernel  # a module's __getattr__ (PEP 562): every kernel name resolves
    sys.modules[_TRITON_KERNELS] = kernels
    import torchtitan.trainer  # noqa: F401


def _sum_reduction_for_gloo() -> None:
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule

    divide_by_one = titan_fsdp.disable_fsdp_gradient_division

    def divide_by_one_with_sum(model: torch.nn.Module) -> None:
        divide_by_one(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = divide_by_one_with_sum


def _timeouts_left_alone_before_torch_2_14() -> None:
    import torch.distributed as dist
    import torchtitan.distributed.utils as titan_dist_utils

    if not hasattr(dist, "set_timeout"):
        titan_dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None


def _stager_without_pinned_memory() -> None:
    import torchtitan.components.checkpointer.dcp as titan_dcp
    from torch.distributed.checkpoint.staging import DefaultStager

    class CpuStager(DefaultStager):
        def __init__(self, options):
            options.use_pinned_memory = options.use_non_blocking_copy = False
            super().__init__(options)

    titan_dcp.DefaultStager = CpuStager


# --------------------------------------------------------------------------------------------------
# A tiny llama3 and synthetic tokens, chosen through torchtitan's own Config pattern
# --------------------------------------------------------------------------------------------------


def tiny_llama3_config(dump_folder: str, checkpoint: Any, *, steps: int, layers: int = 2, seq_len: int = 32,
                       local_batch_size: int = 2) -> Any:
    """torchtitan's ``llama3_debugmodel()`` Trainer.Config, smaller and on CPU, saving through ``checkpoint``."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:layers]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.dump_folder = dump_folder
    config.hf_assets_path = dump_folder  # the tokenizer below reads nothing
    config.tokenizer = SyntheticTokenizer.Config()
    config.dataloader = SyntheticTokens.Config()
    config.training.steps = steps
    config.training.seq_len = seq_len
    config.training.local_batch_size = local_batch_size
    config.training.mixed_precision_param = "float32"
    config.parallelism.spmd_backend = "partial_dtensor"
    config.activation_checkpoint = None
    config.validator.enable = False
    config.metrics.log_freq = 1
    config.checkpoint = checkpoint
    return config


class SyntheticTokenizer(BaseTokenizer):
    """Nothing to read: the synthetic data is token ids already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str = "") -> None:
        super().__init__()

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError

    def get_vocab_size(self) -> int:
        return VOCAB


class SyntheticTokens(BaseDataLoader):
    """Batch ``n`` of data-parallel rank ``r`` is drawn from a generator seeded by ``(r, n)``: the same batches on
    every run, and after a resume the next ones. Its state (batches consumed) is equal on every rank."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, local_batch_size: int, seq_len: int,
                 **unused: Any) -> None:
        self.dp_rank, self.batch_size, self.seq_len = dp_rank, local_batch_size, seq_len
        self.consumed = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            generator = torch.Generator().manual_seed(1_000_003 * self.dp_rank + self.consumed)
            tokens = torch.randint(0, VOCAB, (self.batch_size, self.seq_len + 1), generator=generator)
            self.consumed += 1
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed = state_dict["consumed"]
