import pytest

from kdaserve.engine.block_manager import BlockManager
from kdaserve.engine.detokenizer import IncrementalDetokenizer
from kdaserve.engine.sampling_params import SamplingParams
from kdaserve.engine.sequence import Sequence
from kdaserve.engine.state_pool import StateSlotPool
from kdaserve.models.tokenizer import ByteTokenizer


def _seq(n: int) -> Sequence:
    return Sequence("r", list(range(n)), SamplingParams(), IncrementalDetokenizer(ByteTokenizer(), []))


def test_state_slots_never_hand_out_the_null_slot():
    pool = StateSlotPool(4)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [1, 2, 3] and pool.num_free == 0 and pool.capacity == 3
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate()
    pool.free(got[0])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(got[0])
    with pytest.raises(RuntimeError):
        pool.free(0)


def test_blocks_grow_with_the_context_and_return_whole():
    bm = BlockManager(num_blocks=6, block_size=4)
    s = _seq(5)
    assert bm.extra_blocks_for(s, 5) == 2
    bm.grow(s, 5)
    assert len(s.block_table) == 2 and 0 not in s.block_table
    bm.grow(s, 8)           # still fits in 2 blocks
    assert len(s.block_table) == 2
    bm.grow(s, 9)
    assert len(s.block_table) == 3 and bm.num_used == 3
    assert bm.can_grow(s, 20) and not bm.can_grow(s, 21)   # 5 real blocks in all
    bm.free(s)
    assert bm.num_used == 0 and bm.num_free == 5 and s.block_table == []


def test_both_pools_refuse_a_size_without_a_real_entry_and_a_double_free():
    with pytest.raises(ValueError, match="state slot pool needs the null state slot"):
        StateSlotPool(1)
    with pytest.raises(ValueError, match="KV block pool needs the null KV block"):
        BlockManager(num_blocks=1, block_size=4)
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = type("Seq", (), {"block_table": []})()
    bm.grow(seq, 8)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match="KV block .* freed twice"):
        bm.free(seq)


def test_the_cached_block_table_array_follows_growth_and_a_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    other, s = _seq(4), _seq(8)
    bm.grow(s, 8)
    assert s.block_table_array().tolist() == s.block_table and s.block_table_array().dtype.name == "int32"
    bm.grow(s, 9)
    assert s.block_table_array().tolist() == s.block_table and len(s.block_table) == 3
    before = list(s.block_table)
    bm.free(s)                # preempted: its blocks go back ...
    bm.grow(other, 4)         # ... someone takes one, and it regrows to the same length elsewhere
    bm.grow(s, 9)
    assert s.block_table != before and s.block_table_array().tolist() == s.block_table


def test_reset_refuses_while_an_id_is_in_use_and_then_restores_a_fresh_order():
    pool = StateSlotPool(4)
    fresh = [pool.allocate() for _ in range(3)]
    for i in fresh:
        pool.free(i)
    held = pool.allocate()
    with pytest.raises(RuntimeError, match=r"still in use .*free every one before reset"):
        pool.reset()
    pool.free(held)
    pool.reset()
    assert [pool.allocate() for _ in range(3)] == fresh


def test_capacity_errors_give_sizes_in_the_unit_that_fits():
    from kdaserve.engine.caches import format_bytes

    assert format_bytes(27 * 1024 + 512) == "27.50 KiB"      # kimi-tiny's state was printed "0.0 MiB"
    assert format_bytes(41 * 2**20) == "41.00 MiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(100) == "100 B"


def test_capacity_error_counts_sequences_not_slots_and_offers_only_what_helps():
    from kdaserve.engine.memory import capacity_error

    kw = dict(per_slot=1 << 20, one_seq=1 << 20, per_block=1 << 10, block_size=16, max_model_len=512,
              gpu_memory_utilization=0.9)
    free = 100 << 20   # 99 slots beside one sequence's attention cache; slot 0 is the null slot
    plain = capacity_error(max_num_seqs=1000, num_spec_tokens=0, state=1001 << 20, free=free, **kw)
    assert "(1.00 MiB per state slot)" in plain and ": 98 sequences fit; lower --max-num-seqs to at most 98," in plain
    assert "--max-model-len" not in plain, "a shorter context cannot make room when the state alone is too big"
    spec = capacity_error(max_num_seqs=1000, num_spec_tokens=3, state=4001 << 20, free=free, **kw)
    assert "4 slots per sequence with num_speculative_tokens=3" in spec and ": 24 sequences fit;" in spec
    shorter = capacity_error(max_num_seqs=10, num_spec_tokens=0, state=11 << 20, free=(23 << 20) // 2, **kw)
    assert ": 9 sequences fit" in shorter and "or --max-model-len to at most 8176," in shorter   # 511 blocks of 16
    cached = capacity_error(max_num_seqs=1000, num_spec_tokens=0, state=1501 << 20, free=free, num_checkpoint_slots=500, **kw)
    assert "with 500 prefix-cache checkpoint slots (--prefix-cache-states)" in cached
    assert ": 0 sequences fit;" in cached, "the checkpoint slots take the memory first"
    few = capacity_error(max_num_seqs=1000, num_spec_tokens=0, state=1041 << 20, free=free, num_checkpoint_slots=40, **kw)
    assert ": 58 sequences fit;" in few   # 99 slots - 1 null - 40 checkpoints
