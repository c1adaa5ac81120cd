"""Kernel choices through public APIs: the attention backend and Apex's fused LayerNorm.

from litegen.kernels import apply_fused_layernorm, attention_context

swapped = apply_fused_layernorm(model)  # 0, with a warning, when Apex is not installed
"""

from litegen.kernels.attention import attention_context
from litegen.kernels.layernorm import apply_fused_layernorm

__all__ = ["apply_fused_layernorm", "attention_context"]
