"""Fused training ops: one autograd Function + one drop-in nn.Module per chain.

Every module has ``from_modules(...)`` that shares the original parameters, so a
model's ``state_dict`` keys and values are unchanged by fusion.
"""

from opsnn_lab._lazy import lazy_exports

_EXPORTS = {
    "FusedLinearGELUDropout": "linear_gelu_dropout",
    "FusedLinearGELUDropoutLinear": "linear_gelu_dropout",
    "FusedLinearActDropout": "linear_gelu_dropout",
    "FusedLinearActDropoutLinear": "linear_gelu_dropout",
    "FusedGatedMLP": "gated_mlp",
    "FusedPackedGatedMLP": "gated_mlp",
    "FusedGatedProduct": "gated_product",
    "FusedConvBNReLU": "conv_bn_relu",
    "FusedConvBNAct": "conv_bn_relu",
    "FusedConvActDropoutConv": "conv_mlp",
    "FusedQKV": "qkv",
    "FusedAttention": "attention",
    "Dropout": "dropout",
    "FusedDropoutLinear": "dropout_linear",
    "FusedLayerNorm": "norm",
    "FusedRMSNorm": "norm",
    "FusedAddLayerNorm": "norm",
    "FusedAddRMSNorm": "norm",
    "FusedGroupNormAct": "group_norm_act",
    "FusedInstanceNormAct": "instance_norm_act",
    "FusedLinearCrossEntropy": "fused_linear_cross_entropy",
    "linear_cross_entropy": "fused_linear_cross_entropy",
    "lm_head_loss": "lm_head",
    "lm_head_kind": "lm_head",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
