"""`compress_flush`: a chunk's compressor state update and the cache write of the entries it
finishes, as one op (the reference's `compress_update` then `write_entries(finish=)`).

Where it can, the Triton twin runs HCA's prefill chunk as one Gluon kernel (`_hca_kernel`):
a program a window of the request (entry w: tokens 128 w .. 128 w + 127), its c, z and
position-bias rows copied by TMA into a ring of shared-memory stages ([BOX_R rows, 256
channels] a box, NS steps ahead), reduced with the online softmax in registers (each thread
owns two channels of a half and every row of a slice: no reduction across threads), then, for a
finished window, RMSNorm, RoPE at 128 w and the fp8_ds encode of the entry in the same program,
stored into its page; the open window's (M, S, A) goes back to the state instead.

Why: the two-kernel path (compressor, then the write with programmatic dependent launch) spent an
8K chunk ~13 µs against ~9.2 for a plain cold read of its 16.8 MB of c and z; the write's ~2.4
µs ran after the compressor's wave, and the compressor's 513 register-fed programs ~3 µs above
the read (benchmarks/NOTES.md, forty-seventh / forty-eighth rounds). Here the whole window's
bytes are in flight by TMA with no registers held for them, and the finish costs a program
~1 µs after its own last copy.

Elsewhere (CSA, several requests, other formats or dtypes, no Gluon / sm_90) the op is the two
kernels: `compress.compress_update`, `cache_ops.write_entries`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dsv4.cache.formats import EntryFormat
from dsv4.errors import InputError
from dsv4.kernels.compress_plan import CompressPlan
from dsv4.kernels.reference.norm_rope import EntryFinish
from dsv4.kernels.triton import cache_ops, compress
from dsv4.kernels.triton.decode_attention_wide import GLUON_OK, _barrier
from dsv4.kernels.triton.encode import _bf16_bits, _ceil_log2_ratio, _e4m3_bits, _finite_abs, _no_nan, _pow2

Views = dict[str, torch.Tensor]

#: rows of a TMA box (c, z and the bias alike; 256 channels, half an entry) and boxes in flight:
#: a program's whole share of its window (4 x 48 KB)
BOX_R = 32
STAGES = 4
_D = 512
#: warps a program: two row groups of four (each thread two channels of 16 rows of a slice)
_WARPS = 8


@gluon.constexpr_function
def _slice_layout():
    """[2 row groups, 16 rows, 256 channels]: a thread holds two neighbouring channels of 16 rows
    (the online softmax's reductions stay in its registers); a warp reads 128 contiguous bytes a row."""
    return gl.BlockedLayout([1, 16, 2], [1, 1, 32], [2, 1, _WARPS // 2], [2, 1, 0])


@gluon.constexpr_function
def _pair_layout():
    """[8 tiles, 32 pairs, 2]: tile t = channels 64 t .. 64 t + 63 (fp8_ds's scale tiles; tile 7 the
    rope), a thread one (even, odd) pair."""
    return gl.BlockedLayout([1, 1, 2], [1, 32, 1], [_WARPS, 1, 1], [2, 1, 0])


@gluon.jit
def _issue(c_desc, z_desc, b_desc, cs, zs, bs, ready, st, row, rb, h, R: gl.constexpr, BIAS: gl.constexpr):
    """Row block rb of channel half h of the window whose slot 0 is c / z row `row` into stage st."""
    nbytes: gl.constexpr = (3 if BIAS else 2) * R * 256 * 2
    mbarrier.expect(ready.index(st), nbytes)
    tma.async_copy_global_to_shared(z_desc, [row + rb * R, h * 256], ready.index(st), zs.index(st))
    if BIAS:
        tma.async_copy_global_to_shared(b_desc, [rb * R, h * 256], ready.index(st), bs.index(st))
    tma.async_copy_global_to_shared(c_desc, [row + rb * R, h * 256], ready.index(st), cs.index(st))


@gluon.jit
def _fold(m, s, a, cs, zs, bs, st, pos0, p0, p1, R: gl.constexpr, FULL: gl.constexpr, BIAS: gl.constexpr):
    """Stage st's rows (positions pos0 ..) into the row groups' running (m, s, a), 32 rows at a time."""
    L: gl.constexpr = _slice_layout()
    V: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
    g = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, L))), 1), 2)
    r16 = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L))), 0), 2)
    for r in gl.static_range(0, R, 32):
        z = zs.index(st).slice(r, 32)._reinterpret(gl.bfloat16, [2, 16, 256], V).load(L).to(gl.float32)
        if BIAS:
            z = z + bs.index(st).slice(r, 32)._reinterpret(gl.bfloat16, [2, 16, 256], V).load(L).to(gl.float32)
        c = cs.index(st).slice(r, 32)._reinterpret(gl.bfloat16, [2, 16, 256], V).load(L).to(gl.float32)
        if not FULL:        # rows of other requests or outside the chunk (TMA's zero fill): no weight
            pos = pos0 + r + 16 * g + r16
            ok = (pos >= p0) & (pos < p1)
            z = gl.where(ok, z, float("-inf"))
            c = gl.where(ok, c, 0.0)
        m2 = gl.maximum(m, gl.max(z, axis=1))
        ms = gl.where(m2 == float("-inf"), 0.0, m2)                     # no slot yet: keep exp finite
        keep = gl.where(m == float("-inf"), 0.0, gl.exp(m - ms))
        e = gl.exp(z - gl.expand_dims(ms, 1))
        s = s * keep + gl.sum(e, axis=1)
        a = a * keep + gl.sum(c * e, axis=1)
        m = m2
    return m, s, a


@gluon.jit
def _window(c_desc, z_desc, b_desc, cs, zs, bs, ready, row, h, wpos, p0, p1, rb_lo, rb_hi, NS: gl.constexpr,
            R: gl.constexpr, FULL: gl.constexpr, BIAS: gl.constexpr):
    """Row blocks rb_lo .. rb_hi - 1 of the window's half h, NS in flight -> the row groups' (m, s, a)
    [2, 256]."""
    L: gl.constexpr = _slice_layout()
    S: gl.constexpr = gl.SliceLayout(1, L)
    m = gl.full([2, 256], float("-inf"), gl.float32, S)
    s = gl.zeros([2, 256], gl.float32, S)
    a = gl.zeros([2, 256], gl.float32, S)
    n = rb_hi - rb_lo
    for k in gl.static_range(NS):
        if k < n:
            _issue(c_desc, z_desc, b_desc, cs, zs, bs, ready, k, row, rb_lo + k, h, R, BIAS)
    for rb in range(rb_lo, rb_hi):
        i = rb - rb_lo
        st = i % NS
        mbarrier.wait(ready.index(st), (i // NS) & 1)
        m, s, a = _fold(m, s, a, cs, zs, bs, st, wpos + rb * R, p0, p1, R, FULL, BIAS)
        _barrier()                  # every warp has read stage st ...
        if i + NS < n:              # ... so it refills, NS row blocks ahead
            _issue(c_desc, z_desc, b_desc, cs, zs, bs, ready, st, row, rb + NS, h, R, BIAS)
    return m, s, a


@gluon.jit
def _merge(m, s, a, m2, s2, a2):
    """Two online-softmax partials -> one (an empty one, m = -inf, weighs nothing)."""
    mm = gl.maximum(m, m2)
    ms = gl.where(mm == float("-inf"), 0.0, mm)
    k1 = gl.where(m == float("-inf"), 0.0, gl.exp(m - ms))
    k2 = gl.where(m2 == float("-inf"), 0.0, gl.exp(m2 - ms))
    return mm, s * k1 + s2 * k2, a * k1 + a2 * k2


@gluon.jit
def _finish_store(x_s, w_ptr, inv_ptr, eps, wpos, kv_row, sc_row):
    """The entry in x_s ([512] fp32, a / s) -> RoPE_{wpos}(RMSNorm_weight(x)) -> fp8_ds bytes: 448
    e4m3 in 7 tiles of 64 with a UE8M0 scale each, then the 64 rope channels as bf16, the scale
    row's 8th byte zero (`_finish_math` and `_encode_fp8_ds`'s arithmetic)."""
    P: gl.constexpr = _pair_layout()
    L2: gl.constexpr = gl.SliceLayout(2, P)
    t = gl.arange(0, 8, layout=gl.SliceLayout(1, L2))
    p = gl.arange(0, 32, layout=gl.SliceLayout(0, L2))
    off2 = gl.expand_dims(t, 1) * 64 + 2 * gl.expand_dims(p, 0)             # [8, 32]: the even channel
    ang = wpos.to(gl.float64) * gl.load(inv_ptr + p)                         # float64 angles, libdevice
    cos = gl.expand_dims(gl.cos(ang).to(gl.float32), 0)
    sin = gl.expand_dims(gl.sin(ang).to(gl.float32), 0)
    x = x_s._reinterpret(gl.float32, [8, 32, 2], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])).load(P)
    even, odd = gl.split(x)
    inv = 1.0 / gl.sqrt(gl.sum(gl.sum(even * even + odd * odd, axis=1), axis=0) / 512 + eps)
    even = even * inv * gl.load(w_ptr + off2).to(gl.float32)
    odd = odd * inv * gl.load(w_ptr + off2 + 1).to(gl.float32)
    rope = gl.expand_dims(t == 7, 1)
    re = gl.where(rope, even * cos - odd * sin, even)
    ro = gl.where(rope, odd * cos + even * sin, odd)
    # fp8_ds: a tile's scale 2^e from its finite amax (at least 1e-4), e4m3 codes of x 2^-e
    amax = gl.maximum(gl.max(gl.maximum(_finite_abs(re), _finite_abs(ro)), axis=1), 1e-4)
    e = _ceil_log2_ratio(amax, 9, 0x600000)                                  # 448 = 0.875 * 2^9
    f = gl.expand_dims(_pow2(-e), 1)
    qe = _e4m3_bits(_no_nan(re) * f)
    qo = _e4m3_bits(_no_nan(ro) * f)
    nope = gl.expand_dims(t < 7, 1) & (off2 >= 0)
    gl.store((kv_row + off2).to(gl.pointer_type(gl.uint16), bitcast=True),
             (qe | (qo << 8)).to(gl.uint16), mask=nope)                       # two e4m3 bytes a pair
    bits = _bf16_bits(re) | (_bf16_bits(ro) << 16)
    gl.store((kv_row + 2 * off2 - 448).to(gl.pointer_type(gl.int32), bitcast=True), bits,
             mask=rope & (off2 >= 0))                                         # two bf16 (4 bytes) a pair
    gl.store(sc_row + t, gl.where(t < 7, e + 127, 0).to(gl.uint8))


_FENCE = gl.constexpr("fence.acq_rel.gpu; // $0")


@gluon.jit
def _hca_kernel(c_desc, z_desc, b_desc, st_ptr, st_s0, st_s1, kv_ptr, kv_s0, kv_s1, sc_ptr, sc_s0, sc_s1,
                bt_ptr, bt_s1, bt_cols, epb, w_ptr, inv_ptr, eps, rslot_ptr, x_ptr, cnt_ptr, first, end, p0, p1,
                RATIO: gl.constexpr, R: gl.constexpr, NS: gl.constexpr, BIAS: gl.constexpr):
    """Program (s, h): channel half h of window w = first + s of a one-request chunk (tokens p0 ..
    p1 - 1 at c / z rows 0 ..). s = 0 starts from the stored state; w = end (the open window, maybe
    empty) stores its state; w < end hands its half of the entry (a / s) to x_ptr's row s, and the
    second of the two programs to arrive (cnt_ptr[s], which it resets) finishes the entry into
    the cache."""
    L: gl.constexpr = _slice_layout()
    V1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L))
    sid = gl.program_id(0)
    h = gl.program_id(1)
    w = first + sid
    wpos = w * RATIO
    cs = gl.allocate_shared_memory(gl.bfloat16, [NS, R, 256], c_desc.layout)
    zs = gl.allocate_shared_memory(gl.bfloat16, [NS, R, 256], z_desc.layout)
    bs = gl.allocate_shared_memory(gl.bfloat16, [NS if BIAS else 1, R, 256], b_desc.layout)
    x_s = gl.allocate_shared_memory(gl.float32, [512], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    lo = gl.maximum(p0, wpos)
    hi = gl.minimum(p1, wpos + RATIO)
    rb_lo = (lo - wpos) // R
    rb_hi = gl.where(hi > lo, (hi - wpos + R - 1) // R, rb_lo)
    row = wpos - p0
    if (lo == wpos) & (hi == wpos + RATIO):
        m, s, a = _window(c_desc, z_desc, b_desc, cs, zs, bs, ready, row, h, wpos, p0, p1, rb_lo, rb_hi, NS, R,
                          True, BIAS)
    else:
        m, s, a = _window(c_desc, z_desc, b_desc, cs, zs, bs, ready, row, h, wpos, p0, p1, rb_lo, rb_hi, NS, R,
                          False, BIAS)
    g = gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(1, L))), 1)
    m0 = gl.max(gl.where(g == 0, m, float("-inf")), axis=0)                  # the two row groups apart
    m1 = gl.max(gl.where(g == 1, m, float("-inf")), axis=0)
    s0 = gl.sum(gl.where(g == 0, s, 0.0), axis=0)
    s1 = gl.sum(gl.where(g == 1, s, 0.0), axis=0)
    a0 = gl.sum(gl.where(g == 0, a, 0.0), axis=0)
    a1 = gl.sum(gl.where(g == 1, a, 0.0), axis=0)
    m, s, a = _merge(m0, s0, a0, m1, s1, a1)
    ch = h * 256 + gl.arange(0, 256, layout=V1)
    st_row = st_ptr + gl.load(rslot_ptr).to(gl.int64) * st_s0 + ch
    if sid == 0:                # the request's open entry (the empty state where a window begins here)
        m, s, a = _merge(gl.load(st_row), gl.load(st_row + st_s1), gl.load(st_row + 2 * st_s1), m, s, a)
    if w < end:
        x_row = x_ptr + sid.to(gl.int64) * 512
        x = a / s
        gl.store(x_row + ch, x)
        gl.inline_asm_elementwise(_FENCE, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        _barrier()              # every thread's half stored and fenced before the count
        if gl.atomic_add(cnt_ptr + sid, 1, sem="acq_rel", scope="gpu") == 1:
            gl.inline_asm_elementwise(_FENCE, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            other = (1 - h) * 256 + gl.arange(0, 256, layout=V1)
            y = gl.load(x_row + other, cache_modifier=".cg")
            x_s.slice(0, 256).store(gl.where(h == 0, x, y))
            x_s.slice(256, 256).store(gl.where(h == 0, y, x))
            gl.store(cnt_ptr + sid, 0)
            _barrier()
            col = w // epb
            blk = gl.load(bt_ptr + gl.minimum(col, bt_cols - 1) * bt_s1)
            ok = (col < bt_cols) & (blk >= 0)
            page = gl.where(ok, blk, 0).to(gl.int64)
            prow = gl.where(ok, w % epb, 0).to(gl.int64)
            _finish_store(x_s, w_ptr, inv_ptr, eps, wpos, kv_ptr + page * kv_s0 + prow * kv_s1,
                          sc_ptr + page * sc_s0 + prow * sc_s1)
    else:
        gl.store(st_row, m)
        gl.store(st_row + st_s1, s)
        gl.store(st_row + 2 * st_s1, a)


#: per device: the windows' arrival counts (zero between calls: each window's second program resets
#: its own), grown as longer chunks come; calls on one device are ordered by its stream
_COUNTS: dict[torch.device, torch.Tensor] = {}


def _counts(device: torch.device, n: int) -> torch.Tensor:
    cnt = _COUNTS.get(device)
    if cnt is None or cnt.numel() < n:
        cnt = _COUNTS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return cnt


def _tma_ok(x: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == _D and x.stride(1) == 1
            and x.data_ptr() % 16 == 0 and x.stride(0) * 2 % 16 == 0)


def fused_supported(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, query_lens: tuple[int, ...], ratio: int,
                    overlap: bool, views: Views, fmt: EntryFormat, z_bias: torch.Tensor | None,
                    finish: EntryFinish | None) -> bool:
    """Whether `_hca_kernel` takes the call: HCA (no overlap, windows of whole boxes) of 512 channels,
    one request, bf16 c / z / bias that TMA can read, fp8_ds entries of 448 + 64 with their finish,
    an sm_90 GPU with Gluon."""
    if not (GLUON_OK and c.is_cuda and not overlap and ratio % BOX_R == 0 and len(query_lens) == 1
            and fmt.name == "fp8_ds" and fmt.dim == _D and fmt.rope_dim == 64 and finish is not None
            and finish.inv_freq.shape[0] == 32 and finish.ratio == ratio
            and torch.cuda.get_device_capability(c.device)[0] == 9):
        return False
    if z_bias is not None and not (z_bias.dtype == torch.bfloat16 and z_bias.is_contiguous()
                                   and tuple(z_bias.shape) == (ratio, _D) and z_bias.data_ptr() % 16 == 0):
        return False
    return (_tma_ok(c) and _tma_ok(z) and state.dtype == torch.float32 and state.is_contiguous()
            and state.shape[-1] == _D)


def compress_flush(c: torch.Tensor, z: torch.Tensor, state: torch.Tensor, request_slots: torch.Tensor,
                   start_positions: tuple[int, ...], query_lens: tuple[int, ...], ratio: int, overlap: bool,
                   views: Views, fmt: EntryFormat, block_table: torch.Tensor, epb: int, *,
                   z_bias: torch.Tensor | None = None, plan: CompressPlan | None = None,
                   finish: EntryFinish | None = None, fused: bool | None = None) -> None:
    """Same contract as `dsv4.kernels.reference.compress.compress_flush`. fused: None picks the one
    kernel where `fused_supported`, True requires it (an error where it cannot run), False runs
    the two kernels (testing)."""
    ok = fused_supported(c, z, state, query_lens, ratio, overlap, views, fmt, z_bias, finish)
    if fused and not ok:
        raise InputError("compress_flush(fused=True): the one-kernel HCA path does not take this call "
                         "(see fused_supported)")
    if fused is False or not ok:
        entries, req, idx = compress.compress_update(c, z, state, request_slots, start_positions, query_lens, ratio,
                                                     overlap, z_bias=z_bias, plan=plan)
        cache_ops.write_entries(views, fmt, entries, req, idx, block_table, epb, finish)
        return
    if query_lens[0] == 0:
        return
    p0, p1 = start_positions[0], start_positions[0] + query_lens[0]
    first, end = p0 // ratio, p1 // ratio
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    cd = TensorDescriptor.from_tensor(c, [BOX_R, 256], layout)
    zd = TensorDescriptor.from_tensor(z, [BOX_R, 256], layout)
    bd = TensorDescriptor.from_tensor(z_bias, [BOX_R, 256], layout) if z_bias is not None else zd
    kv, sc = views["kv"], views["scale"]
    nwin = end - first + 1
    xbuf = torch.empty(nwin, _D, dtype=torch.float32, device=c.device)
    _hca_kernel[(nwin, 2)](
        cd, zd, bd, state, state.stride(0), state.stride(1), kv, kv.stride(0), kv.stride(1), sc, sc.stride(0),
        sc.stride(1), block_table, block_table.stride(1), block_table.shape[1], epb, finish.weight, finish.inv_freq,
        finish.eps, request_slots, xbuf, _counts(c.device, nwin), first, end, p0, p1, RATIO=ratio, R=BOX_R,
        NS=STAGES, BIAS=z_bias is not None, num_warps=_WARPS)
