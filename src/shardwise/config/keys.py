"""The one table of top-level DeepSpeed keys shardwise does not implement.

``IGNORED``: accepted, not read, reported in one ``ConfigWarning`` per config (logging, profiling
and GPU-kernel switches whose absence does not change what is trained). ``UNSUPPORTED``: refused
with the reason, because accepting them would silently train something else than asked; a block
written as ``{"enabled": false}`` (or ``false``) is accepted as ignored. docs/config.md lists both.
"""

from __future__ import annotations

IGNORED: dict[str, str] = {
    "dump_state": "debug print of the engine state",
    "timers": "timer configuration",
    "prescale_gradients": "divide before instead of after the all-reduce: the same average",
    "gradient_predivide_factor": "split of the averaging division around the all-reduce",
    "sparse_gradients": "CSR all-reduce of sparse embedding gradients (they are reduced dense)",
    "disable_allgather": "legacy ZeRO switch",
    "fp32_allreduce": "legacy switch; use communication_data_type",
    "seq_parallel_communication_data_type": "DeepSpeed Ulysses sequence parallelism",
    "zero_force_ds_cpu_optimizer": "DeepSpeed CPU-Adam kernel switch",
    "data_types": "grad_accum_dtype: gradients accumulate in the parameter dtype",
    "aio": "async NVMe I/O tuning (NVMe offload is not supported)",
    "autotuning": "DeepSpeed autotuner",
    "graph_harvesting": "CUDA graph capture",
    "nebula": "Azure Nebula checkpoint service",
    "use_data_before_expert_parallelism": "MoE process-group order",
    "vocabulary_size": "unused by DeepSpeed's engine",
}

UNSUPPORTED: dict[str, str] = {
    "sparse_attention": "block-sparse attention is a GPU-only DeepSpeed feature (Triton kernels)",
    "amp": "NVIDIA Apex AMP is CUDA-only; use the fp16 or bf16 block",
    "elasticity": "elastic training changes the batch sizes at launch",
    "compression_training": "DeepSpeed compression (quantization-aware training, pruning)",
    "quantize_training": "DeepSpeed MoQ quantized training",
    "weight_quantization": "DeepSpeed weight quantization",
    "progressive_layer_drop": "progressive layer dropping changes the model",
    "curriculum_learning": "curriculum learning changes the data",
    "data_efficiency": "DeepSpeed data efficiency (curriculum, random-LTD) changes the data",
    "eigenvalue": "Hessian eigenvalue computation",
    "hybrid_engine": "DeepSpeed-Chat inference kernels",
}


def is_disabled(value: object) -> bool:
    """``false``, ``null`` or an object with ``"enabled": false``: the feature is off."""
    if value is False or value is None:
        return True
    return isinstance(value, dict) and value.get("enabled", True) is False
