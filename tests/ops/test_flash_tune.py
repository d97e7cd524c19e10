"""The geometry of flash's segment cost model (plan.py) and the constants tools/tune_flash.py derives from
launch times (`python -m tools.tune_flash --calibrate` on a GPU)."""

import pytest

from kdaserve.ops.kda.flash.config import FlashConfig
from kdaserve.ops.kda.flash.plan import full_rounds, segmented_rounds
from tools.tune_flash import derive_cost_constants

CFG = FlashConfig()  # defaults: 32-token chunks, one K2 program per SM, map pass V-halves, 2 per SM


def test_chunk_steps_of_the_unsegmented_recurrence():
    assert full_rounds([8192], 64, 32, 132, CFG) == 256            # 64 chains, one per SM: the longest
    assert full_rounds([1024] * 8, 96, 32, 132, CFG) == 187        # 768 chains of 32 steps on 132 SMs
    assert full_rounds([8192, 100], 16, 32, 132, CFG) == 256


def test_chunk_steps_of_the_segmented_map_pass():
    # 16 heads x 32K in 8K segments: 16 x 2 V-halves x (2 x 4 - 1) = 224 programs, one round of 264.
    assert segmented_rounds([32768], 16, 128, 32, 8192, 132, CFG) == (256, 4)
    # 16 heads x 128K in 7712-token segments: 17 pieces, 1056 programs, 4 rounds of 241 steps.
    assert segmented_rounds([131072], 16, 128, 32, 7712, 132, CFG) == (964, 17)
    # A sequence shorter than a segment is one piece and needs no identity map.
    assert segmented_rounds([100, 20000], 4, 128, 32, 8192, 132, CFG) == (256, 3)


def test_cost_constants_from_launch_times():
    """The sixth session's H200 launch times (docs/perf-notes.md): 64 heads x 8K recurrence 0.767 ms;
    16 heads x 32K in 8K segments: maps 0.5416, scan 0.0164, correction 0.1943 ms."""
    steps, pieces = segmented_rounds([32768], 16, 128, 32, 8192, 132, CFG)
    c = derive_cost_constants(0.767, full_rounds([8192], 64, 32, 132, CFG), 0.5416, 0.0164, 0.1943,
                              steps, pieces, 32768 * 16)
    assert c == pytest.approx({"cost_step_full_us": 2.996, "cost_step_seg_us": 2.116,
                               "cost_scan_step_us": 4.1, "cost_token_head_seg_ns": 0.3706}, rel=1e-3)
    assert set(c) <= set(FlashConfig.__dataclass_fields__)  # the names config.py uses


def test_config_overrides_for_benchmark_columns():
    """bench_prefill / profile_prefill --config: 'field=value,...' typed as each field is."""
    from kdaserve.ops.kda.flash.config import with_overrides

    c = with_overrides(CFG, "prepare_half_dots=0,chunk=16,cost_step_full_us=2.5,unbounded_intra=nested")
    assert (c.prepare_half_dots, c.chunk, c.cost_step_full_us, c.unbounded_intra) == (False, 16, 2.5, "nested")
    assert with_overrides(CFG, "prepare_prefetch=true").prepare_prefetch and with_overrides(CFG, "default") is CFG
    with pytest.raises(ValueError, match="no FlashConfig field 'prepare_prefech'.*prepare_prefetch"):
        with_overrides(CFG, "prepare_prefech=1")
    with pytest.raises(ValueError, match="unbounded_chunk must be 16 or 32"):
        with_overrides(CFG, "unbounded_chunk=8")
    assert with_overrides(CFG, "prepare_maxnreg=128").prepare_maxnreg == 128 and CFG.prepare_maxnreg == 168


def test_k1_register_caps_by_target():
    """K1's register caps apply on NVIDIA (Triton refuses the option on AMD: no cap there); every
    target takes fp16 operands for the inverse's products (each builds without spills)."""
    from kdaserve.ops.kda.flash.config import config_for_target

    assert config_for_target("sm_90").prepare_maxnreg == 168 and config_for_target("sm_100").prepare_maxnreg == 168
    assert config_for_target("gfx942").prepare_maxnreg == 0 and config_for_target("gfx950").prepare_maxnreg == 0
    assert all(config_for_target(t).prepare_half_dots for t in ("sm_90", "sm_100", "gfx942", "gfx950"))
