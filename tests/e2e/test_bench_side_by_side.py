"""bench/side_by_side.py runs two real schedulers at once on PostgreSQL, B with the flags given, interleaves their
samples and ends with one JSON line of A/B figures."""

from __future__ import annotations

import pytest
from helpers.bench import bench_server, run_bench

pytestmark = pytest.mark.postgres


def test_two_schedulers_interleaved_give_a_figure_each_and_their_ratio(pg_url):
    out, proc = run_bench(
        "side_by_side.py",
        "--samples",
        "3",
        "--b-flag=--no-fence-in-pipeline",
        "--db",
        bench_server(pg_url),
        timeout=180,
    )
    assert out["bench"] == "side_by_side" and out["b_flags"] == ["--no-fence-in-pipeline"]
    for shape in ("g1x1", "g4x8"):
        figure = out[shape]
        assert figure["samples"] == 3 and figure["a_p50_ms"] > 0 and figure["b_p50_ms"] > 0
        assert figure["a_over_b"] == pytest.approx(figure["a_p50_ms"] / figure["b_p50_ms"], rel=0.01)
    assert "release_to_reserve" not in out
    assert "1 x 1:" in proc.stderr


def test_it_refuses_to_run_without_saying_what_b_is():
    with pytest.raises(AssertionError, match="say what B is"):
        run_bench("side_by_side.py", "--samples", "3", timeout=60)
