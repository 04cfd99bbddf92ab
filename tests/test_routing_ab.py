"""benchmarks/routing_ab.py: the runs it launches and what it reads from their metrics."""

import pytest

from benchmarks import routing_ab


def test_each_run_is_the_documented_command():
    argv, env = routing_ab.command("round_robin", "C.py", 14, "W", ["--x=1"])
    assert env == {"ROUTING": "round_robin"} and argv[1:3] == ["-m", "benchmarks.train_solve_variant"]
    assert "--config.balancing.learning_rate=0.0" in argv and argv[-1] == "--x=1"
    argv, env = routing_ab.command("controller", "C.py", 14, "W", [])
    assert env == {} and argv[2] == "launch.train" and not any("learning_rate" in a for a in argv)
    assert "--config.model.overrides.solve_impl=xla" in routing_ab.command("xla_solve", "C.py", 14, "W", [])[0]
    argv, env = routing_ab.command("no_equal_shares", "C.py", 14, "W", [])
    assert env == {"EQUAL_SHARES": "off"} and argv[2] == "benchmarks.train_solve_variant"
    argv, env = routing_ab.command("rounds8", "C.py", 14, "W", [])
    assert env == {"SOLVE_ROUNDS": "8"} and argv[2] == "benchmarks.train_solve_variant"
    assert routing_ab.command("warm8", "C.py", 14, "W", [])[1] == {"SOLVE_ROUNDS": "8", "SOLVE_START": "zero"}


def test_run_names_with_a_round_count_are_known():
    for good in ("warm8", "rounds12", "collapsed"):
        assert routing_ab.unknown_runs([good]) == []
    assert routing_ab.unknown_runs(["warm", "cold8", "controller"]) == ["warm", "cold8"]


def test_summary_times_steps_after_warmup_and_keeps_every_load():
    rows = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 10.0 * s, "max_load": 1.0 + s / 10, "min_load": 1.0 - s / 10}
            for s in range(1, 6)]
    rows.append({"step": 5, "eval_loss": 1.0})  # an evaluation row: no routing figures
    out = routing_ab.summarize(rows)
    assert out["tokens_per_s_median_steps_3_on"] == 40  # steps 3, 4, 5
    assert out["steps"] == 5 and out["loss_last"] == 0.0
    assert out["max_load"] == [1.1, 1.2, 1.3, 1.4, 1.5] and out["min_load"][0] == 0.9 and out["moved"] == [0.0] * 5
    with pytest.raises(ValueError, match="tokens_per_s"):
        routing_ab.summarize(rows[:2])


def test_repeats_interleave_and_report_their_spread():
    assert routing_ab.schedule(["a", "b"], 2) == [("a", "a"), ("b", "b"), ("a#2", "a"), ("b#2", "b")]
    key = "tokens_per_s_median_steps_3_on"
    runs = {"a": {key: 100}, "b": {key: 90}, "a#2": {key: 104}, "b#2": {"timed_out_s": 240}, "a#3": {key: 98}}
    out = routing_ab.spread(runs)
    assert out["a"] == {"tokens_per_s": [100, 104, 98], "median": 100, "range_over_median": 0.06}
    assert out["b"] == {"tokens_per_s": [90], "median": 90, "range_over_median": 0.0}
