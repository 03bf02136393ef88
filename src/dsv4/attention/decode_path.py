"""The decode step of one layer (one new token per request): fixed shapes, no host reads.

Used for every all-decode batch. With the Triton ops it is what CUDA graphs capture; with the
reference ops it is the readable twin (tests compare it with the general prefill path).

On CUDA the step runs on three streams (a CUDA graph captures them as parallel branches):

    inputs x's projections, one GEMM per weight format; with FP8 q_a / kv and dense compressor
           weights (an FP8 checkpoint) the dense GEMM heads the side branch instead, from
           SPLIT_INPUT_GEMMS rows (below them, at one row, both GEMVs run in one launch:
           `linear_pair`)
    main   q_a norm (CSA at one row: inside the GEMV) -> q_b GEMM (+ the indexer's, one GEMM) ->
           [cos/sin ready] CSA indexer queries -> [indexer keys written] CSA indexer scores +
           top-k; HCA: q norm/RoPE (FP8 layers from Q_AFTER_JOIN_ROWS rows: after the join; at
           one row inside the attention, Q_NORM_IN_ATTENTION).
           CSA at SPLIT_QUERY_UP rows: the indexer's q GEMM alone, then its queries and scan.
    up     (CSA at those rows) forked after the indexer's q GEMM: the q_b GEMM -> q norm/RoPE
    table  cos/sin of the positions; HCA (WINDOW_ON_TABLE): then kv norm/RoPE -> window append
    side   CSA indexer compressor -> key write -> main compressor -> entry write (entry
           norm/RoPE inside the writes); CSA: -> [cos/sin ready] kv norm/RoPE -> window append,
           then, once the GEMM is done, q norm/RoPE (at SPLIT_QUERY_UP rows on `up` instead, up
           to Q_ON_TABLE_ROWS rows on `table`)
    join   -> attention (its split combine also applies the inverse RoPE and writes the output
           projection's dtype)
    prefetch  (HCA, one row) after the q_b GEMM: the output projection's weights asked into the
           L2 (`prefetch.l2_prefetch`, up to PREFETCH_L2_SHARE of it) while the latency-bound
           queries' norm and attention leave DRAM idle; joined after the attention. H100, B = 1,
           BF16 / FP8 weights: 128K 104.5 / 71.8 -> 100.7 / 68.9 µs, 8K 103.4 / 70.1 -> 100.8 / 67.6.
           CSA layers gained 1 µs or lost up to 2.5 (FP8 128K; 1M: +2 / +4.5, the scan sharing DRAM)

The branches are chains of small latency-bound kernels that would otherwise wait behind the GEMM.
What the GEMM starves waits until its first wave of programs ends, so each branch puts first what
the main stream needs first, and the two things it needs right after the GEMM head a branch each:
the rotary table (the queries) and the indexer keys (the scan). The main entries, the window and
q are read only by the attention, after the scan and top-k. H200, 128K, CUDA graphs: CSA layer
B = 1 128.3 -> 117.7 µs, HCA 92.9 -> 88.9 (with programmatic dependent launch along the scan /
top-k / attention chain; benchmarks/NOTES.md #80-#83). Every tensor a branch reads stays
referenced until the join.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.cache.handle import LayerCacheHandle
from dsv4.kernels.reference.cache_ops import EntryWrite
from dsv4.kernels.streams import on, side_stream
from dsv4.model.layer_schedule import AttentionType

if TYPE_CHECKING:
    import types

    from dsv4.cache.formats import EntryFormat


def _recorded(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event recorded on `stream` now (None off CUDA)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def query_dtype(ops: types.SimpleNamespace, fmt: EntryFormat) -> torch.dtype:
    """The dtype a decode step hands the attention its queries in. Triton's dots take q as bf16 for
    bf16-exact formats: norm_rope rounds it once, so no conversion kernel runs before the attention
    (the same rounding the kernels would do); the reference and the fp32 format keep fp32."""
    return torch.bfloat16 if ops.name == "triton" and fmt.name != "fp32" else torch.float32


def decode_attend(blk, x: torch.Tensor, cache: LayerCacheHandle, ops: types.SimpleNamespace) -> torch.Tensor:
    """Input projections, cache writes and attention for an all-decode batch.

    Args:
        blk: the AttentionSubBlock; x: [B, d] its input.
    Returns:
        [B, H, D] attention output after the inverse RoPE (applied by the attention op), in x's dtype.
    """
    out_dtype = x.dtype
    b, st, sch = cache.batch, cache.state, cache.schema
    fmt = sch.kv_format
    dev = b.positions.device
    pool = cache.paged
    comp = blk.compressor
    csa = sch.attn_type is AttentionType.CSA
    main = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    urgent = sch.attn_type in URGENT_BRANCHES
    side, table = side_stream(dev, urgent=urgent), side_stream(dev, 1, urgent=urgent)
    # FP8 q_a / kv beside dense compressor weights: the compressors' GEMM heads the side branch, so the
    # queries' chain goes on right after the FP8 one (the side branch waits for it before reading kv)
    split = side is not None and comp is not None and b.num_requests >= SPLIT_INPUT_GEMMS.get(sch.attn_type, 1 << 30) \
        and blk.dense_inputs() == frozenset(_COMPRESSOR_INPUTS) & frozenset(blk.project_names())
    if not split:
        proj = blk.project(x, ops)
    if side is not None:        # the branches fork after x (and, unsplit, every projection of it)
        side.wait_stream(main)
        table.wait_stream(main)
    inputs_ready = None
    if split:
        proj = blk.project(x, ops, dense_on=side)
        inputs_ready = _recorded(main)
    with on(table):     # a branch of its own: launched before the GEMM, as is the head of the side branch
        cos, sin = ops.rope_cos_sin(blk.rope.inv_freq_on(dev), b.positions)
    table_ready = _recorded(table)
    keys_ready = None
    with on(side):
        # Launched before the q_b GEMM fills the GPU: the CSA indexer's keys first (its compressor
        # and key write read only x's projections; the scan waits for them right after the GEMM).
        # Branch tensors read by the main stream (cos, sin, q) are freed into their stream's pool,
        # whose next user (the next layer's branch) first waits for the main stream.
        if comp is not None:
            assert pool is not None, "compressed layers have a paged pool"
            epb = sch.entries_per_block
            # each compressor writes the entries it finishes (one kernel on Triton), applying kv_norm
            # and RoPE at w*m itself
            if csa:
                idx = comp.indexer
                idx.compress_decode(proj["ic"], proj["iz"], b, st.idx_state, ops, EntryWrite(
                    pool.indexer, sch.indexer_format, b.block_table, epb, idx.finisher(blk.rope, dev)))
                keys_ready = _recorded(side)
            comp.compress_decode(proj["c"], proj["z"], b, st.comp_state, ops,
                                 EntryWrite(pool.kv, fmt, b.block_table, epb, comp.finisher(blk.rope, dev)))
        if sch.attn_type not in WINDOW_ON_TABLE:
            if table_ready is not None:
                side.wait_event(table_ready)
            _append_window(blk, proj, cos, sin, cache, ops, side, inputs_ready)
    if sch.attn_type in WINDOW_ON_TABLE:   # beside the compressors' chain, right after cos/sin
        with on(table):
            _append_window(blk, proj, cos, sin, cache, ops, table, inputs_ready)
    q_dtype = query_dtype(ops, fmt)
    rows = b.num_requests
    up_branch = side_stream(dev, 2) if csa and SPLIT_QUERY_UP[0] <= rows <= SPLIT_QUERY_UP[1] else None
    if up_branch is not None:
        # the indexer's queries first, alone: the scan and top-k start while the attention's q_b GEMM
        # runs on a branch of its own (joined before the attention)
        in_gemm = rows == 1 and sch.attn_type in QA_NORM_IN_GEMM
        src, norm = (proj["q_a"], blk.qa_norm()) if in_gemm else (blk.q_residual(proj, ops), None)
        q_up = {"iq": blk.query_up_part("iq", src, ops, norm)}
        up_branch.wait_stream(main)         # after the indexer's GEMM: it streams its weights alone
        with on(up_branch):
            q_raw = blk.query_up_part("q", src, ops, norm)
            if table_ready is not None:
                up_branch.wait_event(table_ready)
            q = blk.queries({"q": q_raw}, cos, sin, ops, out_dtype=q_dtype)
    elif sch.attn_type in QA_NORM_IN_GEMM:
        q_up = blk.query_up_normed(proj, ops)
    else:
        q_up = blk.query_up(blk.q_residual(proj, ops), ops)
    # HCA: the output projection's weights into the L2 while the queries' norm and the attention run
    prefetching = sch.attn_type is AttentionType.HCA and \
        prefetch_weights(blk.output_weights(), b.num_requests, ops, PREFETCH_L2_SHARE)
    if csa and up_branch is None:
        # the scan's queries on this stream; the attention's beside the scan: on the table branch
        # (idle once cos/sin are done) up to Q_ON_TABLE_ROWS rows, else on the side branch, after its
        # compressors and window append
        up_ready = _recorded(main)
        q_stream = table if rows <= Q_ON_TABLE_ROWS else side
        with on(q_stream):
            if up_ready is not None:
                q_stream.wait_event(up_ready)
            q = blk.queries(q_up, cos, sin, ops, out_dtype=q_dtype)
    if table_ready is not None:
        main.wait_event(table_ready)
    q_after_join = b.num_requests >= Q_AFTER_JOIN_ROWS and "q_a" not in blk.dense_inputs()   # FP8 weights
    # the attention normalises and rotates q itself: no norm kernel between the q_b GEMM and it
    q_in_attention = (sch.attn_type in Q_NORM_IN_ATTENTION and rows <= Q_NORM_IN_ATTENTION_ROWS
                      and b.seq_len_bound // max(sch.compress_ratio, 1) < Q_NORM_IN_ATTENTION_MAX_ENTRIES)
    if csa:
        qi = comp.indexer.queries(q_up["iq"], cos, sin, sch.indexer_format, ops)
    elif q_in_attention:
        q = blk.query_heads(q_up)
    elif not q_after_join:
        q = blk.queries(q_up, cos, sin, ops, out_dtype=q_dtype)
    indices = num_entries = None
    max_entries = 0
    if comp is not None:
        max_entries = b.seq_len_bound // sch.compress_ratio
        num_entries = b.visible_entries[sch.compress_ratio]       # filled by prepare_forward: no kernel
    if keys_ready is not None:
        main.wait_event(keys_ready)
    if comp is not None:
        if csa:
            # the raw weights_proj columns and their scale: g is formed in the scorer (no conversion kernels)
            indices = ops.decode_indexer_topk(qi, proj["iw"], pool.indexer, sch.indexer_format, b.block_table,
                                              num_entries, max_entries, sch.entries_per_block, comp.indexer.topk,
                                              comp.indexer.weight_scale)
            num_entries = None
    if side is not None:
        main.wait_stream(side)
        main.wait_stream(table)
    if up_branch is not None:
        main.wait_stream(up_branch)
    if not csa and q_after_join and not q_in_attention:
        q = blk.queries(q_up, cos, sin, ops, out_dtype=q_dtype)
    o = ops.decode_attention(q, st.swa, fmt, st.swa_pos, b.request_slots, b.positions, blk.cfg.sliding_window,
                             pool.kv if pool is not None else None, b.block_table, sch.entries_per_block,
                             indices, num_entries, max_entries, blk.sinks, blk.cfg.head_dim ** -0.5,
                             rope=(cos, sin), out_dtype=out_dtype,
                             q_norm=blk.cfg.rms_norm_eps if q_in_attention else None)
    if prefetching:
        main.wait_stream(side_stream(dev, 2))   # the prefetch branch: its kernel only asks for bytes
    return o


def _append_window(blk, proj: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, cache: LayerCacheHandle,
                   ops: types.SimpleNamespace, stream: torch.cuda.Stream | None,
                   inputs_ready: torch.cuda.Event | None) -> None:
    """The window's kv (norm, RoPE) into the ring, on `stream` (the current one), once the GEMM that
    gives kv is done (`inputs_ready`, where the input GEMMs were split)."""
    if inputs_ready is not None and stream is not None:
        stream.wait_event(inputs_ready)
    b, st = cache.batch, cache.state
    kv = blk.window_kv(proj, cos, sin, ops)
    ops.append_window(st.swa, cache.schema.kv_format, st.swa_pos, st.swa_head, kv, b.positions, b.token_request,
                      b.request_slots, b.seq_lens)


#: layer types whose window (kv norm/RoPE, append) runs on the table branch right after cos/sin, beside
#: the compressors' chain on the side branch, instead of after it. H200, 128K, µs, two rounds (table
#: branch against after the compressors): HCA FP8 B = 64 123.7-123.9 -> 120.9-121.2, B = 16 84.7-84.8 ->
#: 84.2-84.4, B = 1 63.0 -> 62.6-62.8, BF16 within -0.5; CSA BF16 B = 1 111.3 -> 112.5-112.8 (B = 16 / 64
#: -0.8 to -1.0, FP8 +0.4 to 0), so CSA keeps its window after the compressors (benchmarks/NOTES.md #163)
WINDOW_ON_TABLE = (AttentionType.HCA,)
#: from this many rows, HCA / SWA steps of a layer with FP8 input weights normalise and rotate q after
#: the branches' join, right before the attention (which then follows its queries' kernel on one
#: stream, presumably keeping the programmatic dependent launch a join in between breaks). 128K, two
#: rounds, before -> after the join, µs: H200 HCA FP8 B = 16 84.6 / 84.5 -> 82.8 / 83.2, B = 64 122.5 /
#: 121.0 -> 120.7 / 120.3 (BF16 even); H100 FP8 B = 2 87.9 / 87.8 -> 86.0 / 86.4, B = 4 87.5 / 87.4 ->
#: 85.4 / 85.9, B = 8 92.2 / 91.9 -> 90.7 / 90.7, but BF16 B = 2-8 +0.8 to +1.7, and at one row both
#: lose (H200 BF16 82.4 / 82.5 -> 84.3 / 84.0): there the norm is off the critical path before the join
Q_AFTER_JOIN_ROWS = 2

#: the input projections the compressors read (the side branch): where exactly these are held dense and
#: the rest (q_a, kv) as FP8 blocks (an FP8 checkpoint), their GEMM runs on the side branch (`decode_attend`)
_COMPRESSOR_INPUTS = ("c", "z", "ic", "iz", "iw")
#: the decode rows from which a layer type's step does. H100, 128K, FP8 weights, µs, two rounds
#: (benchmarks/NOTES.md, thirty-eighth round): CSA B = 1 96.4-97.4 -> 94.9-95.3, B = 16 153.1-153.2 ->
#: 145.1, B = 64 240.4-241.0 -> 239.6-242.0; HCA B = 16 98.9-99.1 -> 94.2-94.6, B = 64 135.4-135.6 ->
#: 130.8-130.9, but B = 1 69.4-69.6 -> 75.3 (the GEMM at the head of the side branch delays what the
#: attention joins). Splitting BF16 weights into two such GEMMs was slower at every row (HCA B = 64
#: 153 -> 161), so the split follows the weight formats
SPLIT_INPUT_GEMMS = {AttentionType.CSA: 1, AttentionType.HCA: 2}

#: CSA decode rows (first, last) whose step runs the indexer's q up-projection alone first, then the
#: attention's on a branch of its own (`side_stream(dev, 2)`) beside the indexer's queries, scan and
#: top-k, joined before the attention. H100, 128K, BF16 / FP8 weights, µs, two rounds (forty-fifth
#: round): B = 4 149.5-150.0 / 116.1-117.1 -> 146.6-148.6 / 112.1-112.5, B = 16 172.3-172.9 /
#: 136.7-137.0 -> 170.7-171.2 / 133.2-133.7; but B = 1 130.4-130.9 / 93.9 -> 132.4-132.5 / 96.8-97.3
#: and B = 64 252.3-253.3 / 225.9-226.9 -> 254.0-255.3 / 224.5-227.2 (the GEMMs starve the side
#: branch's indexer compressor and key write, which the scan waits for; forking the branch beside
#: the indexer's GEMM, or after the keys, measured no better)
SPLIT_QUERY_UP = (2, 32)

#: CSA decode rows up to which the attention's q norm/RoPE runs on the table branch (idle after cos/sin)
#: instead of the side branch, where it queued behind the compressors and the window append and was
#: the last kernel before the join (one row: side branch ends 67.5 µs, the top-k 65.0). H100, 128K,
#: BF16 / FP8 weights, µs, trees alternated (benchmarks/NOTES.md #220): B = 1 123.1 / 87.1, 122.9 / 86.7
#: -> 122.1 / 87.0, 122.3 / 87.0; at B = 64 it competes with the scan for SMs: BF16 249.0-249.7 ->
#: 254.2-254.3 (FP8 even), so more rows keep the side branch
Q_ON_TABLE_ROWS = 1

#: layer types whose q up-projection applies the q_a norm itself (`query_up_normed`: inside a one-row
#: GEMV, so no norm kernel runs between the input projections and it; more rows run the norm kernel
#: first as before). H100, 128K B = 1, BF16 / FP8 weights, µs (`benchmarks/qa_norm_sweep.sh`): CSA
#: 137.2-137.7 / 103.2-103.7 -> 134.5-134.7 / 97.8-98.1. HCA alone 103.3-103.5 / 69.3-69.5 -> 104.0-104.1 /
#: 72.5: the FP8 GEMV's programs, launched early by programmatic dependent launch, took the SMs the
#: side branch (rotary table, compressor, entry write, window) needs before the attention; with
#: that branch urgent (`URGENT_BRANCHES`) it pays (NOTES.md #197).
QA_NORM_IN_GEMM = (AttentionType.CSA, AttentionType.HCA)

#: layer types whose decode attention normalises and rotates q itself (`decode_attention(q_norm=)`: the
#: fused kernel where it loads q, so no norm kernel sits between the q_b GEMM and the attention), up to
#: Q_NORM_IN_ATTENTION_ROWS rows and below Q_NORM_IN_ATTENTION_MAX_ENTRIES entries a request (from
#: there, `decode_attention.LONG_KEYS`, another scheme runs, and the op's norm kernel would run after
#: the branches' join instead of beside them). H100, HCA B = 1, BF16 / FP8 weights, µs, two rounds
#: (benchmarks/NOTES.md #200): 128K 99.2 / 64.8, 99.6 / 64.9 -> 98.2 / 64.3, 98.2 / 64.7; 8K 97.9 /
#: 62.3, 97.8 / 62.3 -> 96.4 / 61.9, 96.6 / 61.8; 1M (the wide scheme: the norm after the join) 111.6 /
#: 77.2 -> 111.8 / 78.5. Two and three rows gain nothing (128K within 0.7) or lose (8K B = 2 BF16
#: 110.8-110.9 -> 113.3-113.5)
Q_NORM_IN_ATTENTION = (AttentionType.HCA,)
Q_NORM_IN_ATTENTION_ROWS = 1
Q_NORM_IN_ATTENTION_MAX_ENTRIES = 4096

#: layer types whose decode side branches (compressor chain and window; rotary table) run on urgent
#: streams (`side_stream(urgent=True)`): their few small blocks go ahead of the q_b GEMV's. H100, 128K
#: B = 1, BF16 / FP8 weights, µs, two rounds, with the q_a norm in the GEMV (NOTES.md #197): HCA
#: 101.9-102.1 / 68.0-68.1 -> 99.3-99.6 / 64.4. CSA keeps plain streams (its scan, not the side
#: branch, bounds the step; urgent: BF16 125.6-125.7 -> 126.2-126.4), as does prefill, where the
#: main compressor yielding its SMs to the indexer chain cost CSA chunks (NOTES.md #58).
URGENT_BRANCHES = (AttentionType.HCA,)

#: decode rows up to which an HCA layer's output projection weights are prefetched into the L2 while
#: the queries' norm and the attention run (measured at one row: at four, with a 0.75 share, every
#: row was slower)
PREFETCH_MAX_ROWS = 1
#: the share of the L2 the prefetched output weights may take. H100 (50 MB L2), 128K B = 1, µs against no
#: prefetch (72.2 FP8 / 105.9 BF16 HCA, 102.4-103.9 / 137.4 CSA): 0.2 69.9 / 103.9, 0.4 69.6 / 103.0,
#: 0.45 70.1 / 103.1; from 0.5 erratic (0.55: HCA FP8 79.9; 0.75: every row 1-8 µs slower): the
#: prefetch then evicts its own first lines before the GEMV reads them (benchmarks/NOTES.md #149)
PREFETCH_L2_SHARE = 0.4


def prefetch_weights(tensors: list[torch.Tensor], rows: int, ops: types.SimpleNamespace, share: float) -> bool:
    """Launch `prefetch.l2_prefetch` of `tensors` (up to `share` of the L2) on the prefetch branch
    (`side_stream(dev, 2)`), forked from the current stream now; returns whether it did (the caller
    joins the branch). Nothing where it does not apply (not Triton, not CUDA sm_90+, more than
    PREFETCH_MAX_ROWS rows)."""
    if ops.name != "triton" or rows > PREFETCH_MAX_ROWS or not tensors or not tensors[0].is_cuda:
        return False
    from dsv4.kernels.triton import prefetch
    dev = tensors[0].device
    if not prefetch.supported(dev):
        return False
    branch = side_stream(dev, 2)
    branch.wait_stream(torch.cuda.current_stream(dev))
    with on(branch):
        prefetch.l2_prefetch(tensors, int(share * torch.cuda.get_device_properties(dev).L2_cache_size))
    return True
