"""Chunked prefill and phase rotation in the scheduler; priority with aging on a fake clock."""

from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.router.core.kv_manager import KVManager
from shardline.router.core.page_manager import PageManager
from shardline.router.core.scheduler import Scheduler
from shardline.router.core.sequence import Sampling, Sequence
from shardline.router.core.step import Phase


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _seq(i, prompt_len, max_new, priority=0, base=0):
    return Sequence(
        seq_id=i,
        request_id=str(i),
        prompt_ids=[base + t for t in range(prompt_len)],
        max_new_tokens=max_new,
        sampling=Sampling(),
        priority=priority,
    )


@settings(max_examples=150, deadline=None)
@given(
    chunk=st.sampled_from([1, 3, 7, 64]),
    budget=st.sampled_from([4, 16, 100]),
    reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=12),
    cancel_at=st.lists(st.integers(0, 60), max_size=3),
    mixed=st.booleans(),
    pair_cost=st.sampled_from([0.0, 0.02, 0.5]),
    groups=st.sampled_from([1, 2, 3]),
)
def test_chunked_schedules_keep_their_promises(chunk, budget, reqs, cancel_at, mixed, pair_cost, groups):
    pages = PageManager(40, 4)
    sched = Scheduler(
        KVManager(pages),
        max_batch=4,
        max_batch_tokens=budget,
        chunk_size=chunk,
        mixed_steps=mixed,
        pair_cost=pair_cost,
        layer_groups=groups,
        num_layers=5,
    )
    assert sched.layer_groups == (1 if mixed or not chunk else groups), "layer groups apply to chunks of whole layers"
    group = None  # the chunk in layer groups: (sequence, its tokens, where its last group ended)
    seqs = [_seq(i, p, n, base=100 * (i % 3)) for i, (p, n, _) in enumerate(reqs)]
    arrivals = {s: a for s, (_, _, a) in zip(seqs, reqs)}
    last_ran = {Phase.DECODE: 0, Phase.CONTINUE: 0}
    steps = 0
    # Admit may have waiting work it cannot run (batch full, no pages), so its bound is on being
    # asked: the rotation offers it a step at least every 3 steps, and takes the step it offers.
    asked = []
    real_admit = sched._admit

    def admit(budget):
        step = real_admit(budget)
        asked.append(step)
        return step

    sched._admit = admit
    last_asked = 0
    for t in range(1500):  # chunks of 1 in 3 layer groups take hundreds of steps
        for s in seqs:
            if arrivals[s] == t and sched.kv.can_ever_fit(s.max_tokens):
                sched.add(s)
        if t in cancel_at and sched.running:
            if group and group[0] is sched.running[0]:
                group = None
            sched.finish(sched.running[0])
        had = {Phase.DECODE: bool(sched.decoding), Phase.CONTINUE: bool(sched.prefilling)}
        before = {s: s.num_computed for s in sched.running}
        decoding = len(sched.decoding)
        alone = len(sched.running) + len(sched.waiting) == 1
        step = sched.schedule()
        if step is None:
            asked.clear()
            assert not sched.has_work() or not (sched.decoding or sched.prefilling)
            if not sched.has_work() and t > 3:
                break
            continue
        assert len(set(step.seqs)) == len(step.seqs), "a request twice in one step"
        if asked:
            offered = asked[-1]
            assert offered is None or offered.chunks == step.chunks, "admit offered a step that did not run"
        last_asked = steps + 1 if asked else last_asked
        asked.clear()
        decodes = [s for s in step.scheduled if s.decode]
        assert step.scheduled[: len(decodes)] == decodes, "decode rows come first"
        assert all(len(s.tokens) == 1 for s in decodes)
        chunks = [(s.seq, s.tokens) for s in step.chunks]
        if step.phase is not Phase.DECODE:
            assert step.num_tokens <= budget or len(chunks) == 1
            assert all(len(i) <= chunk for _, i in chunks)
        if mixed:  # every step decodes every decoding sequence
            assert step.num_decode == decoding
        if step.layer_start or step.partial:  # a layer group: one chunk, of a prompt longer than one
            ((seq, inputs),) = chunks
            assert step.num_decode == 0 and sched.layer_groups > 1
            assert len(inputs) < len(seq.prompt_ids) - seq.cached_prompt_tokens
            assert 0 <= step.layer_start < (step.layer_end or 5) <= 5
        elif sched.layer_groups > 1 and any(
            len(i) < len(seq.prompt_ids) - seq.cached_prompt_tokens for seq, i in chunks
        ):
            assert alone, "a long prompt's chunk ran whole while other work waited or ran"
        if step.layer_start:  # the next group of the chunk in groups, before any other chunk of it
            assert group is not None and (group[0], group[1], group[2]) == (*chunks[0], step.layer_start)
        elif group is not None:
            assert group[0] not in step.seqs, "a sequence's chunk interrupted by another step of it"
            assert not step.partial, "a second chunk started in groups while one is mid-group"
        group = (*chunks[0], step.layer_end) if step.partial else None if step.layer_start else group
        steps += 1
        ran = {Phase.DECODE: step.num_decode > 0, Phase.CONTINUE: step.phase is Phase.CONTINUE}
        # Rotation bounds: Decode runs at least every 2 steps; Continue and Admit every 6 (a
        # round's pair in either order: Decode, Admit, Decode, Continue, then Decode, Continue,
        # Decode, Admit), with mixed steps every 3.
        bound = {Phase.DECODE: 2, Phase.CONTINUE: 3 if mixed else 6}
        for phase in last_ran:
            if ran[phase] or not had[phase]:
                last_ran[phase] = steps
            assert steps - last_ran[phase] < bound[phase], f"{phase} starved"
        if sched.waiting or step.phase is Phase.ADMIT:
            assert steps - last_asked < bound[Phase.CONTINUE], "admit not asked while requests waited"
        else:
            last_asked = steps
        sched.complete(step)
        for seq, inputs, emit in ((s.seq, s.tokens, s.emit) for s in step.scheduled):
            computed = 0 if step.partial else len(inputs)  # a chunk's positions count after its last layer
            assert seq.num_computed == before.get(seq, seq.cached_prompt_tokens) + computed
            assert emit == (seq.num_computed >= len(seq.prompt_ids))  # only the final chunk samples
            if emit:
                seq.output_ids.append(1)
                if len(seq.output_ids) >= seq.max_new_tokens:
                    sched.finish(seq)
        pages.check()
    assert not sched.has_work()
    assert pages.referenced == 0 and pages.reserved == 0


def test_a_long_prompt_cannot_monopolize_prefill_or_starve_decodes_and_a_shorter_one_goes_first():
    pages = PageManager(200, 4)
    sched = Scheduler(KVManager(pages), max_batch=8, max_batch_tokens=8, chunk_size=8)
    long, short, decoder = _seq(1, 200, 2), _seq(2, 20, 2, base=1000), _seq(3, 3, 50, base=2000)
    sched.add(decoder)
    step = sched.schedule()
    sched.complete(step)
    decoder.output_ids.append(5)
    sched.add(long)
    sched.add(short)
    phases, served = [], []
    for _ in range(16):
        step = sched.schedule()
        sched.complete(step)
        for s in step.scheduled:
            if s.emit:
                s.seq.output_ids.append(5)
        phases.append(step.phase)
        served.append([s.seq_id for s in step.seqs if s is not decoder])
    # A decoding sequence waits for one prefill step at most: Decode follows each.
    assert all(Phase.DECODE in phases[i : i + 2] for i in range(len(phases) - 1)), phases
    # The short prompt is admitted in the round after the long one's first chunk, before its
    # second (shortest first); then round robin (one 8-token chunk fits the budget): 1, 2, 1,
    # and the short prompt's last 4 tokens share a step with 4 of the long one's.
    assert list(zip(phases, served))[:6] == [
        (Phase.DECODE, []),
        (Phase.ADMIT, [1]),
        (Phase.DECODE, []),
        (Phase.ADMIT, [2]),
        (Phase.DECODE, []),
        (Phase.CONTINUE, [1]),
    ]
    continues = [ids for ids, phase in zip(served, phases) if phase is Phase.CONTINUE]
    assert continues[:4] == [[1], [2], [1], [2, 1]]
    assert short in sched.decoding and short.num_computed > 20  # prefilled, now decoding
    assert long in sched.prefilling and long.num_computed < 200


def test_a_long_prompts_chunks_run_in_layer_groups_that_a_short_prompt_and_decodes_cut_between():
    pages = PageManager(200, 4)
    sched = Scheduler(KVManager(pages), max_batch=8, max_batch_tokens=8, chunk_size=8, layer_groups=3, num_layers=6)
    assert sched.layer_bounds == [0, 2, 4, 6]
    long, short, decoder = _seq(1, 20, 1), _seq(2, 8, 1, base=1000), _seq(3, 3, 7, base=2000)
    sched.add(decoder)
    sched.add(long)
    steps = []
    for i in range(14):
        if i == 3:  # arrives while the long prompt's first chunk runs its first group
            sched.add(short)
        step = sched.schedule()
        sched.complete(step)
        for s in step.scheduled:
            if s.emit:
                s.seq.output_ids.append(5)
                if len(s.seq.output_ids) >= s.seq.max_new_tokens:
                    sched.finish(s.seq)
        # (phase, sequences, layer range; 0 at the end: through the last layer)
        steps.append((step.phase.name[0], [s.seq_id for s in step.seqs], step.layer_start, step.layer_end or 0))
    assert steps == [
        ("A", [3], 0, 0),
        ("D", [3], 0, 0),
        ("A", [1], 0, 2),  # the long prompt's first chunk: layers 0-1 (its prompt needs 3)
        ("D", [3], 0, 0),
        ("A", [2], 0, 0),  # the short prompt, whole, before the chunk's next group
        ("D", [3], 0, 0),
        ("C", [1], 2, 4),
        ("D", [3], 0, 0),
        ("C", [1], 4, 0),  # to the last layer
        ("D", [3], 0, 0),
        ("C", [1], 0, 2),
        ("D", [3], 0, 0),
        ("C", [1], 2, 0),  # the decoder is done: with nothing else to run, the rest of the layers at once
        ("C", [1], 0, 0),
    ]  # and the last chunk whole
    assert long.num_computed == 20 and long.output_ids and short.output_ids


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 512),
    start=st.integers(0, 40000),
    pair_cost=st.sampled_from([0.0, 1152 / 3538944, 1e-3, 0.05, 2.0]),
)
def test_a_chunk_late_in_a_prompt_holds_the_most_tokens_that_cost_what_a_first_chunk_does(size, start, pair_cost):
    """n tokens after `start` cost n + pair_cost * (attention pairs to the tokens before each);
    a chunk is the largest n (at least 1, at most the chunk size) that costs no more than a
    chunk of `size` tokens at the start of a prompt. (1152 / 3538944: SmolLM2-135M's.)"""
    sched = Scheduler(
        KVManager(PageManager(4, 4)), max_batch=1, max_batch_tokens=1, chunk_size=size, pair_cost=pair_cost
    )

    def cost(n):
        return n + pair_cost * (n * start + n * (n - 1) / 2)

    limit = size + pair_cost * size * (size - 1) / 2
    n = sched.chunk_at(start)
    assert 1 <= n <= size
    assert n == 1 or cost(n) <= limit * (1 + 1e-9)
    assert n == size or cost(n + 1) > limit * (1 - 1e-9)
    assert sched.chunk_at(0) == size
    assert sched.chunk_at(start + 1) <= n


def test_priority_orders_admission_and_aging_bounds_the_wait():
    clock = FakeClock()
    pages = PageManager(64, 4)
    sched = Scheduler(KVManager(pages), max_batch=1, max_batch_tokens=100, aging_s=2.0, clock=clock)
    low = _seq(1, 4, 1, priority=0)
    sched.add(low)
    admitted_at = None
    for t in range(40):
        clock.now = float(t)
        sched.add(_seq(100 + t, 4, 1, priority=3))  # a steady stream of higher priority
        step = sched.schedule()
        sched.complete(step)
        for seq in step.seqs:
            seq.output_ids.append(1)
            sched.finish(seq)
            if seq is low:
                admitted_at = t
    # gap of 3 levels x 2 s of aging: admitted once it has waited longer than the newest arrival
    assert admitted_at is not None and 6 <= admitted_at <= 8


def test_higher_priority_is_admitted_first():
    clock = FakeClock()
    sched = Scheduler(KVManager(PageManager(64, 4)), max_batch=1, max_batch_tokens=100, clock=clock)
    a, b, c = _seq(1, 4, 1, priority=0), _seq(2, 4, 1, priority=5), _seq(3, 4, 1, priority=1)
    for s in (a, b, c):
        sched.add(s)
    order = []
    for _ in range(3):
        step = sched.schedule()
        sched.complete(step)
        order += step.seqs
        for s in step.seqs:
            sched.finish(s)
    assert order == [b, c, a]
