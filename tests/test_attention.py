"""Paged attention against a dense causal reference, and KV writes that touch only their slots."""
import torch
import torch.nn.functional as F

from kernels.attention import AttentionBatch, paged_attention

PAGE, KVH, HEADS, HD, PAGES = 4, 2, 4, 8, 32


def _dense(q, k, v, start):
    """q [n, H, D] at positions start.., k/v [start+n, KVH, D]."""
    ctx = k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


def _slots(table, positions):
    return table[positions // PAGE] * PAGE + positions % PAGE


def test_prefill_chunks_and_decode_match_dense():
    torch.manual_seed(0)
    kp, vp = torch.randn(PAGES + 1, PAGE, KVH, HD), torch.randn(PAGES + 1, PAGE, KVH, HD)
    total = 23
    table = torch.randperm(PAGES)[: -(-total // PAGE)]  # scattered, out-of-order pages
    q, k, v = torch.randn(total, HEADS, HD), torch.randn(total, KVH, HD), torch.randn(total, KVH, HD)
    want = _dense(q, k, v, 0)
    outs, pos = [], 0
    for n in (9, 6, 1, 7):  # a first chunk, a chunk over cached context, a single token, the rest
        positions = torch.arange(pos, pos + n)
        batch = AttentionBatch(slots=_slots(table, positions), is_decode=False, query_lens=[n],
                               start_positions=[pos], block_tables_list=[table])
        outs.append(paged_attention(q[pos:pos + n], k[pos:pos + n], v[pos:pos + n], kp, vp, batch,
                                    HD ** -0.5))
        pos += n
    torch.testing.assert_close(torch.cat(outs), want)


def test_batched_decode_matches_dense_per_sequence():
    torch.manual_seed(1)
    kp, vp = torch.zeros(PAGES + 1, PAGE, KVH, HD), torch.zeros(PAGES + 1, PAGE, KVH, HD)
    lens = [1, 5, 12, 8]
    pages = torch.randperm(PAGES)
    tables, offset, seqs = [], 0, []
    for n in lens:
        tables.append(pages[offset: offset + -(-n // PAGE)])
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
    batch = AttentionBatch(slots=slots, is_decode=True, block_tables=block_tables,
                           context_lens=positions + 1)
    got = paged_attention(torch.stack([q[-1] for q, _, _ in seqs]), torch.stack([k[-1] for _, k, _ in seqs]),
                          torch.stack([v[-1] for _, _, v in seqs]), kp, vp, batch, HD ** -0.5)
    for i, (q, k, v) in enumerate(seqs):
        torch.testing.assert_close(got[i], _dense(q, k, v, 0)[-1])


def test_kv_write_touches_only_scheduled_slots():
    kp = torch.full((PAGES + 1, PAGE, KVH, HD), float("nan"))
    vp = kp.clone()
    table = torch.tensor([7, 3, 19])
    positions = torch.arange(2, 10)
    batch = AttentionBatch(slots=_slots(table, positions), is_decode=False, query_lens=[8],
                           start_positions=[2], block_tables_list=[table])
    k = torch.randn(8, KVH, HD)
    # start > 0 makes attention read cached slots 0-1 (NaN); only the writes are checked here.
    paged_attention(torch.randn(8, HEADS, HD), k, k.clone(), kp, vp, batch, 1.0)
    written = torch.zeros(PAGES + 1, PAGE, dtype=torch.bool)
    flat = written.view(-1)
    flat[_slots(table, positions)] = True
    assert not torch.isnan(kp[written]).any()
    assert torch.isnan(kp[~written]).all()
    torch.testing.assert_close(kp.view(-1, KVH, HD)[_slots(table, positions)], k)
