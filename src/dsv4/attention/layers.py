"""Small layers of the attention sub-block: RMS norms and the grouped output projection."""

from __future__ import annotations

import types

import torch
from torch import nn

from dsv4.kernels.dispatch import ops_for
from dsv4.kernels.streams import on
from dsv4.model.fp8_weights import BLOCK, BlockFP8Linear


class RMSNorm(nn.Module):
    """Weighted RMSNorm over the last dim, computed in fp32, cast back once at the end."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rms_unweighted(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm without weight over the last dim (fp32 math)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def project(mod: nn.Linear | BlockFP8Linear, x: torch.Tensor, ops: types.SimpleNamespace, groups: int = 1
            ) -> torch.Tensor:
    """mod(x) through an op namespace's kernels: `linear` for a dense weight, `linear_fp8` for FP8
    blocks (groups: see `linear_fp8`)."""
    if isinstance(mod, BlockFP8Linear):
        return ops.linear_fp8(x, mod.weight, mod.weight_scale_inv, groups)
    return ops.linear(x, mod.weight, groups)


def grouped_output(o: torch.Tensor, o_a: nn.Linear | BlockFP8Linear, o_b: nn.Linear | BlockFP8Linear, groups: int,
                   ops: types.SimpleNamespace) -> torch.Tensor:
    """out = W_ob · concat_g(W_oa[g] · concat(o_h for h in group g)); heads grouped contiguously.

    Args:
        o: [T, H, D] attention outputs; o_a: weight [G*R_o, H*D/G] (rows g*R_o:(g+1)*R_o belong to
        group g); o_b: weight [d, G*R_o]; ops: the op namespace whose kernels run the projections.
    Returns:
        [T, d]
    """
    # one launch for every group: a batched GEMM, or at one row the grouped GEMV
    return project(o_b, project(o_a, o.reshape(o.shape[0], -1), ops, groups), ops)


class FusedProjection:
    """Several projections of one input as one GEMM per weight format: x @ [W_1; ...; W_n]^T, split
    into column views (dense weights in one GEMM, FP8 block weights in one `linear_fp8`).

    A decode step of a few tokens reads each weight once; separate GEMMs would cost a launch each
    (a CSA layer has seven projections of x). On first use, and again whenever a module's weight
    was replaced (`.to()`, `.cuda()`), the weights are concatenated once and each module's
    tensors are re-pointed into the fused buffers (`.data`): memory is not held twice, and
    `load_state_dict` (an in-place copy) keeps writing into the buffers. An FP8 part starts at a
    multiple of 128 rows (zero rows pad the one before it) so that its scale rows stay its own.
    """

    def __init__(self, linears: list[nn.Linear | BlockFP8Linear]):
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self._dense: torch.Tensor | None = None
        self._fp8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cols: list[tuple[bool, int]] = []        # per part: (fp8?, first output column)
        self._ptrs: list[int] | None = None

    def _tensors(self) -> list[torch.Tensor]:
        return [t for lin in self.linears
                for t in ((lin.weight, lin.weight_scale_inv) if isinstance(lin, BlockFP8Linear) else (lin.weight,))]

    def _build(self) -> None:
        if self.linears[0].weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FusedProjection: run the layer once eagerly before capturing it in a CUDA graph "
                               "(the fused weight is built on first use)")
        dense = [lin for lin in self.linears if not isinstance(lin, BlockFP8Linear)]
        fp8 = [lin for lin in self.linears if isinstance(lin, BlockFP8Linear)]
        self._dense = self._fp8 = None
        if dense:
            fused = torch.cat([lin.weight.detach() for lin in dense])
            for lin, part in zip(dense, fused.split([lin.out_features for lin in dense])):
                lin.weight.data = part
            self._dense = fused
        starts = {}
        if fp8:
            rows = [-(-lin.out_features // BLOCK) * BLOCK for lin in fp8]
            first = fp8[0].weight
            codes = torch.zeros(sum(rows), first.shape[1], dtype=first.dtype, device=first.device)
            scale = torch.cat([lin.weight_scale_inv.detach() for lin in fp8])
            at = 0
            for lin, r in zip(fp8, rows):
                codes[at:at + lin.out_features] = lin.weight.detach()
                lin.weight.data = codes[at:at + lin.out_features]
                lin.weight_scale_inv.data = scale[at // BLOCK:(at + r) // BLOCK]
                starts[id(lin)] = at
                at += r
            self._fp8 = codes, scale
        at, self._cols = 0, []
        for lin in self.linears:
            if id(lin) in starts:
                self._cols.append((True, starts[id(lin)]))
            else:
                self._cols.append((False, at))
                at += lin.out_features
        self._ptrs = [t.data_ptr() for t in self._tensors()]

    def fp8_parts(self) -> list[bool]:
        """Per part, in order: whether it is held as FP8 blocks (else dense)."""
        self.weight()                   # (re)builds the fused buffers and the part table if needed
        return [fp8 for fp8, _ in self._cols]

    def weight(self) -> torch.Tensor | None:
        """The fused dense weight [sum N, K] (None when every part is FP8)."""
        if self._ptrs != [t.data_ptr() for t in self._tensors()]:
            self._build()
        return self._dense

    def __call__(self, x: torch.Tensor, ops: types.SimpleNamespace | None = None,
                 norm: tuple[torch.Tensor, float] | None = None,
                 dense_on: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, ...]:
        """ops: the op namespace whose `linear` / `linear_fp8` run the GEMMs (default: the reference's);
        norm = (w, eps): the projections of RMSNorm_w(x) (each GEMM applies it: inside a one-row GEMV,
        else by the norm kernel first). dense_on: where both formats are held, the dense GEMM runs on
        this stream (which must already wait for x), the FP8 one on the current stream; the caller
        orders every read of a dense part after it (`AttentionSubBlock.dense_inputs`)."""
        ops = ops or ops_for(x.device, "reference")
        dense = self.weight()
        if norm is not None and dense is not None and self._fp8 is not None:
            # two GEMMs: normalise once, before them
            none = x.new_empty(x.shape[0], 0, dtype=torch.float32)
            x, norm = ops.norm_rope(x, norm[0], norm[1], none, none), None
        if dense_on is not None and dense is not None and self._fp8 is not None:
            y_fp8 = ops.linear_fp8(x, *self._fp8, norm=norm)         # launched first: the caller's critical path
            with on(dense_on):
                y_dense = ops.linear(x, dense, norm=norm)
        elif dense is not None and self._fp8 is not None:
            y_dense, y_fp8 = ops.linear_pair(x, dense, *self._fp8)      # x normalised above
        else:
            y_dense = ops.linear(x, dense, norm=norm) if dense is not None else None
            y_fp8 = ops.linear_fp8(x, *self._fp8, norm=norm) if self._fp8 is not None else None
        return tuple((y_fp8 if fp8 else y_dense)[:, c:c + n] for (fp8, c), n in zip(self._cols, self.sizes))

    def part(self, x: torch.Tensor, i: int, ops: types.SimpleNamespace | None = None,
             norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """Part i's projection alone (`__call__`'s i-th output, as a contiguous tensor): one GEMM over
        its rows of the fused buffer (a view: no weight is copied)."""
        ops = ops or ops_for(x.device, "reference")
        dense = self.weight()
        (fp8, c), n = self._cols[i], self.sizes[i]
        if not fp8:
            return ops.linear(x, dense[c:c + n], norm=norm)
        codes, scale = self._fp8
        return ops.linear_fp8(x, codes[c:c + n], scale[c // BLOCK:-(-(c + n) // BLOCK)], norm=norm)
