"""bench/engine.py's timing: the two sides alternate, so that the host's drift hits both alike."""

import io

from tqdm import tqdm

from bench.engine import measure


def test_the_sides_alternate_in_flipped_order_and_each_gets_its_own_medians():
    calls = []

    def side(name, first, full):
        def run(tokens):
            calls.append((name, tokens))
            return first if tokens == 1 else full + len(calls) * 1e-3  # the full runs drift upward

        return run

    runs = {"ours": side("ours", 0.01, 1.0), "HF": side("HF", 0.03, 2.0)}
    with tqdm(total=2 + 4 * 3, file=io.StringIO()) as bar:
        medians = measure(runs, 64, 3, bar, "batch 1")
        assert bar.n == 14
    assert calls[:2] == [("ours", 64), ("HF", 64)]  # a warm-up each
    order = [name for name, tokens in calls[2:] if tokens == 64]
    assert order == ["ours", "HF", "HF", "ours", "ours", "HF"]
    assert calls[2:8] == [("ours", 1), ("ours", 1), ("ours", 64), ("HF", 1), ("HF", 1), ("HF", 64)]  # one untimed
    full_ours = sorted(1.0 + (i + 1) * 1e-3 for i, (n, t) in enumerate(calls) if n == "ours" and t == 64 and i >= 2)
    assert medians["ours"] == (0.01, full_ours[1])
    assert medians["HF"][0] == 0.03 and 2.0 < medians["HF"][1] < 2.02
