"""Optional fused kernels, swapped into a model in place.

from litegen.kernels import apply_fused_gelu_mlp, apply_fused_layernorm

swapped = apply_fused_layernorm(model)  # 0, with a warning, when Apex is not installed
fused = apply_fused_gelu_mlp(model)  # MLPs whose GELU now runs in GEMM epilogues
"""

from litegen.kernels.attention import attention_context
from litegen.kernels.layernorm import apply_fused_layernorm
from litegen.kernels.mlp_fusion import apply_fused_gelu_mlp

__all__ = ["apply_fused_gelu_mlp", "apply_fused_layernorm", "attention_context"]
