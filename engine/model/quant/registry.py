"""The quantization format of a checkpoint, read from config.json's quantization_config."""

from __future__ import annotations

from engine.errors import UnsupportedModel
from engine.model.quant.awq import read_awq
from engine.model.quant.base import QuantFormat
from engine.model.quant.compressed_tensors import read_compressed_tensors
from engine.model.quant.fp8 import read_fbgemm_fp8, read_fp8_block
from engine.model.quant.gptq import read_gptq
from engine.model.quant.mxfp4_experts import read_mxfp4

READERS = {
    "awq": read_awq,
    "gptq": read_gptq,
    "compressed-tensors": read_compressed_tensors,
    "fp8": read_fp8_block,
    "fbgemm_fp8": read_fbgemm_fp8,
    "mxfp4": read_mxfp4,
}
SUPPORTED = (
    "awq (gemm, 4-bit), gptq (4-bit, desc_act false), compressed-tensors (pack-quantized 4-bit, fp8), "
    "fp8 (block-wise or per-tensor), fbgemm_fp8, mxfp4 (MoE experts)"
)


def quant_format(config: dict) -> QuantFormat | None:
    """None for a float checkpoint; raises UnsupportedModel with one line for a format the engine cannot load."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    if method not in READERS:
        raise UnsupportedModel(
            f"quantization {method or '<none>'!r} is not supported: the engine loads {SUPPORTED}", param="model"
        )
    return READERS[method](qc)
