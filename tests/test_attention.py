"""Paged attention against a dense causal reference (within a sliding window too, beside
gpt-oss's attention sinks, and with Gemma 2's scores capped, as transformers' eager attention
computes them), and KV writes that touch only their slots."""

import pytest
import torch

from shardline.kernels.attention import AttentionBatch, paged_attention

PAGE, KVH, HEADS, HD, PAGES = 4, 2, 4, 8, 32


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])  # a logit per head
SOFTCAP = 1.5  # below the random scores' spread, so that it bends them


def _dense(q, k, v, start, window=0, sinks=None, softcap=0.0):
    """q [n, H, D] at positions start.., k/v [start+n, KVH, D]; each query sees the keys before
    it, within the last `window` positions where that is not 0 (transformers' q - k < window),
    each head's softmax beside its sink, its scores capped at `softcap`, in transformers' order
    (scale, cap, mask, sink)."""
    ctx = k.shape[0]
    q_pos, k_pos = torch.arange(start, ctx)[:, None], torch.arange(ctx)[None, :]
    mask = k_pos <= q_pos
    if window:
        mask &= q_pos - k_pos < window
    group = HEADS // KVH
    qh, kh, vh = (
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
    )
    scores = qh @ kh.transpose(1, 2) * HD**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, scores.shape[1], 1)], -1)
    probs = torch.softmax(scores, -1)[..., :ctx]
    return (probs @ vh).transpose(0, 1)


EXTRAS = {"plain": {}, "sinks": {"sinks": SINKS}, "softcap": {"softcap": SOFTCAP}}


def _slots(table, positions):
    return table[positions // PAGE] * PAGE + positions % PAGE


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kernel", ["fused", "plain"])
def test_prefill_chunks_and_decode_match_dense(monkeypatch, kernel, window, extra):
    import shardline.kernels.attention as attention

    if kernel == "plain":  # the path other devices take, checked here on the CPU
        monkeypatch.setattr(attention, "_attend", attention.attend_plain)
    torch.manual_seed(0)
    kp, vp = torch.randn(PAGES + 1, PAGE, KVH, HD), torch.randn(PAGES + 1, PAGE, KVH, HD)
    total = 23
    table = torch.randperm(PAGES)[: -(-total // PAGE)]  # scattered, out-of-order pages
    q, k, v = torch.randn(total, HEADS, HD), torch.randn(total, KVH, HD), torch.randn(total, KVH, HD)
    want = _dense(q, k, v, 0, window, **EXTRAS[extra])
    outs, pos = [], 0
    for n in (9, 6, 1, 7):  # a first chunk, a chunk over cached context, a single token, the rest
        positions = torch.arange(pos, pos + n)
        batch = AttentionBatch(
            slots=_slots(table, positions),
            is_decode=False,
            query_lens=[n],
            start_positions=[pos],
            block_tables_list=[table],
        )
        new = q[pos : pos + n], k[pos : pos + n], v[pos : pos + n]
        outs.append(paged_attention(*new, kp, vp, batch, HD**-0.5, window, **EXTRAS[extra]))
        pos += n
    torch.testing.assert_close(torch.cat(outs), want)


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize("window", [0, 3, 9])
def test_batched_decode_matches_dense_per_sequence(monkeypatch, window, extra):
    """Contexts of several split-KV blocks (of 8 tokens here), windows that start past the first
    block for some sequences and not for others."""
    import shardline.kernels.attention as attention

    monkeypatch.setattr(attention, "DECODE_BLOCK_TOKENS", 8)
    torch.manual_seed(1)
    kp, vp = torch.zeros(PAGES + 1, PAGE, KVH, HD), torch.zeros(PAGES + 1, PAGE, KVH, HD)
    lens = [1, 5, 12, 8, 30]
    pages = torch.randperm(PAGES)
    tables, offset, seqs = [], 0, []
    for n in lens:
        tables.append(pages[offset : offset + -(-n // PAGE)])
        offset += len(tables[-1])
        seqs.append((torch.randn(n, HEADS, HD), torch.randn(n, KVH, HD), torch.randn(n, KVH, HD)))
    for table, (q, k, v) in zip(tables, seqs):  # cache every token but the last
        ctx = torch.arange(len(q) - 1)
        flat = _slots(table, ctx)
        kp.view(-1, KVH, HD)[flat], vp.view(-1, KVH, HD)[flat] = k[:-1], v[:-1]
    width = max(len(t) for t in tables)
    block_tables = torch.stack([torch.cat([t, torch.full((width - len(t),), PAGES)]) for t in tables])
    positions = torch.tensor(lens) - 1
    slots = block_tables[torch.arange(len(lens)), positions // PAGE] * PAGE + positions % PAGE
    batch = AttentionBatch(slots=slots, is_decode=True, block_tables=block_tables, context_lens=positions + 1)
    got = paged_attention(
        torch.stack([q[-1] for q, _, _ in seqs]),
        torch.stack([k[-1] for _, k, _ in seqs]),
        torch.stack([v[-1] for _, _, v in seqs]),
        kp,
        vp,
        batch,
        HD**-0.5,
        window,
        **EXTRAS[extra],
    )
    for i, (q, k, v) in enumerate(seqs):
        torch.testing.assert_close(got[i], _dense(q, k, v, 0, window, **EXTRAS[extra])[-1])


def test_kv_write_touches_only_scheduled_slots():
    kp = torch.full((PAGES + 1, PAGE, KVH, HD), float("nan"))
    vp = kp.clone()
    table = torch.tensor([7, 3, 19])
    positions = torch.arange(2, 10)
    batch = AttentionBatch(
        slots=_slots(table, positions), is_decode=False, query_lens=[8], start_positions=[2], block_tables_list=[table]
    )
    k = torch.randn(8, KVH, HD)
    # start > 0 makes attention read cached slots 0-1 (NaN); only the writes are checked here.
    paged_attention(torch.randn(8, HEADS, HD), k, k.clone(), kp, vp, batch, 1.0)
    written = torch.zeros(PAGES + 1, PAGE, dtype=torch.bool)
    flat = written.view(-1)
    flat[_slots(table, positions)] = True
    assert not torch.isnan(kp[written]).any()
    assert torch.isnan(kp[~written]).all()
    torch.testing.assert_close(kp.view(-1, KVH, HD)[_slots(table, positions)], k)


def _decode_case(lens, seed=2):
    """Random caches for sequences of `lens` tokens; returns (q, k, v of the new tokens, pages,
    batch, dense reference per sequence)."""
    torch.manual_seed(seed)
    kp, vp = torch.zeros(PAGES * 4 + 1, PAGE, KVH, HD), torch.zeros(PAGES * 4 + 1, PAGE, KVH, HD)
    pages = torch.randperm(PAGES * 4)
    tables, offset, seqs = [], 0, []
    for n in lens:
        tables.append(pages[offset : offset + -(-n // PAGE)])
        offset += len(tables[-1])
        seqs.append((torch.randn(n, HEADS, HD), torch.randn(n, KVH, HD), torch.randn(n, KVH, HD)))
    for table, (q, k, v) in zip(tables, seqs):
        flat = _slots(table, torch.arange(len(q) - 1))
        kp.view(-1, KVH, HD)[flat], vp.view(-1, KVH, HD)[flat] = k[:-1], v[:-1]
    width = max(len(t) for t in tables)
    block_tables = torch.stack([torch.cat([t, torch.full((width - len(t),), PAGES * 4)]) for t in tables])
    positions = torch.tensor(lens) - 1
    slots = block_tables[torch.arange(len(lens)), positions // PAGE] * PAGE + positions % PAGE
    batch = AttentionBatch(slots=slots, is_decode=True, block_tables=block_tables, context_lens=positions + 1)
    new = [torch.stack([s[j][-1] for s in seqs]) for j in range(3)]
    return new, kp, vp, batch, [_dense(q, k, v, 0)[-1] for q, k, v in seqs]


def test_decode_in_blocks_matches_dense_and_reads_only_what_each_sequence_reaches(monkeypatch):
    import shardline.kernels.attention as attention

    monkeypatch.setattr(attention, "DECODE_BLOCK_TOKENS", 2 * PAGE)  # blocks of 8 tokens
    calls = []
    real = attention._attend
    monkeypatch.setattr(
        attention, "_attend", lambda q, k, *a, **kw: calls.append(tuple(k.shape[::2])) or real(q, k, *a, **kw)
    )
    lens = [3, 40, 1, 17, 8, 9]  # one long sequence, blocks boundaries hit exactly
    (q, k, v), kp, vp, batch, want = _decode_case(lens)
    got = paged_attention(q, k, v, kp, vp, batch, HD**-0.5)
    for i in range(len(lens)):
        torch.testing.assert_close(got[i], want[i])
    # (sequences, context tokens) gathered per block: every block holds at most 8 tokens per
    # sequence, and after the first block only the sequences that reach into it.
    assert calls == [(6, 8), (3, 8), (2, 8), (1, 8), (1, 8)]


def test_plain_and_fused_cpu_attention_agree_on_output_and_log_sum_exp():
    from shardline.kernels.attention import attend_fused_cpu, attend_plain

    torch.manual_seed(3)
    q, k, v = torch.randn(3, 2, 4, HD), torch.randn(3, 2, 20, HD), torch.randn(3, 2, 20, HD)
    bias = torch.zeros(3, 1, 1, 20)
    bias[1, ..., 7:] = float("-inf")
    for a, b in zip(attend_plain(q, k, v, 0.3, bias), attend_fused_cpu(q, k, v, 0.3, bias)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    qs = torch.randn(3, 2, 20, HD)  # causal: as many queries as keys
    for a, b in zip(attend_plain(qs, k, v, 0.3, causal=True), attend_fused_cpu(qs, k, v, 0.3, causal=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
