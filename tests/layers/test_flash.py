"""Block-wise flash attention (one process): the pieces cover exactly the allowed (query, key)
pairs for every layout, window and degree, and forward/backward match explicit-mask attention;
with soft-capped scores (Gemma 2) the tiled math kernel matches the float64 math, tiles smaller
than the pieces included."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.reference import assert_close
from tsp_core.distributed.chunks import local_segments, row_segments
from tsp_core.layers import flash
from tsp_core.layers.dropout import AttentionDropout, rank_seed
from tsp_core.layers.flash import attention_backward, attention_forward, plan_pieces


def visible_pairs(rows, S, causal, window, doc_of=None, chunk=None) -> torch.Tensor:
    """[len(rows), S]: which keys each query row may see. ``chunk``: Llama 4's chunked attention,
    chunks counted from the start of each document (from 0 unpacked)."""
    i, j = torch.tensor(rows)[:, None], torch.arange(S)[None]
    visible = torch.ones(len(rows), S, dtype=torch.bool)
    if doc_of is not None:
        visible &= doc_of[i] == doc_of[j]
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= j > i - window
    if chunk is not None:
        first = torch.zeros(S, dtype=torch.long) if doc_of is None else \
            torch.searchsorted(doc_of, doc_of)           # each position's document start
        visible &= (i - first[i]) // chunk == (j - first[j]) // chunk
    return visible


def explicit(q, k, v, rows, causal, window, scale, doc_of=None, cap=None, chunk=None,
             sinks=None, keep=None, p=0.0):
    """Plain float64 math: the full score matrix times the scale, with ``cap`` soft-capped
    (``tanh(s / cap) * cap``, Gemma 2: HF's eager order), then the mask and softmax; with
    ``sinks`` [Hq] (gpt-oss, HF's eager order) one more column per head holding its sink logit,
    dropped after the softmax; with ``keep`` [B, Hq, rows, S] the probabilities then dropped
    where it is False and the rest scaled by 1/(1-p) (HF's eager attention dropout)."""
    S = k.shape[2]
    visible = visible_pairs(rows, S, causal, window, doc_of, chunk)
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(s, -1)
    else:
        column = sinks.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)
        probs = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs @ v.repeat_interleave(g, 1)


def check(ref, q, k, v, pieces, scale, gen, cap=None, sinks=None, dropout=None) -> None:
    """The pieces' forward and backward (soft-capped by ``cap``, with ``sinks``: a leaf whose
    gradient :func:`flash.sink_backward` gives, with attention ``dropout``) against the
    explicit-mask reference ``ref``."""
    sink_values = None if sinks is None else sinks.detach()
    out, lse = attention_forward(q.detach(), k.detach(), v.detach(), pieces, scale, softcap=cap,
                                 sinks=sink_values, dropout=dropout)
    assert lse.dtype == torch.float64 and lse.shape == q.shape[:3]
    assert_close(out, ref.detach(), 1e-12, "output")
    do = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    expected = torch.autograd.grad(ref, leaves, do)
    dq, dkv = attention_backward(do, q.detach(), torch.stack([k, v]).detach(), out, lse, pieces,
                                 scale, softcap=cap, dropout=dropout)
    for name, a, b in zip("qkv", (dq, dkv[0], dkv[1]), expected):
        assert_close(a, b, 1e-12, f"d{name} (cap {cap})")
    if sinks is not None:
        assert_close(flash.sink_backward(do, out, lse, sink_values), expected[3], 1e-12, "dsinks")


def packed(docs: list[int], p: int, size: int, window: int | None):
    """Rank p's rows of a packed row of ``docs`` and their pieces."""
    segs = row_segments(docs, p, size)
    return [t for a, b, _ in segs for t in range(a, b)], plan_pieces(segs, sum(docs), True, window)


def causal_rows(seq: int, p: int, size: int, window: int | None, docs: list[int] | None):
    """Rank p's zigzag rows of a causal ``seq``-token row (or of a packed row of ``docs``) and
    their pieces."""
    if docs is not None:
        return packed(docs, p, size, window)
    segs = local_segments(seq, p, size, "zigzag")
    return [t for a, b in segs for t in range(a, b)], plan_pieces(segs, seq, True, window)


@pytest.mark.parametrize("size,layout,causal,window", [
    (d, lay, c, w) for d, lay, (c, w) in itertools.product(
        [1, 2, 3, 4], ["zigzag", "contiguous"],
        [(False, None), (True, None), (True, 1), (True, 2), (True, 5), (True, 13), (True, 100)])])
def test_pieces_match_explicit_mask(size, layout, causal, window):
    seq, scale = 48, 8 ** -0.5
    gen = torch.Generator().manual_seed(0)
    for p in range(size):
        segs = local_segments(seq, p, size, layout)
        rows = [t for a, b in segs for t in range(a, b)]
        pieces = plan_pieces(segs, seq, causal, window)
        covered = torch.zeros(len(rows), seq, dtype=torch.int64)
        for pc in pieces:
            assert pc.mask == "full" or pc.q1 - pc.q0 == pc.k1 - pc.k0, pc  # square masks only
            covered[pc.q0:pc.q1, pc.k0:pc.k1] += 1
        assert covered.max() <= 1, "a (query, key) pair is covered twice"

        q = torch.randn(2, 4, len(rows), 8, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        check(explicit(q, k, v, rows, causal, window, scale), q, k, v, pieces, scale, gen)


def test_window_needs_causal():
    with pytest.raises(ValueError, match="sliding window needs causal"):
        plan_pieces([(0, 8)], 8, causal=False, window=4)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 1, 3, 7])
def test_packed_documents_never_see_each_other(size, window):
    docs = [8, 16, 40, 8]          # each a multiple of 2 * 4
    seq, scale = sum(docs), 8 ** -0.5
    doc_of = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    gen = torch.Generator().manual_seed(1)
    for p in range(size):
        rows, pieces = packed(docs, p, size, window)
        q = torch.randn(1, 2, len(rows), 8, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        check(explicit(q, k, v, rows, True, window, scale, doc_of), q, k, v, pieces, scale, gen)


def check_softcap(q, k, v, rows, pieces, causal, window, scale, cap, gen, doc_of=None) -> None:
    ref = explicit(q, k, v, rows, causal, window, scale, doc_of, cap)
    # the cap is far from linear at these scores: without it the output is measurably different
    plain = explicit(q, k, v, rows, causal, window, scale, doc_of)
    assert (plain - ref).abs().max() > 1e-2
    check(ref, q, k, v, pieces, scale, gen, cap)


# tile 512: one tile per piece; 5 and 3: tiles smaller than the pieces (and not dividing them),
# so the kernel's own log-sum-exp merge over tiles and its diagonal tiles are exercised
@pytest.mark.parametrize("tile", [512, 5, 3])
@pytest.mark.parametrize("kv_heads", [2, 1])                       # GQA (4 / 2) and MQA
@pytest.mark.parametrize("size,causal,window", [
    (1, False, None), (2, True, None), (4, True, None), (1, True, 4), (2, True, 13),
    (4, True, 5)])
def test_softcap_pieces_match_math(monkeypatch, tile, kv_heads, size, causal, window):
    monkeypatch.setattr(flash, "MATH_TILE", tile)
    seq, scale, cap = 48, 8 ** -0.5, 1.5
    gen = torch.Generator().manual_seed(2)
    for p in range(size):
        segs = local_segments(seq, p, size, "zigzag")
        rows = [t for a, b in segs for t in range(a, b)]
        pieces = plan_pieces(segs, seq, causal, window)
        # scores of a few units: tanh(s / 1.5) is far from linear
        q = (3 * torch.randn(2, 4, len(rows), 8, generator=gen, dtype=torch.float64)
             ).requires_grad_()
        k = (3 * torch.randn(2, kv_heads, seq, 8, generator=gen, dtype=torch.float64)
             ).requires_grad_()
        v = torch.randn(2, kv_heads, seq, 8, generator=gen, dtype=torch.float64,
                        requires_grad=True)
        check_softcap(q, k, v, rows, pieces, causal, window, scale, cap, gen)


@pytest.mark.parametrize("tile", [512, 3])
@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("window", [None, 3, 7])
def test_softcap_packed_documents(monkeypatch, tile, size, window):
    monkeypatch.setattr(flash, "MATH_TILE", tile)
    docs = [8, 16, 40, 8]
    seq, scale, cap = sum(docs), 8 ** -0.5, 2.0
    doc_of = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    gen = torch.Generator().manual_seed(3)
    for p in range(size):
        rows, pieces = packed(docs, p, size, window)
        q = (3 * torch.randn(1, 2, len(rows), 8, generator=gen, dtype=torch.float64)
             ).requires_grad_()
        k = (3 * torch.randn(1, 1, seq, 8, generator=gen, dtype=torch.float64)).requires_grad_()
        v = torch.randn(1, 1, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        check_softcap(q, k, v, rows, pieces, True, window, scale, cap, gen, doc_of)


def test_softcap_float32_conventions():
    # float32 in: output float32, LSE float32 (natural log), like the native kernel's; and the
    # same as the float64 math to float32 precision
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
    pieces = plan_pieces([(0, 16)], 16, True, None)
    out, lse = attention_forward(q, k, v, pieces, 0.5, softcap=1.0)
    assert out.dtype == lse.dtype == torch.float32
    s = torch.tanh(q.double() @ k.double().transpose(-1, -2) * 0.5 / 1.0) * 1.0
    s = s.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
    assert_close(lse.double(), torch.logsumexp(s, -1), 1e-5, "lse")
    assert_close(out.double(), torch.softmax(s, -1) @ v.double(), 1e-5, "output")


# ------------------------------------------------- kernels: dispatch, GQA per piece, accumulation

@pytest.mark.parametrize("dtype,head_dim,cap,expected", [
    (torch.bfloat16, 128, None, "flash"), (torch.float16, 64, None, "flash"),
    (torch.bfloat16, 12, None, "efficient"), (torch.bfloat16, 512, None, "efficient"),
    (torch.float32, 128, None, "efficient"), (torch.float64, 128, None, flash.MATH),
    (torch.bfloat16, 128, 50.0, flash.MATH)])
def test_kernel_choice_off_the_cpu(dtype, head_dim, cap, expected):
    """FlashAttention-2 for bf16/fp16 with a head size it takes, the memory-efficient kernel for
    float32 and other head sizes, the math kernel for float64 and soft-capped scores (meta
    tensors stand in for a GPU's: only dtype, device and shape decide)."""
    q = torch.empty(1, 2, 4, head_dim, dtype=dtype, device="meta")
    assert flash.kernel_for(q, cap) == expected
    assert flash.kernel_for(torch.empty(1, 2, 4, head_dim, dtype=dtype), None) == "cpu"


def check_rank(p: int, size: int, causal: bool, window: int | None, kv_heads: int,
               gen: torch.Generator, seq: int = 48) -> list:
    """:func:`check` of rank p's zigzag rows of a ``seq``-token row (2 rows, 4 query heads of 8 on
    ``kv_heads``); returns the rank's pieces."""
    segs = local_segments(seq, p, size, "zigzag")
    rows = [t for a, b in segs for t in range(a, b)]
    pieces = plan_pieces(segs, seq, causal, window)
    q = torch.randn(2, 4, len(rows), 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, 8, generator=gen, dtype=torch.float64,
                        requires_grad=True) for _ in range(2))
    scale = 8 ** -0.5
    check(explicit(q, k, v, rows, causal, window, scale), q, k, v, pieces, scale, gen)
    return pieces


def _cpu_kernel_without_gqa(seen: list[tuple[int, int]]) -> flash.Kernel:
    """The CPU flash kernel declared without native GQA, so that the piece logic expands K/V as
    it does for CUDA's memory-efficient kernel; records (query heads, key length) per call."""
    cpu = flash.KERNELS["cpu"]

    def fwd(q, k, v, causal, scale):
        assert k.shape[1] == v.shape[1] == q.shape[1], "K/V not expanded to the query heads"
        seen.append((q.shape[1], k.shape[2]))
        return cpu.fwd(q, k, v, causal, scale)

    def bwd(do, q, k, v, out, lse, causal, scale):
        assert k.shape[1] == q.shape[1], "K/V not expanded to the query heads"
        seen.append((q.shape[1], k.shape[2]))
        return cpu.bwd(do, q, k, v, out, lse, causal, scale)

    return flash.Kernel("cpu-expanded", fwd, bwd, native_gqa=False)


@pytest.mark.parametrize("kv_heads", [2, 1])                       # GQA (4 / 2) and MQA
@pytest.mark.parametrize("size,window", [(2, None), (4, 5), (1, 13)])
def test_kv_heads_expanded_per_piece(monkeypatch, kv_heads, size, window):
    """A kernel without native GQA gets each piece's K/V expanded (that piece's keys only, never
    the whole sequence) and its dK/dV folded back onto the shared heads: exact in float64."""
    seen: list[tuple[int, int]] = []
    monkeypatch.setitem(flash.KERNELS, "cpu", _cpu_kernel_without_gqa(seen))
    gen = torch.Generator().manual_seed(5)
    for p in range(size):
        pieces = check_rank(p, size, True, window, kv_heads, gen)
        longest = max(pc.k1 - pc.k0 for pc in pieces)
        assert max(n for _, n in seen) == longest and (size == 1 or longest < 48), seen
        seen.clear()


@pytest.mark.parametrize("size,causal,window", [(1, False, None), (4, True, None), (2, True, 5)])
def test_math_kernel_without_cap(monkeypatch, size, causal, window):
    """The tiled math kernel, uncapped (what float64 runs off the CPU), against the math."""
    monkeypatch.setattr(flash, "kernel_for", lambda q, softcap=None, dropout=None: flash.MATH)
    monkeypatch.setattr(flash, "MATH_TILE", 5)
    gen = torch.Generator().manual_seed(6)
    for p in range(size):
        check_rank(p, size, causal, window, 2, gen)


@pytest.mark.parametrize("size,window,docs",
                         [(4, None, None), (2, 3, None), (2, None, [8, 24, 16])])
def test_bf16_piece_gradients_summed_in_float32(size, window, docs):
    """In bf16, every piece's dQ/dK/dV is summed in float32 (the forward merges in float32 too):
    dK/dV come back as the float32 accumulator, equal to the float64 sum of the kernel's own
    per-piece gradients (a full piece's per key block, flash.key_blocks) to float32 precision
    (a bf16 accumulator would be off by its ulp, 4e-3), and dQ is that sum rounded once to bf16.
    The result is also the float64 math's to bf16 precision."""
    seq, scale = 48, 8 ** -0.5
    gen = torch.Generator().manual_seed(7)
    doc_of = None if docs is None else torch.repeat_interleave(torch.arange(len(docs)),
                                                               torch.tensor(docs))
    for p in range(size):
        rows, pieces = causal_rows(seq, p, size, window, docs)
        q64 = torch.randn(2, 4, len(rows), 8, generator=gen, dtype=torch.float64)
        kv64 = torch.randn(2, 2, 2, seq, 8, generator=gen, dtype=torch.float64)
        q, kv = q64.bfloat16(), kv64.bfloat16()
        out, lse = attention_forward(q, kv[0], kv[1], pieces, scale)
        do = torch.randn(out.shape, generator=gen, dtype=torch.float64).bfloat16()
        dq, dkv = attention_backward(do, q, kv, out, lse, pieces, scale)
        assert dq.dtype == torch.bfloat16 and dkv.dtype == torch.float32
        sum_q = torch.zeros(q.shape, dtype=torch.float64)
        sum_kv = torch.zeros(kv.shape, dtype=torch.float64)
        for pc in (block for piece in pieces for block in flash.key_blocks(piece)):
            r, c = slice(pc.q0, pc.q1), slice(pc.k0, pc.k1)
            g = flash._piece_bwd(do[:, :, r].contiguous(), q[:, :, r], kv[0, :, :, c],
                                 kv[1, :, :, c], out[:, :, r].contiguous(),
                                 lse[:, :, r].contiguous(), pc.mask, scale)
            sum_q[:, :, r] += g[0].double()
            sum_kv[0, :, :, c] += g[1].double()
            sum_kv[1, :, :, c] += g[2].double()
        assert_close(dkv.double(), sum_kv, 1e-6, "dK/dV accumulator")
        assert_close(dq.double(), sum_q.bfloat16().double(), 1e-6, "dQ, rounded once")
        # and the math, to bf16 precision (inputs rounded to bf16 once)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, kv[0], kv[1]))
        ref = explicit(qr, kr, vr, rows, True, window, scale, doc_of)
        assert_close(out.double(), ref.detach(), 2e-2, "bf16 output")
        expected = torch.autograd.grad(ref, (qr, kr, vr), do.double())
        for name, a, b in zip("qkv", (dq, dkv[0], dkv[1]), expected):
            assert_close(a.double(), b, 3e-2, f"bf16 d{name}")


# ------------------------------------------- chunked local attention (Llama 4), sinks (gpt-oss)

def check_chunked(rows, pieces, seq, chunk, window, doc_of=None) -> None:
    """The pieces cover exactly the visible pairs (nothing outside a chunk: a piece whose keys
    are all masked is never planned), and no piece straddles a chunk boundary."""
    covered = torch.zeros(len(rows), seq, dtype=torch.int64)
    first = torch.zeros(seq, dtype=torch.long) if doc_of is None else \
        torch.searchsorted(doc_of, doc_of)
    for pc in pieces:
        assert pc.mask == "full" or pc.q1 - pc.q0 == pc.k1 - pc.k0, pc
        n = pc.q1 - pc.q0
        block = {"full": torch.ones(n, pc.k1 - pc.k0, dtype=torch.int64),
                 "causal": torch.ones(n, n, dtype=torch.int64).tril(),
                 "anticausal": torch.ones(n, n, dtype=torch.int64).triu()}[pc.mask]
        covered[pc.q0:pc.q1, pc.k0:pc.k1] += block
        pos = [rows[t] for t in range(pc.q0, pc.q1)] + list(range(pc.k0, pc.k1))
        assert len({(t - int(first[t])) // chunk for t in pos}) == 1, (pc, chunk)
    expected = visible_pairs(rows, seq, True, window, doc_of, chunk)
    assert torch.equal(covered, expected.long()), f"chunk {chunk}, window {window}"


@pytest.mark.parametrize("size,layout", [(1, "zigzag"), (2, "zigzag"), (4, "zigzag"),
                                         (4, "contiguous")])
@pytest.mark.parametrize("chunk,window", [(1, None), (5, None), (12, None), (16, None),
                                          (100, None), (7, 3)])
def test_chunked_pieces_match_explicit_mask(size, layout, chunk, window):
    """Chunked attention (Llama 4's attention_chunk_size) forward and backward against the float64
    math; chunk 5 cuts zigzag chunks of 6 (size 4) and 12 (size 2) across a boundary, chunk 1 sees
    only the diagonal, chunk 12/16 leaves some ranks' second zigzag chunk with its whole prefix
    masked, chunk 100 is plain causal."""
    seq, scale = 48, 8 ** -0.5
    gen = torch.Generator().manual_seed(8)
    straddles = False
    for p in range(size):
        segs = local_segments(seq, p, size, layout)
        straddles |= any(a // chunk != (b - 1) // chunk for a, b in segs)
        rows = [t for a, b in segs for t in range(a, b)]
        pieces = plan_pieces(segs, seq, True, window, chunk)
        check_chunked(rows, pieces, seq, chunk, window)
        q = torch.randn(2, 4, len(rows), 8, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        check(explicit(q, k, v, rows, True, window, scale, chunk=chunk), q, k, v, pieces, scale,
              gen)
    if chunk in (5, 7):  # some rank's segments cross a chunk boundary at every size
        assert straddles, (size, layout, chunk)


@pytest.mark.parametrize("size", [1, 4])
def test_chunked_packed_documents(size):
    """Packed rows: chunks count from each document's start (each document as if alone)."""
    docs = [8, 16, 40, 8]
    seq, scale, chunk = sum(docs), 8 ** -0.5, 6
    doc_of = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    gen = torch.Generator().manual_seed(9)
    for p in range(size):
        segs = row_segments(docs, p, size)
        rows = [t for a, b, _ in segs for t in range(a, b)]
        pieces = plan_pieces(segs, seq, True, None, chunk)
        check_chunked(rows, pieces, seq, chunk, None, doc_of)
        q = torch.randn(1, 2, len(rows), 8, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(1, 1, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(1, 1, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        check(explicit(q, k, v, rows, True, None, scale, doc_of, chunk=chunk), q, k, v, pieces,
              scale, gen)


def test_chunk_errors():
    with pytest.raises(ValueError, match=r"\(attention_chunk_size\) needs causal"):
        plan_pieces([(0, 8)], 8, causal=False, window=None, chunk=4)
    with pytest.raises(ValueError, match=r"attention_chunk_size \(0\) must be at least 1"):
        plan_pieces([(0, 8)], 8, causal=True, window=None, chunk=0)


@pytest.mark.parametrize("size,causal,window,chunk,cap", [
    (1, False, None, None, None), (2, True, None, None, None), (4, True, None, None, None),
    (4, True, 5, None, None), (4, True, None, 5, None), (2, True, 7, None, 1.5)])
def test_sinks_match_math(size, causal, window, chunk, cap):
    """Attention sinks (gpt-oss): forward and backward, the sinks' own gradient included, against
    autograd through HF's eager math (a sink column, softmax, dropped) in float64. The rows of
    several pieces (every zigzag rank's second chunk) would count a sink added per piece more
    than once; sinks of a few units make the sink's share of each row large."""
    seq, scale = 48, 8 ** -0.5
    gen = torch.Generator().manual_seed(10)
    for p in range(size):
        segs = local_segments(seq, p, size, "zigzag")
        rows = [t for a, b in segs for t in range(a, b)]
        pieces = plan_pieces(segs, seq, causal, window, chunk)
        q = torch.randn(2, 4, len(rows), 8, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        sinks = (2 * torch.randn(4, generator=gen, dtype=torch.float64)).requires_grad_()
        ref = explicit(q, k, v, rows, causal, window, scale, cap=cap, chunk=chunk, sinks=sinks)
        plain = explicit(q, k, v, rows, causal, window, scale, cap=cap, chunk=chunk)
        assert (plain - ref).abs().max() > 1e-2       # the sinks change the result measurably
        check(ref, q, k, v, pieces, scale, gen, cap, sinks)


def test_sinks_shape_error():
    q = torch.zeros(1, 4, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"sinks of shape \(2,\) do not match the 4 query heads"):
        attention_forward(q, q, q, plan_pieces([(0, 8)], 8, True, None), 1.0,
                          sinks=torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("chunk", [None, 5])
def test_sinks_bf16_native_kernel(chunk):
    """In bf16 the pieces run the native (CPU flash) kernel, whose backward gets the merged output
    and an LSE that includes the sink, not its own: output, dQ/dK/dV and the sinks' gradient
    equal the float64 math to bf16 precision (inputs rounded to bf16 once)."""
    seq, scale, size = 48, 8 ** -0.5, 2
    gen = torch.Generator().manual_seed(11)
    for p in range(size):
        segs = local_segments(seq, p, size, "zigzag")
        rows = [t for a, b in segs for t in range(a, b)]
        pieces = plan_pieces(segs, seq, True, None, chunk)
        q = torch.randn(2, 4, len(rows), 8, generator=gen, dtype=torch.float64).bfloat16()
        kv = torch.randn(2, 2, 2, seq, 8, generator=gen, dtype=torch.float64).bfloat16()
        sinks = (2 * torch.randn(4, generator=gen, dtype=torch.float64)).bfloat16()
        assert flash.kernel_for(q) == "cpu"
        out, lse = attention_forward(q, kv[0], kv[1], pieces, scale, sinks=sinks)
        do = torch.randn(out.shape, generator=gen, dtype=torch.float64).bfloat16()
        dq, dkv = attention_backward(do, q, kv, out, lse, pieces, scale)
        ds = flash.sink_backward(do, out, lse, sinks)
        assert out.dtype == dq.dtype == ds.dtype == torch.bfloat16 and lse.dtype == torch.float32
        qr, kr, vr, sr = (t.double().requires_grad_() for t in (q, kv[0], kv[1], sinks))
        ref = explicit(qr, kr, vr, rows, True, None, scale, chunk=chunk, sinks=sr)
        assert_close(out.double(), ref.detach(), 2e-2, "bf16 output")
        expected = torch.autograd.grad(ref, (qr, kr, vr, sr), do.double())
        for name, a, b in zip(["dq", "dk", "dv", "dsinks"], (dq, dkv[0], dkv[1], ds), expected):
            assert_close(a.double(), b, 3e-2, f"bf16 {name}")


# ------------------------------------------------------------------ attention dropout

@pytest.mark.parametrize("tile", [512, 5])
@pytest.mark.parametrize("size,window,docs,cap,sinks", [
    (1, None, None, None, False), (2, None, None, None, False), (4, None, None, None, False),
    (4, 5, None, None, False), (2, None, [8, 24, 16], None, False), (2, 7, None, 1.5, False),
    (4, None, None, None, True)])
def test_dropout_pieces_match_math(monkeypatch, tile, size, window, docs, cap, sinks):
    """Attention dropout (Seed-OSS's attention_dropout): every rank's pieces, merged by the
    undropped LSE, forward and backward (the backward's key blocks cut the pieces otherwise)
    against HF's eager order in float64 (softmax, keep mask, 1/(1-p), times V) with the same
    keep mask, read from AttentionDropout.keep over the whole (query row, key) grid."""
    monkeypatch.setattr(flash, "MATH_TILE", tile)
    seq, scale, p = 48, 8 ** -0.5, 0.3
    doc_of = None if docs is None else \
        torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    gen = torch.Generator().manual_seed(11)
    for rank in range(size):
        rows, pieces = causal_rows(seq, rank, size, window, docs)
        dropout = AttentionDropout(p, rank_seed(1234, rank)).at(rank, 0)
        keep = dropout.keep(2, 4, (0, len(rows)), (0, seq), "cpu")
        q = torch.randn(2, 4, len(rows), 8, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 2, seq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        sink = (torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
                if sinks else None)
        ref = explicit(q, k, v, rows, True, window, scale, doc_of, cap, sinks=sink, keep=keep,
                       p=p)
        plain = explicit(q, k, v, rows, True, window, scale, doc_of, cap, sinks=sink)
        assert (plain - ref).abs().max() > 1e-2  # the dropout changes the result measurably
        check(ref, q, k, v, pieces, scale, gen, cap, sink, dropout)


def test_dropout_masks_rate_and_independence():
    """The keep masks: dropped at rate p (within 5 sigma); independent between ranks (both
    dropped at p^2) and between calls of one rank (``at``); the same for the same seed; a block
    of the grid is that block of the whole grid (forward pieces and backward blocks agree)."""
    p = 0.1
    masks = [AttentionDropout(p, rank_seed(77, r)).at(0, 0).keep(2, 4, (0, 96), (0, 256), "cpu")
             for r in range(4)]
    n = masks[0].numel()
    for m in masks:
        assert abs((1 - m.double().mean().item()) - p) < 5 * (p * (1 - p) / n) ** 0.5
    other_call = AttentionDropout(p, rank_seed(77, 0)).at(1, 0).keep(2, 4, (0, 96), (0, 256),
                                                                       "cpu")
    for a, b in [(masks[0], masks[1]), (masks[2], masks[3]), (masks[0], other_call)]:
        both = (~a & ~b).double().mean().item()
        assert abs(both - p * p) < 5 * (p * p / n) ** 0.5, both
    again = AttentionDropout(p, rank_seed(77, 0)).at(0, 0)
    assert torch.equal(again.keep(2, 4, (0, 96), (0, 256), "cpu"), masks[0])
    assert torch.equal(again.keep(2, 4, (30, 41), (7, 100), "cpu"), masks[0][:, :, 30:41, 7:100])
    with pytest.raises(ValueError, match=r"probability 0\.0 must be in \(0, 1\)"):
        AttentionDropout(0.0, 1)
    assert flash.kernel_for(torch.empty(1, 2, 4, 8), None, again) == flash.MATH
