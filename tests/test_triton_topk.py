"""Triton exact top-k (`dsv4.kernels.triton.topk.topk_smaller_index`) against the reference.

The result must be identical, element for element: the k largest scores per row in descending
order, ties to the smaller index, -1 where the picked score is -inf or past N (k > N). Rows carry
many exact ties (integer-valued scores, repeated patterns like the benchmark's tiled pages),
-inf tails (entries past a request's end), signed zeros and NaN. CPU: the Triton interpreter on
small rows (the one-block path and, with a small `block`, the multi-block path); GPU: V4 sizes.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.errors import InputError
from dsv4.kernels.reference.decode import topk_smaller_index as ref_topk
from dsv4.kernels.triton.topk import topk_smaller_index as tri_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(b: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """b rows of n scores: random, integer ties, a -inf tail, all -inf, repeated pattern, mixed signs."""
    s = torch.randn(b, n, generator=gen)
    kinds = [lambda r: r,
             lambda r: torch.randint(0, 5, r.shape, generator=gen).float(),
             lambda r: torch.where(torch.arange(n) < n // 3, r, torch.tensor(float("-inf"))),
             lambda r: torch.full_like(r, float("-inf")),
             lambda r: r[: max(1, n // 7)].repeat(n // max(1, n // 7) + 1)[:n],
             lambda r: torch.randint(-2, 3, r.shape, generator=gen).float() * 0.0]   # +0.0 and -0.0
    for i in range(b):
        s[i] = kinds[i % len(kinds)](s[i])
    return s


def _check(scores: torch.Tensor, k: int, **kw) -> None:
    got, want = tri_topk(scores, k, **kw), ref_topk(scores, k, order=kw.get("order", "score"))
    assert got.dtype == torch.int64 and got.shape == want.shape
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"first differences at {bad[:4].tolist()}: got {got[tuple(bad[:4].T)].tolist()}, " \
                             f"want {want[tuple(bad[:4].T)].tolist()}"


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (40, 6), (40, 40), (40, 64), (300, 16), (600, 64)])
def test_topk_matches_reference(n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    _check(_rows(6, n, gen).to(DEVICE), k)
    _check(_rows(6, n, gen).to(DEVICE), k, order="index")


def test_topk_index_order_reference():
    """order "index" is order "score"'s picks above -inf (not -inf, not a NaN with its sign bit set),
    ascending, then -1: checked against a plain reading of that, on rows with -inf and negative NaN
    picks, ties and fewer scores than k."""
    gen = torch.Generator().manual_seed(2)
    s = _rows(6, 50, gen)
    s[0, 3:9] = _neg_nan(6)
    s[0, 20:] = float("-inf")
    for k in (8, 30, 64):
        by_score, by_index = ref_topk(s, k), ref_topk(s, k, order="index")
        for r in range(s.shape[0]):
            picks = [i for i in by_score[r].tolist() if i >= 0 and not torch.isnan(s[r, i])]
            assert by_index[r].tolist() == sorted(picks) + [-1] * (k - len(picks))
    with pytest.raises(InputError):
        ref_topk(s, 4, order="value")
    with pytest.raises(InputError):
        tri_topk(s.to(DEVICE), 4, order="value")


@pytest.mark.parametrize("n,k", [(300, 16), (130, 64)])
def test_topk_multi_block(n, k):
    """Rows longer than one block: the select passes re-read the row block by block."""
    gen = torch.Generator().manual_seed(n + k)
    _check(_rows(6, n, gen).to(DEVICE), k, block=64)
    _check(_rows(6, n, gen).to(DEVICE), k, block=64, order="index")


@pytest.mark.parametrize("n,k,chunk,block", [(300, 16, 32, None), (300, 16, 64, 32), (1000, 64, 64, None),
                                             (129, 8, 16, None)])
def test_topk_two_stage(n, k, chunk, block):
    """Chunks' top-k, then the top-k of the candidates (short last chunk, -inf tails, ties across chunks)."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    _check(_rows(6, n, gen).to(DEVICE), k, chunk=chunk, block=block)
    _check(_rows(6, n, gen).to(DEVICE), k, chunk=chunk, block=block, order="index")


def test_topk_two_stage_short_last_chunk_on_top():
    """The short last chunk holds the largest scores: fewer than k picks of its own, so its threshold
    does not bound the row's k-th from below (only full chunks' do)."""
    gen = torch.Generator().manual_seed(11)
    s = torch.randn(3, 300, generator=gen)
    s[:, 288:] = 100 + torch.rand(3, 12, generator=gen)      # chunk 32: the last chunk is 12 scores
    s[1, :288] = 5.0                                          # and with ties below them
    _check(s.to(DEVICE), 16, chunk=32)
    _check(s.to(DEVICE), 24, chunk=32)


@pytest.mark.parametrize("digit", [3, 4, 6, 7, 8])
def test_topk_digit_widths(digit):
    """Select passes of other widths (the last digit shorter unless the width divides 32)."""
    gen = torch.Generator().manual_seed(digit)
    _check(_rows(6, 600, gen).to(DEVICE), 64, digit=digit)
    _check(_rows(6, 300, gen).to(DEVICE), 16, digit=digit, chunk=64, block=32)


@pytest.mark.parametrize("n,k", [(600, 64), (40, 6)])
def test_topk_shared_prefix(n, k):
    """Rows whose keys share many top bits (the select starts below them), keys one ulp apart across
    a power of two (the shared-prefix bound rounds up there), and two distinct values only."""
    gen = torch.Generator().manual_seed(n + 3 * k)
    one = torch.tensor(1.0)
    below = torch.nextafter(one, torch.tensor(0.0))
    rows = torch.stack([1 + torch.rand(n, generator=gen) * 1e-3,
                        -(4 + torch.rand(n, generator=gen) * 1e-4),
                        torch.where(torch.rand(n, generator=gen) < 0.5, one, below),
                        torch.where(torch.rand(n, generator=gen) < 0.2, one * 3, one * 2),
                        torch.full((n,), 7.0)])
    _check(rows.to(DEVICE), k)
    _check(rows.to(DEVICE), k, block=32, chunk=0)       # the multi-block path (no shared-prefix start)
    if n > 2 * 64:                                       # two stages: the chunks' bounds start the second
        _check(rows.to(DEVICE), k, chunk=64)


@pytest.mark.parametrize("n,k,groups,block,fchunk", [
    (300, 16, 64, None, None), (300, 16, 64, 32, None), (1000, 64, 256, None, None), (1000, 64, 128, 64, None),
    (129, 8, 32, None, None), (2000, 32, 64, 128, None),
    (1000, 64, 256, None, 128), (1000, 64, 256, 64, 300), (300, 16, 64, 32, 64), (129, 8, 32, None, 50)])
def test_topk_filter(n, k, groups, block, fchunk):
    """Group maxima bound the k-th score, the select runs over the scores at or above the bound (one
    block of candidates, or several with a small block); with fchunk the row's chunks find their
    maxima and candidates side by side (segments of candidates, a short last chunk)."""
    gen = torch.Generator().manual_seed(n * 3 + k)
    _check(_rows(6, n, gen).to(DEVICE), k, groups=groups, block=block, filter_chunk=fchunk)
    _check(_rows(6, n, gen).to(DEVICE), k, groups=groups, block=block, filter_chunk=fchunk, order="index")


def _group_keys(scores: torch.Tensor, groups: int, period: int) -> torch.Tensor:
    """[B, groups] int32: the maxima (as the top-k's int32 keys; INT32_MIN where empty) of the groups
    g = (i // period) % (groups // period) * period + i % period of each row, the indexer scan's
    grouping (period 64: its row slots, groups 64 P for P programs a request)."""
    bits = scores.contiguous().view(torch.int32)
    keys = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()
    i = torch.arange(scores.shape[1], device=scores.device)
    g = (i // period) % (groups // period) * period + i % period
    out = torch.full((scores.shape[0], groups), -2 ** 31, dtype=torch.int64, device=scores.device)
    out.scatter_reduce_(1, g.expand_as(keys), keys, "amax")
    return out.to(torch.int32)


@pytest.mark.parametrize("n,k,groups,period,block", [
    (600, 16, 64, 16, None), (600, 16, 128, 64, 32), (1000, 64, 256, 64, None), (129, 8, 32, 8, None),
    (2000, 32, 32, 32, 128)])
def test_topk_filter_given_maxima(n, k, groups, period, block):
    """The filter with group maxima handed in (the indexer scan's strided groups): every program finds
    the bound from them, no maxima pass. Random and hard rows; groups with no score; exactly k groups
    (the bound is then the least maximum); groups that hold whole runs of an ascending row."""
    gen = torch.Generator().manual_seed(n + groups)
    s = _rows(6, n, gen)
    s[0] = torch.arange(n, dtype=torch.float32)
    s[1, 10:] = float("-inf")
    s[2, n // 2:] = _neg_nan(n - n // 2)
    s = s.to(DEVICE)
    gk = _group_keys(s, groups, period)
    _check(s, k, groups=groups, block=block, group_max=gk)
    _check(s, k, groups=groups, block=block, filter_chunk=n // 3, group_max=gk)
    _check(s, k, groups=groups, block=block, group_max=gk, order="index")
    _check(s, k, groups=groups, block=block, filter_chunk=n // 3, group_max=gk, order="index")
    few = _group_keys(s, period, period)                 # fewer groups than k: not read, still exact
    _check(s, period + 1, groups=4 * (period + 1), group_max=few)


def test_topk_filter_given_maxima_folded(monkeypatch):
    """More given maxima than the bound takes (`BOUND_GROUPS`; a one-row TMA scan at 1M gives 33,792):
    `_bound_kernel` folds maxima i, i + NG, ... onto group i mod NG in FOLDS loads, giving the bound
    of the maxima folded by torch first (its every digit, so one fold left out shows), and the
    filter stays exact."""
    from dsv4.kernels.triton import topk
    monkeypatch.setattr(topk, "BOUND_GROUPS", 16)
    gen = torch.Generator().manual_seed(7)
    n, k, groups = 1000, 16, 192                         # 192 maxima -> 16 groups, 12 folds
    s = _rows(6, n, gen).to(DEVICE)
    gk = _group_keys(s, groups, 64)
    _check(s, k, groups=64, group_max=gk)
    _check(s, k, groups=64, group_max=gk, order="index")
    top = gk.clone()
    top[:, 16:32] = 2 ** 30 + torch.arange(16, device=DEVICE) * 1000     # fold 1 holds every group's maximum
    bounds = []
    for given, folds in ((gk, 12), (gk.view(6, 12, 16).amax(1), 1), (top, 12), (top.view(6, 12, 16).amax(1), 1)):
        lb = torch.empty(6, 1, dtype=torch.int32, device=DEVICE)
        topk._bound_kernel[(6,)](given.contiguous(), lb, given.shape[1], given.shape[1], k, NG=16, FOLDS=folds,
                                 PASSES=7, DIGIT=topk.DIGIT, PDL=False)      # all bits: the exact k-th
        bounds.append(lb)
    assert torch.equal(bounds[0], bounds[1]) and torch.equal(bounds[2], bounds[3])


def _neg_nan(n: int) -> torch.Tensor:
    """NaNs with the sign bit set: their keys sort below -inf's (the reference picks them after it)."""
    return torch.full((n,), -4194304, dtype=torch.int32).view(torch.float32)      # 0xFFC00000


@pytest.mark.parametrize("block,fchunk", [(None, None), (32, None), (None, 128), (32, 150)])
def test_topk_filter_hard_rows(block, fchunk):
    """Rows the filter finds hard: ascending (k whole groups of candidates, more than a block),
    fewer than k scores above -inf (a short request's -inf tail; the bound is then -inf and the
    -inf scores are counted, not kept), negative NaNs below the -inf ones, one value throughout."""
    gen = torch.Generator().manual_seed(5)
    n, k = 600, 16
    s = torch.randn(6, n, generator=gen)
    s[0] = torch.arange(n, dtype=torch.float32)
    s[1, 10:] = float("-inf")
    s[2, 10:] = float("-inf")
    s[2, 100:105] = _neg_nan(5)
    s[3, :] = _neg_nan(n)
    s[3, ::50] = float("-inf")
    s[4, :] = 3.0
    s[5, 5:] = float("-inf")
    s[5, -3:] = _neg_nan(3)
    for order in ("score", "index"):
        _check(s.to(DEVICE), k, groups=64, block=block, filter_chunk=fchunk, order=order)
        _check(s.to(DEVICE), 40, groups=128, block=block, filter_chunk=fchunk, order=order)
        _check(s.to(DEVICE), k, block=block, order=order)                  # one stage
        _check(s.to(DEVICE), k, chunk=64, block=block, order=order)        # two stages


def test_topk_special_values():
    s = torch.tensor([[0.0, -0.0, 0.0, -0.0, 1.0, float("-inf"), -1.0, float("nan"), 2.0, float("inf")]])
    for k in (1, 4, 10, 13):
        _check(s.to(DEVICE), k)
        _check(s.to(DEVICE), k, order="index")


def test_topk_strided_and_empty():
    gen = torch.Generator().manual_seed(3)
    s = _rows(4, 90, gen).to(DEVICE)
    _check(s[:, ::2], 8)                                    # non-contiguous rows
    assert tri_topk(s[:0], 5).shape == (0, 5)
    assert tri_topk(s, 0).shape == (4, 0)
    assert (tri_topk(s[:, :0], 3) == -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2048, 6144, 32768, 262144])
@pytest.mark.parametrize("b", [1, 64])
def test_topk_v4_sizes(b, n):
    """k = 512 over V4 score widths (8K / 24K / 128K / 1M contexts at m = 4), one-block and multi-block;
    24K's 6,144 scores: a row the filter takes since it starts above 4,096 (`topk.FILTER_MIN_SCORES`)."""
    gen = torch.Generator().manual_seed(b * n)
    rows = _rows(b, n, gen).to(DEVICE)
    ties = (torch.randn(b, n, generator=gen) * 1e-3).round(decimals=3).to(DEVICE)          # dense ties
    ascending = torch.arange(n, device=DEVICE, dtype=torch.float32).repeat(b, 1)    # the filter's worst rows
    for kw in ({}, {"chunk": 0}, {"chunk": 2048}, {"chunk": 8192, "block": 4096}, {"groups": 1024},
               {"groups": 2048, "filter_chunk": 1 << 20}, {"groups": 2048, "filter_chunk": 16384}):
        for order in ("score", "index"):
            _check(rows, 512, order=order, **kw)
            _check(ties, 512, order=order, **kw)
            _check(ascending, 512, order=order, **kw)
    for s in (rows, ties, ascending):            # the scan's maxima handed in (its grouping at B = 64)
        _check(s, 512, groups=2048, group_max=_group_keys(s, 2112, 64), order="index")


@pytest.mark.gpu
def test_topk_cuda_graph():
    gen = torch.Generator().manual_seed(0)
    s = _rows(8, 32768, gen).cuda()
    for kw in ({}, {"groups": 2048}):       # two stages at 8 rows, and the filter
        tri_topk(s, 512, **kw)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = tri_topk(s, 512, **kw)
        for _ in range(2):
            s.copy_(_rows(8, 32768, gen).cuda())
            g.replay()
            assert torch.equal(out, ref_topk(s, 512))
