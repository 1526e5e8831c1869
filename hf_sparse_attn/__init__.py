"""hf-sparse-attn: sparse attention (BFLA, α-entmax, DashAttention) for Hugging Face Transformers models."""

from hf_sparse_attn.api import PatchHandle, patch_model, patched, unpatch_model
from hf_sparse_attn.integration import ATTN_NAME, VARLEN_ATTN_NAME, register
from hf_sparse_attn.methods import list_methods
from hf_sparse_attn.patches import supported_model_types

register()  # so that from_pretrained(..., attn_implementation="hf_sparse_attn") works after import

__version__ = "0.1.0"
__all__ = [
    "ATTN_NAME",
    "VARLEN_ATTN_NAME",
    "PatchHandle",
    "list_methods",
    "patch_model",
    "patched",
    "supported_model_types",
    "unpatch_model",
]
