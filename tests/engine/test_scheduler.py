"""The scheduler alone (no model): budgets, chunking, step composition, preemption, admission."""

from kdaserve.engine.block_manager import BlockManager
from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.sampling_params import SamplingParams
from kdaserve.engine.scheduler import Scheduler
from kdaserve.engine.sequence import Sequence, SequenceStatus
from kdaserve.engine.state_pool import StateSlotPool
from kdaserve.models.tokenizer import ByteTokenizer


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, [1] * n, SamplingParams(), IncrementalDetokenizer(ByteTokenizer(), []))


def _sched(max_seqs=4, budget=16, blocks=64, block_size=4) -> Scheduler:
    return Scheduler(max_seqs, budget, StateSlotPool(max_seqs + 1), BlockManager(blocks, block_size))


def _run(batch) -> None:
    """What the engine does after a step: advance computed tokens, sample for finished prompts."""
    for s in batch.decodes:
        s.num_computed_tokens += 1
    for s, n in zip(batch.prefills, batch.num_new_tokens):
        s.num_computed_tokens += n
    for s in batch.sequences:
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


def test_long_prompt_is_chunked_under_the_budget_and_decodes_share_steps():
    sch = _sched(budget=8)
    a, b = _seq("a", 3), _seq("b", 20)
    sch.add(a), sch.add(b)
    batch = sch.schedule()
    assert batch.prefills == [a, b] and batch.num_new_tokens == [3, 5] and batch.num_tokens == 8
    _run(batch)
    batch = sch.schedule()        # a decodes first, b continues its prompt
    assert batch.decodes == [a] and batch.prefills == [b] and batch.num_new_tokens == [7]
    assert a.state_slot > 0 and b.state_slot > 0 and a.state_slot != b.state_slot
    _run(batch)
    batch = sch.schedule()
    assert batch.decodes == [a] and batch.num_new_tokens == [7]
    _run(batch)
    batch = sch.schedule()        # b's last prompt token has history: a decode for KDA
    assert batch.decodes == [a, b] and batch.prefills == []


def test_max_num_seqs_and_slots_bound_admission():
    sch = _sched(max_seqs=2, budget=100)
    seqs = [_seq(str(i), 2) for i in range(3)]
    for s in seqs:
        sch.add(s)
    batch = sch.schedule()
    assert batch.prefills == seqs[:2] and list(sch.waiting) == [seqs[2]]
    assert seqs[2].state_slot == 0 and seqs[2].status == SequenceStatus.WAITING


def test_admission_waits_for_blocks():
    sch = _sched(budget=100, blocks=4, block_size=4)   # 3 real blocks
    a, b = _seq("a", 9), _seq("b", 4)
    sch.add(a), sch.add(b)
    batch = sch.schedule()
    assert batch.prefills == [a] and list(sch.waiting) == [b]


def test_out_of_blocks_preempts_the_newest_by_recompute():
    sch = _sched(budget=100, blocks=5, block_size=4)   # 4 real blocks
    a, b = _seq("a", 8), _seq("b", 8)
    sch.add(a), sch.add(b)
    _run(sch.schedule())          # both prefilled: all 4 blocks used, each got a token
    assert sch.blocks.num_free == 0
    slot_b = b.state_slot
    batch = sch.schedule()        # a needs a 3rd block: b (newest) is preempted
    assert batch.preempted == [b] and batch.decodes == [a]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.state_slot == 0 and sch.slots.num_used == 1 and slot_b not in sch.slots._used
    assert list(sch.waiting) == [b] and b.num_tokens == 9   # recomputes prompt + output


def test_a_request_alone_that_cannot_grow_preempts_itself():
    sch = _sched(budget=100, blocks=3, block_size=4)   # 2 real blocks
    a = _seq("a", 8)
    sch.add(a)
    _run(sch.schedule())
    batch = sch.schedule()
    assert batch.preempted == [a] and batch.is_empty and sch.slots.num_used == 0 and sch.blocks.num_used == 0


def test_finish_returns_everything():
    sch = _sched()
    a, b = _seq("a", 5), _seq("b", 5)
    sch.add(a), sch.add(b)
    sch.schedule()
    sch.finish(a, "stop")
    sch.finish(b, "abort")
    assert sch.slots.num_used == 0 and sch.blocks.num_used == 0 and not sch.has_unfinished()
    assert a.finish_reason == "stop" and b.is_finished
