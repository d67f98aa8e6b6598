"""The stages' table artifacts, built without Prefect: every row has every column, one number format, the plan
that trains marked, a kept plan with its own figures, and refusals said once."""

from __future__ import annotations

from shardflow.planner.report import PlanSummary, StrategyRefused
from shardflow.reporting.tables import comparison_rows, number, profile_description, refusals_markdown


def summary(strategy: str, bytes_per_step: float, comm_s: float) -> PlanSummary:
    return PlanSummary(
        strategy=strategy, dedup="device", devices=2, budget_bytes_per_device=10**9,
        memory_bytes_per_device=(1_500_000, 2_250_000), lookup_bytes_per_step=bytes_per_step,
        sync_bytes_per_step=0.0, bytes_per_step=bytes_per_step, inter_node_bytes_per_step=bytes_per_step / 2,
        comm_time_s_per_step=comm_s, round_payload_s_per_step={}, link_time_s_per_step=comm_s, busiest_link="a",
        row_wise_mod_comm_time_s_per_step=2 * comm_s, lower_bound_comm_time_s_per_step=comm_s / 2, gap_closed=0.5,
        tiers={}, node_rows_on_some_nodes=0, device_bytes_per_step=(bytes_per_step, bytes_per_step))


ROWS = [summary("flexshard", 1_234_567.0, 3.58e-4), summary("row-wise-mod", 2_000_000.0, 7.1e-4),
        StrategyRefused("table-wise", "table-wise: table item (4,000,000 bytes) fits on no device")]


def test_the_chosen_fresh_plan_trains_and_every_row_has_every_column():
    table = comparison_rows(ROWS, "flexshard", replanned=True, kept=None)
    assert [(r["strategy"], r["plan"], r["trains"]) for r in table] == [
        ("flexshard", "made", "yes"), ("row-wise-mod", "made", ""), ("table-wise", "none: see plan-refusals", "")]
    assert len({tuple(r) for r in table}) == 1
    assert (table[0]["MB_per_step"], table[0]["comm_us"], table[0]["max_MB_per_device"]) == ("1.235", "358.0", "2.250")


def test_a_kept_plan_trains_with_its_own_figures_not_the_fresh_ones():
    kept = summary("flexshard", 1_500_000.0, 4.0e-4)
    table = comparison_rows(ROWS, "flexshard", replanned=False, kept=kept)
    assert [(r["plan"], r["trains"]) for r in table if r["strategy"] == "flexshard"] == [("made", ""), ("kept", "yes")]
    assert table[-1]["comm_us"] == "400.0"


def test_refusals_name_each_strategy_once_and_none_when_every_strategy_made_a_plan():
    assert refusals_markdown(ROWS) == ("# Strategies that made no plan\n\n"
                                       "- **table-wise**: table item (4,000,000 bytes) fits on no device")
    assert refusals_markdown(ROWS[:2]) is None


def test_numbers_and_the_profiles_window():
    assert (number(5328.0, 0), number(358.05, 1), number(None, 3)) == ("5,328", "358.1", "")
    assert profile_description("ds", 0, None).startswith("Row access skew of ds (top_1pct_share")
    assert "training examples of parts 3.. read it (histories of up to 20 items)" in profile_description("ds", 2, 20)
