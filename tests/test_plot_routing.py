"""benchmarks/plot_routing.py redraws docs/routing_curves.png from the recorded runs it names (their keys must stay)."""

from benchmarks import plot_routing


def test_routing_curves_draw_from_the_recorded_runs(tmp_path):
    out = plot_routing.draw(str(tmp_path / "curves.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
