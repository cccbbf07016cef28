"""scripts/bench/vs_official.py's grid (the comparison itself needs the paper's released scheduler,
which this repository does not ship): pp 4..16, m p..8p, every cap from V-Min's to 2p."""
import pytest
from bench_scripts import load_bench

from megatron_vshape.planner import search

bench = load_bench("vs_official")


def test_the_grid_spans_every_microbatch_count_and_cap_from_v_mins():
    grid = list(bench.points(range(4, 17), 128, bench.COST_SETS))
    for pp in range(4, 17):
        low = search.budget_steps(pp, pp, high=2.0)[0][0]
        mine = [(m, c, cap) for p, m, c, cap in grid if p == pp]
        assert {m for m, _, _ in mine} == set(range(pp, 8 * pp + 1))
        assert {cap for _, _, cap in mine} == set(range(low, 2 * pp + 1))
        assert len(mine) == len(set(mine)) == (7 * pp + 1) * len(bench.COST_SETS) * (2 * pp + 1 - low)


def test_min_m_and_max_m_cut_the_grid_and_keep_its_order():
    whole = list(bench.points(range(4, 17), 128, bench.COST_SETS))
    band = list(bench.points(range(4, 17), 64, bench.COST_SETS, min_m=33))
    assert band == [p for p in whole if 33 <= p[1] <= 64]
    assert band and min(p[1] for p in band) == 33 and max(p[1] for p in band) == 64
    assert len(whole) == 39_417  # the grid's size docs/planner.md quotes


def test_against_replans_v_auto_at_an_earlier_runs_points(tmp_path, capsys):
    """--against: v-auto re-planned at the stored points' official peaks and compared with the
    official makespans stored there (the released scheduler's figures of tests/unit/test_reorder.py)."""
    earlier, after = tmp_path / "earlier.csv", tmp_path / "after.csv"
    rows = [{"pp": 6, "microbatches": 9, "costs": "1,1,1,0", "cap": 8, "official": 32.5, "official_peak": 8, "official_s": 1.0},
            {"pp": 4, "microbatches": 8, "costs": "2,2,2,0.25", "cap": 6, "official": 1e9, "official_peak": 6, "official_s": 1.0}]
    with open(earlier, "w", newline="") as f:
        writer = bench.csv.DictWriter(f, fieldnames=bench.FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    assert bench.main(["--against", str(earlier), "--csv", str(after)]) == 0
    with open(after, newline="") as f:
        got = list(bench.csv.DictReader(f))
    assert [(r["pp"], r["microbatches"], r["cap"]) for r in got] == [("6", "9", "8"), ("4", "8", "6")]
    for row, stored in zip(got, rows):
        assert float(row["official"]) == stored["official"]
        assert int(row["ours_peak"]) <= stored["official_peak"]
        assert abs(float(row["gap"]) - (float(row["ours"]) / stored["official"] - 1)) < 1e-12
    assert float(got[0]["ours"]) <= 32.5
    assert "points 2  worse 0" in capsys.readouterr().out


def test_without_official_or_against_it_says_what_to_give(capsys):
    with pytest.raises(SystemExit):
        bench.main([])
    assert "--against CSV" in capsys.readouterr().err
