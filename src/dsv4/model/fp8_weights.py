"""Projection weights in the checkpoint's FP8 block format: e4m3 codes with one scale per 128 x 128 block.

DeepSeek-V4 ships most attention projections this way (q_a, q_b, kv, o_a, o_b and the indexer's
q_b); the compressors' and the indexer's kv / gate projections and `weights_proj` ship in BF16.
transformers names the scales `<module>.weight_scale_inv` (DeepSeek's own files: `<module>.scale`);
V4 stores them as UE8M0 (`torch.float8_e8m0fnu`, powers of two), V3 as fp32. The weight is

    W[n, k] = e4m3[n, k] * scale[n // 128, k // 128]            (exact in fp32)

    rows    0 ....... 127 | 128 ...... 255 | ... | N-1        (the last block may be partial)
    cols    0 ....... 127 | 128 ...... 255 | ... | K-1
            scale[0, 0]     scale[0, 1]

Keeping the codes (1 byte a weight instead of BF16's 2) halves what a batch-1 decode step reads,
and the products use the checkpoint's own weights, not a BF16 rounding of them.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.errors import InputError

BLOCK = 128
E4M3_MAX = 448.0
SCALE_FORMATS = ("ue8m0", "fp32")
# The modules DeepSeek-V4 checkpoints store in FP8 (transformers' names, relative to the layer).
FP8_MODULES = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "compressor.indexer.q_b_proj")


def scale_shape(n: int, k: int) -> tuple[int, int]:
    return -(-n // BLOCK), -(-k // BLOCK)


def quantize_blocks(w: torch.Tensor, scale_format: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (codes [N, K] float8_e4m3fn, scale [N/128, K/128] fp32, rounded up).

    Scale of a block: amax / 448 ("fp32", as V3 ships) or 2^ceil(log2(amax / 448)) ("ue8m0", as V4
    ships); an all-zero block gets scale 1. Codes round to nearest (e4m3 saturates at 448, which the
    scale never exceeds)."""
    if scale_format not in SCALE_FORMATS:
        raise InputError(f"scale_format {scale_format!r} is not one of {SCALE_FORMATS}")
    n, k = w.shape
    nb, kb = scale_shape(n, k)
    wf = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    wf[:n, :k] = w.float()
    blocks = wf.view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if scale_format == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous(), scale


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes [N, K] e4m3, scale [N/128, K/128]) -> W [N, K] in dtype (exact in fp32)."""
    n, k = codes.shape
    s = scale.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (codes.float() * s).to(dtype)


class BlockFP8Linear(nn.Module):
    """y = x W^T with W held as FP8 block codes (`weight`, float8_e4m3fn [N, K]) and their scales
    (`weight_scale_inv`, fp32 [N/128, K/128]): transformers' parameter names, so an FP8 checkpoint's
    state dict loads as it is. `.to(dtype)` moves it between devices but never casts it."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.ones(scale_shape(out_features, in_features), dtype=torch.float32, device=device),
            requires_grad=False)

    @classmethod
    def from_linear(cls, lin: nn.Linear, scale_format: str = "ue8m0") -> BlockFP8Linear:
        """Quantise an nn.Linear's weight (`quantize_blocks`)."""
        out = cls(lin.in_features, lin.out_features, device=lin.weight.device)
        codes, scale = quantize_blocks(lin.weight.detach(), scale_format)
        out.weight.data, out.weight_scale_inv.data = codes, scale
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype (the reference projection: fp32 math on exact weights)."""
        from dsv4.kernels.reference.linear import linear_fp8
        return linear_fp8(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale_inv).view(*x.shape[:-1], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale_inv, dtype)

    def _apply(self, fn, recurse: bool = True):
        # Module.to(dtype) casts every floating tensor, e4m3 codes included; learn only the target
        # device from `fn` and move the codes and scales there in their own dtypes.
        dev = fn(torch.empty(0, device=self.weight.device)).device
        self.weight.data = self.weight.data.to(dev)
        self.weight_scale_inv.data = self.weight_scale_inv.data.to(dev)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # load_state_dict copies into the parameters: UE8M0 scales (V4's files) become fp32 exactly
        key = prefix + "weight_scale_inv"
        if key in state_dict and state_dict[key].dtype != torch.float32:
            state_dict = {**state_dict, key: state_dict[key].float()}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks of {BLOCK}x{BLOCK}"
