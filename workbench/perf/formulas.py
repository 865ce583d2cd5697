"""Hand counts by formula, public: what a plan estimates without compiling (memory,
collectives, padding, pipeline bubbles' activations, attention kernels' FLOPs and K/V
bytes), to check a compiled plan against or to plan hardware you do not have.

Usage::

    from workbench.perf import formulas

    for c in formulas.moe_collectives(cfg, plan.rules, plan.mesh, batch=8, seq=64):
        print(c.kind, c.count, c.bytes)

The implementation is :mod:`workbench.perf._analytic` (memory, MoE and pipeline
formulas), :mod:`workbench.perf._analytic_collectives` (collectives) and
:mod:`workbench.perf._attention_cost` (attention); each function's docstring gives its
formula.
"""
from workbench.perf._analytic import (activation_bytes, analytic_memory, compute_split,
                                     hbm_bytes, moe_padding_flops, moe_slots_per_token,
                                     pipeline_stage_activations, temp_breakdown)
from workbench.perf._analytic_collectives import (analytic_collectives, context_collectives,
                                                 moe_collectives, pipeline_permutes)
from workbench.perf._attention_cost import kernel_flops, kv_bytes_per_device
from workbench._flops import gpt_flops

__all__ = ["activation_bytes", "analytic_collectives", "analytic_memory", "compute_split",
           "context_collectives", "gpt_flops", "hbm_bytes", "kernel_flops", "kv_bytes_per_device",
           "moe_collectives", "moe_padding_flops", "moe_slots_per_token",
           "pipeline_permutes", "pipeline_stage_activations", "temp_breakdown"]
