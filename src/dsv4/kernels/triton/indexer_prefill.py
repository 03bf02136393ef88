"""Triton indexer selection for prefill chunks.

A prefill token t of request b scores the first (t + 1) // m entries of b's keys. Consecutive
tokens of one request see (nearly) the same keys, so E2M1 keys (mxfp4, nvfp4, the scan's
formats) go through `indexer_scan._prefill_scan_kernel`: a program takes a group of up to
TOKENS such tokens and decodes each key tile once for all of them (dots with two tokens'
queries side by side). On sm_90, mxfp4 keys at V4's indexer shapes (64 heads of 128, 64 keys a
page) take `indexer_scan_tma._prefill_scan_tma_kernel` instead: the same groups, each page copied by
the tensor memory accelerator and decoded once, an int8 MMA a token where keys and queries allow it
(H100, the chunk below: 1,666 against 1,947 µs; benchmarks/NOTES.md #213). Other formats score one
row per token with the decode kernel (`paged_indexer_scores`: block_table[b] and the token's count
of visible entries).

Tokens are scored in slices so the [rows, N] score buffer stays within 256 MiB (an 8K chunk
over 8K entries is one slice; at N = 256K entries, 256 rows), and each slice goes through the same
exact top-k (ties to the smaller index) as decode.

Measured (H200, Triton 3.6; the last 8K chunk of a 32K prompt, mxfp4, 64 heads, CUDA-graph replays,
`tune_decode.py --prefill-indexer`): scores of the chunk one row per token 3,320 µs; grouped, 4
tokens per program as two dots of 2 tokens, 64 keys x 4 warps, the next tile's bytes loaded over
this one's math (as the decode scan): 1,963 µs, the chunk's 962 GFLOP at 64% of the bf16 matrix
rate `dsv4 bench` measures (764 TFLOP/s). No prefetch 2,199; 4 tokens as one dot 2,228; 2 tokens
3,039; 8 tokens x 8 warps 2,321; 4 tokens at 8 warps 2,828 (two warpgroups share the decoded
tile through shared memory).
"""

from __future__ import annotations

import torch
import triton

from dsv4.errors import FormatError
from dsv4.kernels.triton import indexer_scan, indexer_scan_tma
from dsv4.kernels.triton.decode_common import note_compile, precision_id
from dsv4.kernels.triton.indexer_scores import DEFAULT_PRECISION

_SCORE_BYTES = 256 << 20  # one slice's [rows, N] fp32 scores
_MIN_ROWS = 256
TOKENS = 4  # query tokens per program of the grouped scan
#: programs a group of the TMA prefill scan (`indexer_scan_tma.launch_prefill`). H100, the last 8K chunk
#: of a 32K prompt, µs (`tune_decode.py --prefill-indexer`): 1 1,711.9, 2 1,666.5; the Triton grouped scan
#: 1,947.4
TMA_PROGRAMS = 2


def token_groups(query_lens: tuple[int, ...], r0: int, r1: int, tokens: int, device) -> torch.Tensor:
    """[G, 3] int32 (first row - r0, rows, request): rows r0 .. r1 - 1 of a batch packed request
    after request, cut into runs of at most `tokens` consecutive rows of one request."""
    groups, o = [], 0
    for b, n in enumerate(query_lens):
        for s in range(max(o, r0), min(o + n, r1), tokens):
            groups.append((s - r0, min(tokens, o + n - s, r1 - s), b))
        o += n
    # Pinned and asynchronous: a pageable copy waits for the stream to drain, stalling the host that
    # enqueues the layer (benchmarks/prefill_gaps.py: 1-2 waits a CSA prefill chunk before).
    pin = torch.device(device).type == "cuda"
    if pin and torch.cuda.is_current_stream_capturing():
        # a captured copy would read its pinned source again at every replay, long after it is freed
        raise RuntimeError("prefill indexer: a prefill chunk cannot be captured in a CUDA graph (its token "
                           "groups are planned on the host); capture decode steps only")
    host = torch.tensor(groups, dtype=torch.int32, device="cpu", pin_memory=pin).reshape(-1, 3)
    return host.to(device, non_blocking=True)


def grouped_scores(q: torch.Tensor, weights: torch.Tensor, idx_views: dict[str, torch.Tensor], fmt,
                   block_table: torch.Tensor, visible: torch.Tensor, groups: torch.Tensor, max_entries: int, epb: int,
                   *, tokens: int, dot_tokens: int | None = None, precision: str | None = None,
                   block_n: int | None = None, prefetch: bool = True,
                   programs: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                   maxnreg: int | None = None, tma: bool | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [T, max_entries] of the rows of q [T, H, D_I] (fp32, the keys' stored basis) with
    weights [T, H]: row r sees entries [0, visible[r]) of request groups[., 2]'s keys (block_table
    rows are per request), -inf beyond. groups as `token_groups` with at most `tokens` rows each.
    E2M1 keys (mxfp4, nvfp4) at bf16 / bf16x2 only. dot_tokens: tokens per dot (default min(tokens,
    2)); out: where to write (default a new tensor). tma: mxfp4 keys at "bf16" with 64 heads of 128 and
    64 keys a page on sm_90 run `indexer_scan_tma.launch_prefill` (pages by the tensor memory
    accelerator, the int8 MMA) unless tma=False; tma=True where it cannot raises."""
    typed = fmt.typed(idx_views)
    data = typed["data"]
    scale = typed.get("scale", data)
    glob = typed.get("global", scale)
    prec = precision_id(precision, DEFAULT_PRECISION[fmt.name])
    if not indexer_scan.scan_supported(fmt.name, q.shape[-1], data, scale, prec):
        raise FormatError(f"grouped_scores reads E2M1 keys at bf16 / bf16x2; got {fmt.name} at {precision}")
    cuda = q.device.type == "cuda"
    out = torch.empty(q.shape[0], max_entries, dtype=torch.float32, device=q.device) if out is None else out
    if q.shape[0] == 0 or max_entries == 0 or groups.shape[0] == 0:
        return out.fill_(float("-inf"))
    tma_ok = cuda and indexer_scan_tma.supported(q, data, scale, fmt.name, epb, prec)
    if tma and not tma_ok:
        raise FormatError("the TMA prefill scan needs mxfp4 keys at bf16, 64 heads of 128, 64 keys a page "
                          "(its scale bytes right after its key bytes, as the pool stores them), sm_90")
    if tma_ok and tma is not False:
        k = indexer_scan_tma.launch_prefill(
            _scan_queries(q), weights.float().contiguous(), out, data, scale, block_table, visible.to(torch.int32),
            groups, max_entries, 1.0, tokens=triton.next_power_of_2(tokens), programs=programs or TMA_PROGRAMS,
            maxnreg=maxnreg)
        note_compile("indexer_prefill_scan_tma", k)
        return out
    bn = block_n or (64 if cuda else 16)
    tiles = triton.cdiv(max_entries, bn)
    tokens = triton.next_power_of_2(tokens)
    dt = min(tokens, dot_tokens or 2)
    weights = weights.float()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    k = indexer_scan.launch_prefill_scan(
        (groups.shape[0], min(programs or 1, tiles)), _scan_queries(q), weights, out, data, scale, glob,
        block_table, visible.to(torch.int32), groups, tiles, max_entries, epb, 1.0, fmt_name=fmt.name, prec=prec,
        cuda=cuda, block_n=bn, tokens=tokens, dot_tokens=dt, prefetch=prefetch, num_warps=num_warps,
        num_stages=num_stages, maxnreg=maxnreg if cuda else None)
    note_compile("indexer_prefill_scan", k)
    return out


def _scan_queries(q: torch.Tensor) -> torch.Tensor:
    """q as the grouped scan reads it: bf16 as it comes (queries rounded to mxfp4 are bf16-exact: half
    the bytes of fp32), else fp32."""
    return q.contiguous() if q.dtype == torch.bfloat16 else q.float().contiguous()


def prefill_indexer_topk(q: torch.Tensor, weights: torch.Tensor, idx_views: dict[str, torch.Tensor], fmt,
                         block_table: torch.Tensor, token_request: torch.Tensor, positions: torch.Tensor,
                         query_lens: tuple[int, ...], num_entries: tuple[int, ...], ratio: int, topk: int,
                         epb: int, *, tokens: int | None = None) -> torch.Tensor:
    """Same contract as `dsv4.kernels.reference.indexer.prefill_indexer_topk` (q fp32 or bf16). tokens: query tokens
    per program of the grouped scan (default `TOKENS`; 0: one row per token, the decode kernel)."""
    from dsv4.kernels.triton.ops import namespace

    ops = namespace()
    n_max = max(num_entries, default=0)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    if n_max == 0:
        return out
    # Only the batch's used block-table columns: a 1M-token table is 4,096 columns wide.
    cols = -(-n_max // epb)
    table = block_table[:, :cols]
    typed = fmt.typed(idx_views)
    tokens = TOKENS if tokens is None else tokens
    grouped = tokens > 0 and indexer_scan.scan_supported(
        fmt.name, q.shape[-1], typed["data"], typed.get("scale", typed["data"]),
        precision_id(None, DEFAULT_PRECISION.get(fmt.name, "ieee")))
    q = _scan_queries(q) if grouped else q.float().contiguous()
    rows = max(_MIN_ROWS, _SCORE_BYTES // (4 * n_max))
    for r0 in range(0, q.shape[0], rows):
        r1 = min(r0 + rows, q.shape[0])
        visible = ((positions[r0:r1].long() + 1) // ratio).to(torch.int32)
        if grouped:
            groups = token_groups(query_lens, r0, r1, tokens, q.device)
            scores = grouped_scores(q[r0:r1], weights[r0:r1], idx_views, fmt, table, visible, groups, n_max, epb,
                                    tokens=tokens)
        else:
            rows_table = table[token_request[r0:r1].long()].contiguous()
            scores = ops.paged_indexer_scores(q[r0:r1].contiguous(), weights[r0:r1].contiguous(), idx_views, fmt,
                                              rows_table, visible, n_max, epb)
        out[r0:r1] = ops.topk_smaller_index(scores, topk)
    return out

